"""The layout a reader relies on: the mains import common/, never the other way round, no two
modules of common/ import each other, each main holds its own training step, and a long module
says why it is long."""
import ast
import os

import pytest

from helpers import ROOT

MAINS = ["resnet_cifar100.py", "resnet_tinyimagenet.py", "pretrained_cifar100.py",
         "sync_sgd_cifar100.py", "async_sgd_cifar100.py"]
COMMON = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "common"))
                if f.endswith(".py") and f != "__init__.py")


def tree_of(path):
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read(), path)


def imported_modules(path):
    """Top-level module names this file imports, with `common.x` and `from common import x`
    both read as `common.x`."""
    names = set()
    for node in ast.walk(tree_of(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: `from . import x` or `from .x import y` inside common/
                base = "common" + (f".{node.module}" if node.module else "")
                names.add(base)
            elif node.module == "common":
                names.update(f"common.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.update(f"common.{alias.name}" for alias in node.names)
    return names


def common_graph():
    return {m: {n.split(".")[1] for n in imported_modules(f"common/{m}.py")
                if n.startswith("common.") and n.split(".")[1] in COMMON}
            for m in COMMON}


def test_common_never_imports_a_main():
    mains = {m[:-3] for m in MAINS} | {"report"}
    for m in COMMON:
        assert not imported_modules(f"common/{m}.py") & mains, f"common/{m}.py imports a main"


def test_common_has_no_import_cycle():
    graph = common_graph()
    done, path = set(), []

    def visit(m):
        if m in path:
            cycle = path[path.index(m):] + [m]
            pytest.fail("import cycle in common/: " + " -> ".join(cycle))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in COMMON:
        visit(m)


@pytest.mark.parametrize("main", MAINS)
def test_each_main_holds_its_training_step(main):
    """backward() is written in the main itself (no call into common/ between the command line
    and backward), and so is what follows it: the optimizer's step, built in the main, or for
    async SGD the server's update rule (`Server.apply`)."""
    tree = tree_of(main)
    source = ast.unparse(tree)
    assert "loss.backward()" in source, f"{main}: no backward() in the main"
    if main == "async_sgd_cifar100.py":
        servers = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Server"]
        assert servers, "async_sgd_cifar100.py: no Server class"
        methods = {n.name for n in servers[0].body if isinstance(n, ast.FunctionDef)}
        assert "apply" in methods, "the async update rule is not Server.apply in the main"
    else:
        assert "optimizer.step()" in source, f"{main}: no optimizer step in the main"
        assert "torch.optim.SGD(" in source, f"{main}: the optimizer is not built in the main"


@pytest.mark.parametrize("module", COMMON)
def test_a_long_module_says_why(module):
    path = os.path.join(ROOT, "common", f"{module}.py")
    with open(path) as f:
        lines = f.read().splitlines()
    if len(lines) > 260:
        doc = ast.get_docstring(tree_of(f"common/{module}.py")) or ""
        assert "Over 250 lines because" in doc, \
            f"common/{module}.py has {len(lines)} lines and no reason stated at its top"
