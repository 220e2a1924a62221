"""What real scale asks of the scripts: progress in a log file during a long epoch, TinyImageNet
decoded once per run rather than once per rank (the parameter server decoding no training
image), and bench/tiny_to_cifar.py's CIFAR-100-shaped set of real photos."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import resnet_tinyimagenet
from common import data, images, training
from common.network import free_port
from common.run import Run
from datagen import make_tinyimagenet, write_damaged_image
from helpers import ROOT, by_hand, child_env

TIMEOUT = 240

# A main run under torchrun, with the image decoder counting the files it opens (each rank
# prints how many it decoded when it exits) and a progress line due at every check.
COUNTING_PROBE = r"""
import atexit, os, runpy, sys
sys.path.insert(0, sys.argv[1])
from common import images, training
training.LINE_EVERY = 0.0
opened, real = [], images.open_rgb
images.open_rgb = lambda path: opened.append(path) or real(path)
# one write of the whole line: the ranks share torchrun's stdout (print writes its end apart)
atexit.register(lambda: sys.stdout.write(f"rank {os.environ['RANK']} decoded {len(opened)}\n"))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# load_datasets on every rank of a torchrun world: does each rank end with the very pixels one
# process decoding alone gets?
SAME_PIXELS_PROBE = r"""
import argparse, os, sys, torch
sys.path.insert(0, sys.argv[1])
from common import data, distributed
from common.launch import detect_launch
from common.run import Run
args = argparse.Namespace(dataset="tinyimagenet", data_dir=sys.argv[2], dummy=False,
                          download=False, workers=0, train_limit=None, test_limit=None, seed=0,
                          evaluate=False, backend="gloo", timeout=60)
launch = detect_launch()
run = Run("probe", ".", torch.device("cpu"), False, launch.rank, launch.world_size)
with distributed.process_group(args, run, launch) as comm:
    train, test = data.load_datasets("tinyimagenet", args, comm, sys.argv[3] == "server")
alone = data.read_tinyimagenet(sys.argv[2], 0)
for name, ours, whole in (("train", train, alone[0]), ("test", test, alone[1])):
    same = len(ours.images) == len(whole.images) and torch.equal(ours.images, whole.images)
    print(f"rank {comm.rank} {name}: {len(ours.images)} images, "
          f"{'identical' if same else 'different'}, labels "
          f"{'identical' if torch.equal(ours.labels, whole.labels) else 'different'}", flush=True)
"""


def torchrun(tmp_path, probe, ranks, *args):
    path = tmp_path / "probe.py"
    path.write_text(probe)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(ranks), "--master-port", str(free_port()), str(path), ROOT,
                           *map(str, args)], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def one_epoch(tiny_dir, out):
    return ["--dataset", "tinyimagenet", "--data-dir", tiny_dir, "--out", out, "--epochs", "1",
            "--batch-size", "8", "--device", "cpu", "--workers", "0"]


# 4 classes of 6 training and 3 validation images (conftest's tiny_dir)
TRAIN, TEST = 24, 12


RUNS = {"sync_sgd_cifar100.py": 2, "async_sgd_cifar100.py": 3}  # ranks: 2; a server + 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A folder for each distributed main's runs below: the probe, and its --out in o/."""
    return {script: tmp_path_factory.mktemp(script.split("_")[0]) for script in RUNS}


@pytest.fixture(scope="module")
def counted(tiny_dir, folders):
    """Each distributed main's log, run once for the tests below (torchrun starts are slow)."""
    return {script: torchrun(folders[script], COUNTING_PROBE, ranks, script,
                             *one_epoch(tiny_dir, folders[script] / "o"))
            for script, ranks in RUNS.items()}


@pytest.fixture(scope="module")
def evaluated(tiny_dir, folders, counted):
    """Each distributed main's log with --evaluate of the checkpoint its run above wrote."""
    return {script: torchrun(folders[script], COUNTING_PROBE, ranks, script,
                             *one_epoch(tiny_dir, folders[script] / "o"), "--evaluate")
            for script, ranks in RUNS.items()}


