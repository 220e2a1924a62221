"""Learning, measured on the yardstick (tests/yardstick.py): data a ResNet cannot learn in one
step, so that a broken or worse update rule scores measurably worse.

The marker-pixel data of tests/datagen.py stays where exact equality is the point; every test
here that says "it learns" trains on the yardstick, written in the real CIFAR-100 layout, with
the scripts as a user runs them.
"""
import csv
import math
import subprocess
import sys

import pytest

from helpers import ROOT, child_env
from yardstick import make_cifar100_yardstick

pytestmark = pytest.mark.slow  # trains for minutes: scheduled first (conftest.py)

TIMEOUT = 1200  # 600 s was too short for the async run under the suite's load, fp32, 2 AVX2 cores
# A small yardstick and a short recipe (the scripts' defaults scaled to batch 32): a few
# minutes on 2 cores for the whole file.  Not 3 epochs, a quarter of the file's CPU less: there
# (2026-11-25, seed 0) sync ends at 23.38%, async at 22.25, 23.12 and 22.00%, and the slides'
# rule (test docstring below) at 14.25 and 18.38% -- 5.0 points below sync, loss 0.12 above,
# inside the margins.  Without TrivialAugment: colour is a third of each class here, and its
# colour operations (solarize, posterize, ...) rewrite it; with it, sync ended at 15.1 % after
# climbing 7.5 points, too little room for a worse rule to show (2026-12-07).  In fp32, where the
# margins below were measured: under bf16 autocast (the default where the CPU has native bf16)
# async ended 0.4 to 7.2 points below sync here (6 runs, 2026-12-07, machine I), against 1.0
# above to 3.5 below in fp32 beside them, and failed CI's 6-point margin.
N_TRAIN, N_TEST, CLASSES = 2400, 800, 20
RECIPE = ["--epochs", "4", "--batch-size", "32", "--lr", "0.05", "--warmup-epochs", "1",
          "--device", "cpu", "--auto-augment", "none", "--no-amp"]


@pytest.fixture(scope="module")
def yardstick(tmp_path_factory):
    root = tmp_path_factory.mktemp("yardstick")
    make_cifar100_yardstick(root, N_TRAIN, N_TEST, num_classes=CLASSES, seed=0)
    return root


