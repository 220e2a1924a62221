"""No file the scripts read can run code: checkpoint.pt and the CIFAR-100 pickles.

Each crafted file carries an object whose unpickling creates a marker folder: the marker must
never appear, the run must end with exit 2 and one line, and nothing may be overwritten.
"""
import os
import pickle
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from common import checkpoint, data
from datagen import make_cifar100, snapshot_tree
from helpers import ROOT, child_env, ok, one_error_line

TIMEOUT = 240
SMALL = ["--device", "cpu", "--train-limit", "48", "--test-limit", "24", "--batch-size", "16"]


class RunsCode:
    """Unpickling this calls os.mkdir(marker): what a crafted file would do, made visible."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=child_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


def train(data_dir, out, epochs):
    return run("resnet_cifar100.py", "--data-dir", data_dir, "--out", out, "--epochs", epochs,
               *SMALL)


@pytest.fixture(scope="module")
def trained(cifar_dir, tmp_path_factory):
    """--out of a real 1-epoch run (read-only: tests copy it)."""
    out = tmp_path_factory.mktemp("safety") / "out"
    ok(train(cifar_dir, out, 1))
    return out


def copy_run(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    return out, str(out / "checkpoint.pt")


def real_state(trained):
    return torch.load(trained / "checkpoint.pt", map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("mode", ["resume", "evaluate"])
def test_crafted_checkpoint_is_refused_and_runs_nothing(trained, cifar_dir, tmp_path, mode):
    out, path = copy_run(trained, tmp_path)
    marker = tmp_path / "marker"
    state = real_state(trained)  # a real checkpoint, with one object that runs code
    state["extra"] = {"payload": RunsCode(marker)}
    torch.save(state, path)
    before = snapshot_tree(out)
    args = ["--evaluate"] if mode == "evaluate" else ["--epochs", 2]
    proc = run("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL, *args)
    one_error_line(proc, path, "refused", "--fresh")
    assert not marker.exists()
    assert snapshot_tree(out) == before  # the crafted file too is left as it was


def test_crafted_plain_pickle_checkpoint_is_refused(cifar_dir, tmp_path):
    """torch.load also reads plain (non-zip) pickles: refused as well, in one line."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    out.mkdir()
    with open(out / "checkpoint.pt", "wb") as f:
        pickle.dump({"format": checkpoint.FORMAT, "model": RunsCode(marker)}, f, protocol=4)
    before = snapshot_tree(out)
    proc = run("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL, "--evaluate")
    one_error_line(proc, out / "checkpoint.pt", "--fresh")
    assert not marker.exists()
    assert snapshot_tree(out) == before


def test_checkpoint_of_an_older_version_is_refused_and_fresh_starts_over(trained, cifar_dir,
                                                                       tmp_path):
    """A checkpoint of the scripts' first format held numpy's RNG state as a numpy array, which
    only a load that may run code reads: refused in one line naming --fresh, nothing touched;
    --fresh starts over."""
    out, path = copy_run(trained, tmp_path)
    np.random.seed(7)
    torch.save(dict(real_state(trained), format=1, rng={"numpy": np.random.get_state(),
                                                        "python": random.getstate()}), path)
    before = snapshot_tree(out)
    one_error_line(train(cifar_dir, out, 2), path, "refused", "--fresh")
    assert snapshot_tree(out) == before
    log = ok(run("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, "--epochs", 1,
                 *SMALL, "--fresh"))
    assert not any(line.startswith("resumed") for line in log), log
    assert torch.load(path, weights_only=True)["format"] == checkpoint.FORMAT


def test_save_writes_only_plain_types_and_load_reads_them(tmp_path):
    """save() writes what load() reads back, and refuses any type weights_only would refuse (a
    numpy float in the rows, say) at once, rather than writing a file resume cannot read."""
    path = str(tmp_path / "checkpoint.pt")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    common = dict(script="s", arch="a", model=model, optimizer=optimizer, scheduler=scheduler,
                  epoch=1, args={"lr": 0.1, "out": "x", "amp": None, "fresh": False})
    checkpoint.save(path, rows=[{"epoch": 1, "test_acc": 1.5}], **common)
    state = checkpoint.load(path, script="s", arch="a")
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert state["optimizer"]["state"][0]["momentum_buffer"].shape == (2, 3)
    assert state["scheduler"]["last_epoch"] == 1 and state["rows"][0]["test_acc"] == 1.5

    saved = open(path, "rb").read()
    with pytest.raises(TypeError, match="numpy"):
        checkpoint.save(path, rows=[{"epoch": 1, "test_acc": np.float64(1.5)}], **common)
    assert open(path, "rb").read() == saved


# ------------------------------------------------------------------------------ CIFAR-100

def crafted_cifar(root, name, marker):
    """A CIFAR-100 copy whose `name` file holds its real content plus an object that runs code."""
    folder = make_cifar100(root, n_train=8, n_test=4)
    with open(folder / name, "rb") as f:
        content = pickle.load(f, encoding="bytes")
    content[b"payload"] = RunsCode(marker)
    with open(folder / name, "wb") as f:  # protocol 4: Python 3's protocol 2 writes bytes
        pickle.dump(content, f, protocol=4)  # through _codecs.encode, refused on its own
    return folder / name


@pytest.mark.parametrize("name", ["train", "meta"])
def test_crafted_cifar_pickle_is_refused_and_runs_nothing(trained, tmp_path, name):
    marker = tmp_path / "marker"
    path = crafted_cifar(tmp_path / "data", name, marker)
    crafted = open(path, "rb").read()
    out, _ = copy_run(trained, tmp_path)
    before = snapshot_tree(out)
    proc = train(tmp_path / "data", out, 2)
    one_error_line(proc, path, "refused", "mkdir", "--download")
    assert not marker.exists()
    assert snapshot_tree(out) == before
    assert open(path, "rb").read() == crafted


def test_real_format_cifar_loads_under_numpy_1_and_2_names(tmp_path):
    """The official files (pickled by numpy 1 under Python 2) name numpy.core.multiarray;
    numpy 2 writes numpy._core.multiarray: both load, to the same arrays."""
    folder = make_cifar100(tmp_path / "data", n_train=8, n_test=4)
    raw = (folder / "train").read_bytes()
    names = [b"cnumpy.core.multiarray\n_reconstruct\n", b"cnumpy._core.multiarray\n_reconstruct\n"]
    present = [n for n in names if n in raw]
    assert len(present) == 1 and raw.count(present[0]) == 1  # a GLOBAL opcode, as in the files
    loaded = []
    for name in names:
        (folder / "train").write_bytes(raw.replace(present[0], name))
        loaded.append(data.read_cifar100(str(tmp_path / "data"), True))
    assert torch.equal(loaded[0].images, loaded[1].images)
    assert torch.equal(loaded[0].labels, loaded[1].labels)
    assert loaded[0].classes == loaded[1].classes and len(loaded[0]) == 8


# ------------------------------------------------------------------------ ImageNet weights

def test_crafted_weights_in_the_hub_cache_are_refused_and_run_nothing(cifar_dir, tmp_path):
    """Without --weights, the pretrained script reads torchvision's cached file from
    $TORCH_HOME/hub/checkpoints (where the README says to copy it): a crafted one runs nothing."""
    from common.model import weights_file
    marker = tmp_path / "marker"
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    with open(cache / weights_file("resnet18"), "wb") as f:
        pickle.dump({"conv1.weight": RunsCode(marker)}, f)
    proc = subprocess.run(
        [sys.executable, "pretrained_cifar100.py", "--data-dir", str(cifar_dir), "--out",
         str(tmp_path / "out"), "--epochs", "1", "--image-size", "32", *SMALL],
        cwd=ROOT, env=child_env(TORCH_HOME=str(tmp_path / "torch")), capture_output=True,
        text=True, timeout=TIMEOUT)
    one_error_line(proc, weights_file("resnet18"), "refused")
    assert not marker.exists()
