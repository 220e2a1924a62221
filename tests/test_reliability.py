"""Faults, bad input, and nothing lost (each point of the README's "Failure behaviour" table)."""
import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from common import checkpoint
from common.distributed import free_port
from datagen import make_cifar100, make_tinyimagenet
from helpers import ROOT, child_env

TIMEOUT = 240


def cmd(script, data_dir, out, *extra):
    return [sys.executable, script, "--data-dir", str(data_dir), "--out", str(out),
            "--device", "cpu", "--train-limit", "96", "--test-limit", "32",
            "--batch-size", "16", "--epochs", "2", *extra]


def run(args, **env):
    return subprocess.run(args, cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=TIMEOUT)


def start(args, **env):
    return subprocess.Popen(args, cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout=TIMEOUT, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def rows(out):
    path = os.path.join(out, "metrics.csv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()[1:]


def digest(folder):
    """sha1 of every file in a folder: proof that nothing was overwritten."""
    result = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            result[name] = hashlib.sha1(f.read()).hexdigest()
    return result


def state(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)


def one_error_line(result, *words):
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(cifar_dir, tmp_path_factory):
    """A completed 2-epoch run of resnet_cifar100 (read-only: copy it before changing it)."""
    out = tmp_path_factory.mktemp("finished") / "out"
    result = run(cmd("resnet_cifar100.py", cifar_dir, out))
    assert result.returncode == 0, result.stderr
    return out


def copy_of(finished_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    return out


# ---------------------------------------------------------------- atomic writes

def test_a_failed_write_leaves_the_previous_file_and_no_debris(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"the good one")

    def write_half_then_die(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_write(str(path), write_half_then_die)
    assert path.read_bytes() == b"the good one"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


# ---------------------------------------------------------- kill -9, then again

def test_kill_9_mid_epoch_then_rerun_equals_an_uninterrupted_run(cifar_dir, tmp_path):
    args = ["--train-limit", "192", "--batch-size", "8", "--epochs", "3"]
    whole = tmp_path / "whole"
    assert run(cmd("resnet_cifar100.py", cifar_dir, whole, *args)).returncode == 0

    out = tmp_path / "killed"
    proc = start(cmd("resnet_cifar100.py", cifar_dir, out, *args))
    wait_for(lambda: len(rows(out)) >= 1 or proc.poll() is not None, what="epoch 1")
    time.sleep(0.5)  # well inside epoch 2
    proc.kill()
    proc.wait()
    assert len(rows(out)) == 1, "the kill did not land in epoch 2"
    assert state(out)["epoch"] == 1

    result = run(cmd("resnet_cifar100.py", cifar_dir, out, *args))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout and "after epoch 1" in result.stdout
    assert [line.split(",")[0] for line in rows(out)] == ["1", "2", "3"]
    resumed, uninterrupted = state(out)["model"], state(whole)["model"]
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    # the rows agree too, but for timings
    assert [r.split(",")[:6] for r in rows(out)] == [r.split(",")[:6] for r in rows(whole)]


# ------------------------------------------------------------ SIGTERM / SIGINT

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_checkpoints_and_exits_for_retry(cifar_dir, tmp_path, sig):
    args = ["--train-limit", "192", "--batch-size", "8", "--epochs", "1"]
    out = tmp_path / "out"
    proc = start(cmd("resnet_cifar100.py", cifar_dir, out, *args))
    wait_for(lambda: os.path.exists(out / "config.json"), what="training to start")
    time.sleep(1.0)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + sig, stderr
    assert f"stopped by {signal.Signals(sig).name}" in stderr and "resume" in stderr
    partial = state(out)["extra"]["partial"]
    assert 0 < partial["step"] < 24
    assert rows(out) == []

    result = run(cmd("resnet_cifar100.py", cifar_dir, out, *args))
    assert result.returncode == 0, result.stderr
    assert f"step {partial['step']} of epoch 1" in result.stdout
    assert len(rows(out)) == 1


# ------------------------------------------------------------------- NaN loss

def test_non_finite_loss_stops_naming_epoch_and_step_and_keeps_the_checkpoint(finished_run,
                                                                                tmp_path, cifar_dir):
    out = copy_of(finished_run, tmp_path)
    before = state(out)["model"]
    result = run(cmd("resnet_cifar100.py", cifar_dir, out, "--fresh", "--lr", "1e30",
                     "--warmup-epochs", "0"))
    assert result.returncode == 3
    line = one_error_line(result, "non-finite", "epoch 1", "step ")
    assert "checkpoint" in line
    after = state(out)["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(rows(out)) == 2


# ------------------------------------------------------------ distributed faults

def test_sync_sgd_rank_death_ends_the_others_with_a_clear_error(cifar_dir, tmp_path):
    out = tmp_path / "sync"
    args = cmd("sync_sgd_cifar100.py", cifar_dir, out, "--train-limit", "192",
               "--batch-size", "16", "--epochs", "5", "--timeout", "30")
    contract = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    rank1 = start(args, RANK="1", **contract)
    rank0 = start(args, RANK="0", **contract)
    try:
        wait_for(lambda: len(rows(out)) >= 1 or rank0.poll() is not None, what="epoch 1")
        rank1.kill()
        began = time.time()
        _, stderr = rank0.communicate(timeout=TIMEOUT)
        assert time.time() - began < 30 + 15
        assert rank0.returncode == 4, stderr
        assert "lost contact with another rank" in stderr and "checkpoint" in stderr
    finally:
        rank0.kill()
        rank1.kill()
    assert state(out)["epoch"] >= 1  # the last good checkpoint is there and loads


def test_async_sgd_worker_death_does_not_hang_the_server(cifar_dir, tmp_path):
    out = tmp_path / "async"
    args = cmd("async_sgd_cifar100.py", cifar_dir, out, "--train-limit", "192",
               "--batch-size", "8", "--epochs", "3", "--timeout", "10")
    contract = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3")
    workers = [start(args, RANK=str(r), **contract) for r in (1, 2)]
    server = start(args, RANK="0", **contract)
    try:
        wait_for(lambda: len(rows(out)) >= 1 or server.poll() is not None, what="epoch 1")
        workers[1].kill()
        _, stderr = server.communicate(timeout=TIMEOUT)
        assert server.returncode == 4, stderr
        assert "received nothing for 10 s" in stderr and "wrote its outputs" in stderr
        # The survivor ends too: released (0), or told the server is gone (4) if worker 2
        # died in the middle of a message and left the server's receive unable to finish.
        assert workers[0].wait(timeout=60) in (0, 4)
    finally:
        for p in [server, *workers]:
            p.kill()
    # what it had is written: the epochs before the loss, and any updates after it
    assert len(rows(out)) >= 1 and os.path.exists(out / "curve.png")
    assert state(out)["extra"]["updates"] >= int(rows(out)[-1].split(",")[9])


# ------------------------------------------------------------------ bad input

def corrupt_cifar(root, how):
    folder = make_cifar100(root, n_train=64, n_test=32)
    train = folder / "train"
    if how == "missing":
        shutil.rmtree(folder)
    elif how == "empty":
        train.write_bytes(b"")
    elif how == "truncated":
        train.write_bytes(train.read_bytes()[:5000])
    elif how == "corrupt":
        train.write_bytes(os.urandom(4096))
    elif how == "wrong-shape":
        with open(train, "wb") as f:
            pickle.dump({b"data": __import__("numpy").zeros((4, 100), "uint8"),
                         b"fine_labels": [0, 1, 2, 3]}, f)
    return root


@pytest.mark.parametrize("how", ["missing", "empty", "truncated", "corrupt", "wrong-shape"])
def test_bad_cifar_is_one_line_and_overwrites_nothing(finished_run, tmp_path, how):
    out = copy_of(finished_run, tmp_path)
    before = digest(out)
    data_dir = corrupt_cifar(tmp_path / "data", how)
    result = run(cmd("resnet_cifar100.py", data_dir, out))
    assert result.returncode == 2
    one_error_line(result, "cifar-100-python")
    assert digest(out) == before


@pytest.mark.parametrize("how", ["no-annotations", "unknown-label"])
def test_bad_tinyimagenet_is_one_line(tmp_path, how):
    tiny = make_tinyimagenet(tmp_path / "data")
    annotations = tiny / "val" / "val_annotations.txt"
    if how == "no-annotations":
        annotations.unlink()
    else:
        annotations.write_text(annotations.read_text() + "val_999.JPEG\tn99999999\t0\t0\t1\t1\n")
    result = run(cmd("resnet_tinyimagenet.py", tmp_path / "data", tmp_path / "out"))
    assert result.returncode == 2
    one_error_line(result, "val_annotations.txt")


def test_weights_that_are_not_resnet18(tmp_path, cifar_dir):
    bad = tmp_path / "not-resnet18.pth"
    torch.save({"conv1.weight": torch.zeros(3, 3)}, bad)
    result = run(cmd("pretrained_cifar100.py", cifar_dir, tmp_path / "out", "--weights",
                     str(bad), "--image-size", "32"))
    assert result.returncode == 2
    one_error_line(result, str(bad), "ResNet-18")


@pytest.mark.parametrize("script", ["sync_sgd_cifar100.py", "pretrained_cifar100.py"])
def test_checkpoint_of_another_script_or_architecture(finished_run, tmp_path, cifar_dir, script):
    out = copy_of(finished_run, tmp_path)
    before = digest(out)
    result = run(cmd(script, cifar_dir, out, "--image-size", "32", "--no-pretrained")
                 if script.startswith("pretrained") else cmd(script, cifar_dir, out))
    assert result.returncode == 2
    one_error_line(result, "checkpoint of resnet_cifar100", "--fresh")
    assert digest(out) == before


def test_unwritable_out_dir(tmp_path, cifar_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run(cmd("resnet_cifar100.py", cifar_dir, blocker / "out"))
    assert result.returncode == 2
    one_error_line(result, "--out", str(blocker / "out"))


@pytest.mark.parametrize("flags, words", [
    (["--backend", "foo"], ["--backend", "invalid choice"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--epochs", "-1"], ["--epochs"]),
])
def test_impossible_flags(tmp_path, cifar_dir, flags, words):
    result = run(cmd("sync_sgd_cifar100.py", cifar_dir, tmp_path / "out", *flags))
    assert result.returncode == 2
    one_error_line(result, *words)


def test_batch_smaller_than_world_size(cifar_dir, tmp_path):
    out = tmp_path / "tiny-batch"
    args = cmd("sync_sgd_cifar100.py", cifar_dir, out, "--batch-size", "1")
    contract = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    other = start(args, RANK="1", **contract)
    result = run(args, RANK="0", **contract)
    other.communicate(timeout=TIMEOUT)
    assert result.returncode == 2 and other.returncode == 2
    one_error_line(result, "--batch-size 1", "2 ranks")