def train(cmd, data_dir, out, *extra):
    proc = subprocess.run([*cmd, "--data-dir", str(data_dir), "--out", str(out), *RECIPE,
                           *extra], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    with open(out / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def mpirun(n, script):
    return ["mpirun", "-np", str(n), sys.executable, script]


@pytest.fixture(scope="module")
def sync_rows(yardstick, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync") / "out"
    return train(mpirun(2, "sync_sgd_cifar100.py"), yardstick, out)


def test_the_yardstick_is_learnable_but_not_at_once(sync_rows):
    """The test accuracy climbs from near chance to well above it, and stays well below 100%:
    the room in which a worse update rule shows.  Measured on the sync SGD run that the async
    test compares with (one process's recipe and global batch, split over 2 ranks), so that
    CI trains on the yardstick twice, not three times."""
    chance = 100.0 / CLASSES
    accuracy = [r["test_acc"] for r in sync_rows]
    assert accuracy[-1] > 3 * chance, accuracy
    assert accuracy[-1] < 85.0, accuracy
    assert accuracy[0] < accuracy[-1] - 10.0, accuracy
    assert sync_rows[-1]["train_loss"] < sync_rows[0]["train_loss"] - 0.3, sync_rows


@pytest.fixture(scope="module")
def async_rows(yardstick, tmp_path_factory):
    out = tmp_path_factory.mktemp("async") / "out"
    return train(mpirun(3, "async_sgd_cifar100.py"), yardstick, out)


def test_async_sgd_with_two_workers_keeps_up_with_sync(sync_rows, async_rows):
    """Async SGD with 2 workers (every gradient about 1 update stale) ends close to sync SGD on
    2 ranks: the same data, epochs, global batch and learning rate.  The server's first rule
    (torch's SGD with one Nesterov momentum buffer, each worker's gradient of a whole
    --batch-size applied at the whole --lr as it came) ended at 8.75% here against sync's
    29.1%, its first-epoch training loss 6.05, above ln(100).  A milder rule, the slides' (one
    momentum buffer for all workers, --lr / N per update, the reply not looked ahead, the head
    stale, no pull), ends 7.9 points below sync (22.0% against 29.9%, 2026-11-25), its training
    loss 0.27 above, which the loss margin below catches.  One buffer alone, with the rest of
    the rule kept, stays inside the margins: closer comparisons are bench/convergence.py's, the
    exact rule tests/test_classic_bugs.py's."""
    sync_acc, async_acc = sync_rows[-1]["test_acc"], async_rows[-1]["test_acc"]
    assert async_acc >= sync_acc - ACCURACY_MARGIN, (async_acc, sync_acc)
    assert async_acc > 3 * 100.0 / CLASSES, async_acc
    sync_loss, async_loss = sync_rows[-1]["train_loss"], async_rows[-1]["train_loss"]
    assert async_loss <= sync_loss + LOSS_MARGIN, (async_loss, sync_loss)
    assert max(r["mean_staleness"] for r in async_rows) > 0.5, async_rows  # really async


# Margins beyond the run-to-run spread of the async run (same seed, the order in which the
# workers' gradients arrive varying; fp32): from 1.0 points above sync to 3.5 below, training
# loss 0.04 below to 0.07 above it (9 runs, 2026-11-25 and, under load, 2026-12-07).  The
# milder one-buffer rule (test docstring) ended 7.9 and 8.1 points below, its loss 0.27 and 0.32
# above: outside the loss margin (the accuracy's spread leaves its margin too wide to).
ACCURACY_MARGIN, LOSS_MARGIN = 8.0, 0.2


def test_async_sgd_never_does_worse_than_a_uniform_guess(async_rows):
    """The failure mode of the old rule: a training loss above ln(100) -- worse than a uniform
    guess over the 100-way head -- in the warm-up epoch (6.05 here with the old rule; 8-10 on
    real images), from which the network recovered only partly.  No epoch may show it, the
    first included (a healthy run's first epoch averages 4.0-4.2 here)."""
    uniform = math.log(100)  # the scripts build CIFAR-100's 100-way head
    assert all(r["train_loss"] < uniform for r in async_rows), \
        [r["train_loss"] for r in async_rows]


def test_the_tinyimagenet_yardstick_is_a_tree_the_reader_reads(tmp_path):
    """The yardstick also comes as the TinyImageNet-200 tree (64x64 JPEGs, val labels in
    val_annotations.txt): the real reader takes it, every class alike, the grayscale fifth of
    the images as three equal channels."""
    from common import data
    from yardstick import make_tinyimagenet_yardstick
    make_tinyimagenet_yardstick(tmp_path, n_classes=10, n_train_per_class=5, n_val_per_class=5)
    train, val = data.read_tinyimagenet(str(tmp_path), workers=0)
    assert train.images.shape == (50, 3, 64, 64) and val.images.shape == (50, 3, 64, 64)
    assert train.labels.bincount().tolist() == [5] * 10 == val.labels.bincount().tolist()
    gray = (train.images[:, 0] == train.images[:, 1]).flatten(1).all(1) & \
        (train.images[:, 1] == train.images[:, 2]).flatten(1).all(1)
    assert gray.sum() == 10  # image i % 5 == 4 of each class
    assert train.images.float().std() > 30  # drawn images, not flat colour


def test_async_sgd_with_one_worker_is_nesterov_sgd_step_for_step(yardstick, tmp_path):
    """Without staleness the server's rule is torch.optim.SGD(nesterov=True): one worker's run
    follows the one-process run step for step (fp32, no dropout, one thread each: child_env),
    through the warm-up, weight decay, an epoch boundary and the evaluation.  A look-ahead
    scaled by another step's learning rate, a momentum buffer applied twice or a missing weight
    decay shows."""
    flags = ["--epochs", "2", "--batch-size", "64", "--no-amp", "--dropout", "0",
             "--train-limit", "128", "--test-limit", "200", "--seed", "3"]
    one = train([sys.executable, "resnet_cifar100.py"], yardstick, tmp_path / "one", *flags)
    asy = train(mpirun(2, "async_sgd_cifar100.py"), yardstick, tmp_path / "async", *flags)
    assert len(one) == len(asy) == 2
    for a, b in zip(one, asy):
        for key in ("train_loss", "test_loss", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, one, asy)
        for key in ("train_acc", "test_acc"):  # one sample of 200 is 0.5 %
            assert abs(b[key] - a[key]) <= 0.5, (key, one, asy)
