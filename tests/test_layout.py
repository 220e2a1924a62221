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
    """A reader reaches the step from the main without opening another file: the batches come
    from the loader in the main's loop, backward() is called there, and so is what follows it:
    sync SGD's all_reduce of the gradients (its own `average_gradients`) and the optimizer's
    step, built in the main; for async SGD the server's update rule (`Server.update`)."""
    tree = tree_of(main)
    source = ast.unparse(tree)
    assert "loss.backward()" in source, f"{main}: no backward() in the main"
    assert ".epoch_batches(" in source, f"{main}: the loop does not take the loader's batches"
    if main == "async_sgd_cifar100.py":
        servers = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Server"]
        assert servers, "async_sgd_cifar100.py: no Server class"
        methods = {n.name: n for n in servers[0].body if isinstance(n, ast.FunctionDef)}
        assert "update" in methods, "the async update rule is not Server.update in the main"
        rule = ast.unparse(methods["update"])
        assert "theta.sub_(" in rule and "momentum" in rule, "Server.update does not step"
    else:
        assert "optimizer.step()" in source, f"{main}: no optimizer step in the main"
        assert "torch.optim.SGD(" in source, f"{main}: the optimizer is not built in the main"
    if main == "sync_sgd_cifar100.py":
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "dist.all_reduce(" in ast.unparse(functions["average_gradients"])
        assert "average_gradients(model" in ast.unparse(functions["train_one_epoch"])


@pytest.mark.parametrize("module", COMMON)
def test_a_long_module_says_why(module):
    path = os.path.join(ROOT, "common", f"{module}.py")
    with open(path) as f:
        lines = f.read().splitlines()
    if len(lines) > 260:
        doc = ast.get_docstring(tree_of(f"common/{module}.py")) or ""
        assert "Over 250 lines because" in doc, \
            f"common/{module}.py has {len(lines)} lines and no reason stated at its top"