@pytest.mark.parametrize("script,decoded", [
    # sync SGD: each rank half of both sets (before: every rank all 36 files)
    ("sync_sgd_cifar100.py", {0: (TRAIN + TEST) // 2, 1: (TRAIN + TEST) // 2}),
    # async SGD: the server the test set alone, each worker half the training set
    ("async_sgd_cifar100.py", {0: TEST, 1: TRAIN // 2, 2: TRAIN // 2})])
def test_the_ranks_decode_tinyimagenet_once_between_them(counted, script, decoded):
    for rank, count in decoded.items():
        assert f"rank {rank} decoded {count}\n" in counted[script], counted[script]
    assert "final test accuracy" in counted[script]


@pytest.mark.parametrize("script,decoded", [
    # sync SGD: each rank half of the test set alone (before: half of both sets)
    ("sync_sgd_cifar100.py", {0: TEST // 2, 1: TEST // 2}),
    # async SGD: the server the test set, the workers nothing (before: half the training set)
    ("async_sgd_cifar100.py", {0: TEST, 1: 0, 2: 0})])
def test_evaluate_decodes_no_training_image(evaluated, script, decoded):
    """--evaluate tests a checkpoint: of the training set the mains need its labels alone (its
    classes, an epoch's length), not the 100,000 images."""
    for rank, count in decoded.items():
        assert f"rank {rank} decoded {count}\n" in evaluated[script], evaluated[script]
    assert "final test accuracy" in evaluated[script]


def test_evaluate_alone_decodes_no_training_image(tiny_dir, monkeypatch):
    """The same for one process (resnet_tinyimagenet.py --evaluate): the training set's labels
    and classes, without its pixels."""
    opened, real = [], images.open_rgb
    monkeypatch.setattr(images, "open_rgb", lambda path: opened.append(path) or real(path))
    args = resnet_tinyimagenet.parse_args(["--data-dir", str(tiny_dir), "--workers", "0",
                                           "--evaluate"])
    train, test = data.load_datasets("tinyimagenet", args)
    assert len(opened) == TEST and len(test.images) == TEST
    assert len(train) == TRAIN and len(train.images) == 0 and train.classes == test.classes


@pytest.mark.parametrize("script,line", [
    # 12 images a rank in batches of 4: a line at the last of its 3 steps
    ("sync_sgd_cifar100.py", "epoch 1 step 3/3: train loss "),
    # the server: 6 updates an epoch, a line after each but the epoch's last (it ends the epoch)
    ("async_sgd_cifar100.py", "epoch 1 step 5/6: train loss ")])
def test_distributed_runs_log_progress_lines_without_a_terminal(counted, script, line):
    assert line in counted[script] and " images/s\n" in counted[script], counted[script]


def test_the_shared_decoding_gives_the_pixels_of_one_process(tiny_dir, tmp_path):
    """The shares put together on every rank that uses the set, in the files' order: async
    SGD's workers, a group without rank 0 (sync SGD's shares are the same code over all)."""
    log = torchrun(tmp_path, SAME_PIXELS_PROBE, 3, tiny_dir, "server")
    for rank in range(3):
        for split, count in (("train", TRAIN), ("test", TEST)):
            expected = ("0 images, different" if (rank == 0) == (split == "train") else
                        f"{count} images, identical")
            assert f"rank {rank} {split}: {expected}, labels identical" in log, log


def test_a_rank_that_cannot_decode_its_share_ends_the_others_in_one_line(tmp_path):
    """Ranks started apart (pods, hosts): the one whose share holds a damaged image says so
    (exit 2); the other, waiting for that share, ends with one line (exit 200), no traceback."""
    make_tinyimagenet(tmp_path / "d", n_classes=4, n_train_per_class=6, n_val_per_class=3)
    train, _, _ = data.tinyimagenet_files(tmp_path / "d")
    write_damaged_image(train[-1][0], "garbage")  # the last file: rank 1's share
    command = [sys.executable, "sync_sgd_cifar100.py",
               *one_epoch(tmp_path / "d", tmp_path / "o"), "--timeout", "60"]
    (code0, _, err0), (code1, _, err1) = by_hand(command)
    assert code1 == 2 and "cannot decode image" in err1, err1
    assert code0 == 200 and "Traceback" not in err0, err0
    assert "lost contact with another rank while they decoded the images" in err0


def test_a_long_epoch_leaves_progress_lines_in_a_log_file(monkeypatch, capsys):
    """Under mpirun, PBS or nohup there is no terminal for the bar: an epoch of many minutes
    must still say how far it is, in a line a minute, however long its steps take (10 s
    each here: a line every 6 steps, not every 50)."""
    now = [0.0]  # the clock, in seconds
    monkeypatch.setattr(training.time, "perf_counter", lambda: now[0])
    run = Run("test", ".", torch.device("cpu"), False)
    metrics = training.EpochMetrics(run, 2, 30, 0.1)
    for _ in range(30):
        now[0] += 10.0
        metrics.update(torch.tensor(2.0), torch.eye(4)[torch.tensor([0, 1])], torch.tensor([0, 3]))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        f"epoch 3 step {k}/30" for k in (6, 12, 18, 24, 30)], lines
    assert "train loss 2.0000, train acc 50.00%" in lines[0] and lines[0].endswith(" images/s")


def test_no_progress_line_before_its_time(capsys):
    run = Run("test", ".", torch.device("cpu"), False)
    metrics = training.EpochMetrics(run, 0, 50, 0.1)
    for _ in range(50):
        metrics.update(torch.tensor(2.0), torch.eye(4)[torch.tensor([0])], torch.tensor([0]))
    assert capsys.readouterr().out == ""


def test_tiny_to_cifar_writes_cifar100_pickles_of_real_photos(tmp_path):
    """The first 100 wnids in sorted order, N training and M test images each, 2x2 area
    averages, read back by the scripts' own CIFAR-100 reader."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from tiny_to_cifar import convert
    make_tinyimagenet(tmp_path / "d", n_classes=102, n_train_per_class=3, n_val_per_class=2,
                      seed=1)
    convert(tmp_path / "d", tmp_path / "c", per_class_train=2, per_class_test=2)
    train, test = data.read_cifar100(tmp_path / "c", True), data.read_cifar100(tmp_path / "c",
                                                                            False)
    files, _, wnids = data.tinyimagenet_files(tmp_path / "d")
    assert train.classes == sorted(wnids)[:100]
    assert train.labels.tolist() == test.labels.tolist() == [k // 2 for k in range(200)]
    first = next(path for path, label in files if label == 1)  # class 1's first image
    with Image.open(first) as img:
        pixels = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float64))
    expected = pixels.reshape(32, 2, 32, 2, 3).mean((1, 3)).round().permute(2, 0, 1)
    assert torch.equal(train.images[2].double(), expected)
    with open(tmp_path / "c" / "cifar-100-python" / "train", "rb") as f:
        assert pickle.load(f, encoding="bytes")[b"data"].shape == (200, 3072)
