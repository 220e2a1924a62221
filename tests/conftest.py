"""Shared pytest set-up: import paths, the ``slow`` marker and generated-data
fixtures (see ``tests/datagen.py``).

Session-scoped fixtures are shared by all tests and must be treated as
read-only; a test that wants to modify the data copies it first.
"""
import sys
import types
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

# `import common` (package at the repo root), `from tests.datagen import ...`
# and `import datagen` must all work when running `python -m pytest tests`.
for _p in (str(TESTS_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# `tests` has no __init__.py (namespace package); make sure it resolves to this
# folder even if some installed distribution ships a top-level `tests` package.
_tests_mod = sys.modules.get("tests")
if _tests_mod is None or str(TESTS_DIR) not in [str(Path(p).resolve()) for p in
                                                 getattr(_tests_mod, "__path__", [])]:
    try:
        import tests as _tests_mod  # noqa: F401
        _ok = str(TESTS_DIR) in [str(Path(p).resolve()) for p in _tests_mod.__path__]
    except ImportError:
        _ok = False
    if not _ok:
        _tests_mod = types.ModuleType("tests")
        _tests_mod.__path__ = [str(TESTS_DIR)]
        sys.modules["tests"] = _tests_mod

from tests.datagen import (  # noqa: E402
    make_cifar100,
    make_imagefolder,
    make_resnet18_weights,
    make_tinyimagenet,
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a module that trains for minutes (deselect with "
                            "-m 'not slow'); run first")
    # pytest-xdist >= 3.6 hands out the files of `--dist loadfile` largest first (by number of
    # tests), which undid the order below: the slowest file, with 5 tests, started last and
    # ran alone for its last 10 minutes.  Keep the collection's order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# After the slow modules, those that start many processes, the longest first (their minutes
# on 2 cores): a long file handed out last ran alone for its last minute and a half while the
# other worker had nothing left.  The quick modules fill the end.
LONG_FIRST = ["test_reliability.py", "test_distributed_faults.py", "test_scripts.py",
              "test_multihost.py", "test_distributed.py", "test_classic_bugs.py",
              "test_workloads.py", "test_readme.py", "test_safety.py", "test_scale.py",
              "test_report.py", "test_bench.py"]


def pytest_collection_modifyitems(session, config, items):
    """The slow modules first, then LONG_FIRST, then the rest (a stable sort), so that under
    `-n 3 --dist loadfile` the workers end at about the same time."""
    def order(item):
        name = item.path.name
        rank = LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)
        return item.get_closest_marker("slow") is None, rank
    items.sort(key=order)


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory):
    """Data-dir root holding a generated ``cifar-100-python`` (200 train /
    100 test, 100 classes). Read-only."""
    root = tmp_path_factory.mktemp("cifar")
    make_cifar100(root, n_train=200, n_test=100, num_classes=100, seed=0)
    return root


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Data-dir root holding a generated ``tiny-imagenet-200`` (4 classes,
    6 train / 3 val images per class, 64x64 JPEGs). Read-only."""
    root = tmp_path_factory.mktemp("tiny")
    make_tinyimagenet(root, n_classes=4, n_train_per_class=6, n_val_per_class=3, seed=0)
    return root


@pytest.fixture(scope="session")
def resnet18_weights(tmp_path_factory):
    """Path to a random (seeded) torchvision resnet18 state_dict, 1000 classes.

    Its seed differs from the scripts' default --seed 0, so that a script that forgot to load
    the file would not start from the very same tensors by chance.
    """
    return make_resnet18_weights(tmp_path_factory.mktemp("weights") / "resnet18.pth",
                                 num_classes=1000, seed=1234)


@pytest.fixture(scope="session")
def imagefolder_dir(tmp_path_factory):
    """Root of an ImageNet-layout tree ``train/<wnid>/*.JPEG``,
    ``val/<wnid>/*.JPEG`` (3 classes, 4 train / 2 val each). Read-only."""
    root = tmp_path_factory.mktemp("imagefolder")
    make_imagefolder(root, n_classes=3, n_train_per_class=4, n_val_per_class=2, seed=0)
    return root
