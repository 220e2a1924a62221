"""Interruptions, a NaN, bad input, and nothing lost (docs/failures.md; the faults between ranks:
test_distributed_faults.py)."""
import importlib
import os
import pickle
import random
import shutil
import signal
import time

import pytest
import torch

import async_sgd_cifar100
import resnet_cifar100
from common import checkpoint
from common.network import free_port
from datagen import make_cifar100, make_tinyimagenet
from faults import TIMEOUT, cmd, digest, one_error_line, rows, run, start, state, wait_for, \
    with_faults
from helpers import MPIRUN, by_hand


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

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
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


def test_bad_input_on_one_rank_under_mpirun_ends_the_job_with_2(cifar_dir, tmp_path):
    """Only rank 0 claims --out: when it cannot, Open MPI used to leave the other rank waiting
    out --timeout and then report its retryable 200, which an MPIJob restarts for ever."""
    if MPIRUN is None:
        pytest.skip("no mpirun (pip install -r requirements-dev.txt)")
    (tmp_path / "a-file").write_text("")
    result = run([MPIRUN, "-np", "2", *cmd("sync_sgd_cifar100.py", cifar_dir,
                                           tmp_path / "a-file" / "out", "--timeout", "20")])
    assert result.returncode == 2, result.stderr
    assert "error: --out" in result.stderr and "cannot write there" in result.stderr


def test_a_fresh_run_stopped_says_to_resume_without_fresh(cifar_dir, tmp_path):
    """With --fresh the same command would start over again, throwing away the checkpoint the
    stop just wrote: the line says to drop it, and without it the run resumes."""
    args = ["--train-limit", "192", "--batch-size", "8", "--epochs", "1"]
    out = tmp_path / "out"
    proc = start(cmd("resnet_cifar100.py", cifar_dir, out, *args, "--fresh"))
    wait_for(lambda: os.path.exists(out / "config.json"), what="training to start")
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "run the same command without --fresh to resume" in stderr, stderr
    step = state(out)["extra"]["partial"]["step"]
    result = run(cmd("resnet_cifar100.py", cifar_dir, out, *args))
    assert result.returncode == 0, result.stderr
    assert f"step {step} of epoch 1" in result.stdout


def test_usr1_to_mpirun_stops_every_rank_after_its_step_and_the_run_resumes(cifar_dir,
                                                                            tmp_path):
    """Open MPI's mpirun turns a Ctrl-C into a SIGTERM to the ranks and kills them a quarter
    of a second later, too soon to save; SIGUSR1 it forwards as it is: both ranks stop at the
    same step, the checkpoint holds it, and the same command resumes there."""
    if MPIRUN is None:
        pytest.skip("no mpirun (pip install -r requirements-dev.txt)")
    out = tmp_path / "out"
    args = [MPIRUN, "-np", "2", *cmd("sync_sgd_cifar100.py", cifar_dir, out, "--dummy",
                                     "--train-limit", "1536", "--batch-size", "8", "--epochs",
                                     "1")]  # 192 steps: --dummy, as the generated set is 200
    proc = start(args)
    wait_for(lambda: os.path.exists(out / "config.json") or proc.poll() is not None,
             what="training to start")
    time.sleep(1.5)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signal.SIGUSR1, stderr
    assert "stopped by SIGUSR1" in stderr and "resume" in stderr, stderr
    partial = state(out)["extra"]["partial"]
    assert 0 < partial["step"] < 192
    assert rows(out) == []

    result = run(args)
    assert result.returncode == 0, result.stderr
    assert f"step {partial['step']} of epoch 1" in result.stdout
    assert len(rows(out)) == 1


def test_a_run_stopped_inside_an_epoch_ends_as_the_uninterrupted_one_dropout_and_all(
        finished_run, cifar_dir, tmp_path):
    """A SIGTERM after step 3 of epoch 1, then the same command: the weights end exactly as an
    uninterrupted run's, with dropout on (each batch's masks drawn again, not the next ones of
    the process's stream)."""
    out = tmp_path / "out"
    stopped = run(with_faults(cmd("resnet_cifar100.py", cifar_dir, out)), STOP_STEP="3")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert state(out)["extra"]["partial"]["step"] == 3
    resumed = run(cmd("resnet_cifar100.py", cifar_dir, out))
    assert resumed.returncode == 0, resumed.stderr
    assert resnet_cifar100.parse_args([]).dropout > 0  # on, as these runs have it
    uninterrupted = state(finished_run)["model"]
    for name, value in state(out)["model"].items():
        assert torch.equal(value, uninterrupted[name]), name


def test_sync_sgd_stopped_inside_an_epoch_ends_as_the_uninterrupted_run(cifar_dir, tmp_path):
    """Sync SGD on 2 ranks, a SIGTERM to rank 1 after step 3 of 12 (the ranks agree at step
    10), then the same command: the weights end exactly as an uninterrupted run's, dropout on,
    each rank with its masks; the BatchNorm statistics too, to rounding, as the stop saves their
    mean over the ranks (the mean at the epoch's end is then the same), not rank 0's."""
    def train(out, **faults):
        for code, _, stderr in by_hand(with_faults(cmd(
                "sync_sgd_cifar100.py", cifar_dir, out, "--batch-size", "8", "--epochs", "1")),
                FAULT_RANK="1", **faults):
            assert code == (128 + signal.SIGTERM if faults else 0), stderr

    train(tmp_path / "whole")
    train(tmp_path / "out", STOP_STEP="3")
    assert state(tmp_path / "out")["extra"]["partial"]["step"] == 10
    train(tmp_path / "out")
    resumed, whole = state(tmp_path / "out")["model"], state(tmp_path / "whole")["model"]
    for name, value in whole.items():
        if "running" in name:
            torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(resumed[name], value), name


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


@pytest.mark.parametrize("faults", [dict(NAN_STEP="2", STOP_STEP="3"), dict(NAN_STEP="6")],
                         ids=["sigterm-before-the-loss-check", "at-an-epochs-last-step"])
def test_nan_weights_are_never_saved(finished_run, tmp_path, cifar_dir, faults):
    """The weights turn NaN, and before the loss check (every 50 steps and at the epoch's end)
    can see it a SIGTERM comes; or an epoch's last update makes them NaN, after its loss was
    counted.  Either way the last good checkpoint stays, and the run stops with one line and
    the permanent 3 (a NaN checkpoint, exit 143 or 0 before)."""
    out = copy_of(finished_run, tmp_path)
    before = state(out)["model"]
    result = run(with_faults(cmd("resnet_cifar100.py", cifar_dir, out, "--fresh")), **faults)
    assert result.returncode == 3, result.stderr
    one_error_line(result, "NaN or inf", f"the last good checkpoint in {out} is kept")
    after = state(out)["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("script, name", [("resnet_cifar100.py", "CIFAR-100"),
                                          ("resnet_tinyimagenet.py", "TinyImageNet")])
def test_download_without_network_is_one_line_saying_how_to_place_it(tmp_path, script, name):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: as good as no network
    proxies = dict(http_proxy=closed, https_proxy=closed, HTTP_PROXY=closed, HTTPS_PROXY=closed,
                   no_proxy="", NO_PROXY="")
    data_dir, out = tmp_path / "new" / "data", tmp_path / "runs" / "out"
    result = run(cmd(script, data_dir, out, "--download"), **proxies)
    assert result.returncode == 2
    one_error_line(result, f"could not fetch {name}", "unpack it into", str(data_dir),
                   "without --download")
    assert os.listdir(tmp_path) == []  # no empty data or run folder left, nor their parents


@pytest.mark.parametrize("script", ["resnet_cifar100.py", "resnet_tinyimagenet.py"])
def test_download_into_a_data_dir_that_cannot_be_made_names_it(tmp_path, script):
    """Not a network failure: the line says --data-dir is the problem, not the download."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for data_dir, why in ((blocker, "a file is there"), (blocker / "data", "Not a directory")):
        result = run(cmd(script, data_dir, tmp_path / "out", "--download"))
        assert result.returncode == 2
        one_error_line(result, f"--data-dir {data_dir}", why, "choose a folder you can write")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


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
        train.write_bytes(random.Random(0).randbytes(4096))
    elif how == "persistent-id":  # pickle's own message for this spans two lines
        train.write_bytes(b"\x80\x02P0\n.")
    elif how == "wrong-shape":
        with open(train, "wb") as f:
            pickle.dump({b"data": __import__("numpy").zeros((4, 100), "uint8"),
                         b"fine_labels": [0, 1, 2, 3]}, f)
    return root


@pytest.mark.parametrize("how", ["missing", "empty", "truncated", "corrupt", "persistent-id",
                                 "wrong-shape"])
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


def test_weights_keyed_by_numbers_are_not_a_state_dict(tmp_path, cifar_dir):
    bad = tmp_path / "numbered.pth"
    torch.save({0: torch.zeros(3, 3)}, bad)
    result = run(cmd("pretrained_cifar100.py", cifar_dir, tmp_path / "out", "--weights",
                     str(bad), "--image-size", "32"))
    one_error_line(result, str(bad), "state_dict")


def test_a_truncated_weights_file_in_the_hub_cache_is_named(tmp_path, cifar_dir):
    """A copy cut short (a full disk, an interrupted scp): the line names the file to replace,
    not only the offline advice."""
    from common.model import weights_file
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    whole = tmp_path / "whole.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, whole)
    (cache / weights_file("resnet18")).write_bytes(whole.read_bytes()[:300])
    result = run(cmd("pretrained_cifar100.py", cifar_dir, tmp_path / "out", "--image-size",
                     "32"), TORCH_HOME=str(tmp_path / "torch"))
    one_error_line(result, str(cache / weights_file("resnet18")), "delete it")


@pytest.mark.parametrize("script", ["sync_sgd_cifar100.py", "pretrained_cifar100.py"])
def test_checkpoint_of_another_script_or_architecture(finished_run, tmp_path, cifar_dir, script):
    out = copy_of(finished_run, tmp_path)
    before = digest(out)
    result = run(cmd(script, cifar_dir, out, "--image-size", "32", "--no-pretrained")
                 if script.startswith("pretrained") else cmd(script, cifar_dir, out))
    assert result.returncode == 2
    one_error_line(result, "checkpoint of resnet_cifar100", "--fresh")
    assert digest(out) == before


@pytest.mark.parametrize("epochs", ["1", "2"])
def test_a_finished_run_started_again_keeps_its_record(finished_run, tmp_path, cifar_dir,
                                                       epochs):
    """A job restarted after it finished (or run with fewer --epochs than it holds) trains
    nothing, exits 0, and leaves config.json, metrics.csv and the checkpoint as they were."""
    out = copy_of(finished_run, tmp_path)
    before = digest(out)
    args = cmd("resnet_cifar100.py", cifar_dir, out)
    result = run(args[:args.index("--epochs") + 1] + [epochs])
    assert result.returncode == 0, result.stderr
    assert "holds 2 epochs" in result.stdout and "nothing to train" in result.stdout
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


@pytest.mark.parametrize("script, flag, value", [
    ("resnet_cifar100", "--dropout", "1.5"), ("resnet_cifar100", "--dropout", "-0.1"),
    ("resnet_cifar100", "--momentum", "1"), ("resnet_cifar100", "--label-smoothing", "2"),
    ("resnet_cifar100", "--seed", "-1"), ("resnet_cifar100", "--seed", str(2**64)),
    ("resnet_cifar100", "--lr", "nan"), ("resnet_cifar100", "--weight-decay", "inf"),
    ("resnet_tinyimagenet", "--workers", "-1"), ("sync_sgd_cifar100", "--timeout", "0"),
    ("async_sgd_cifar100", "--timeout", "inf"),
    ("async_sgd_cifar100", "--straggler-delay", "-1"),
    ("sync_sgd_cifar100", "--straggler-delay", "-1"),
])
def test_a_flag_out_of_its_range_is_one_line(script, flag, value, capsys):
    """Values torch or the RNGs would refuse with a traceback (dropout 1.5, a seed over 64 bits,
    a negative sleep), or train on without sense (momentum 1), stop at the command line."""
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(script).parse_args([flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}" in err and value in err, err


def test_the_ends_of_each_range_are_accepted():
    args = resnet_cifar100.parse_args(["--momentum", "0", "--dropout", "0", "--label-smoothing",
                                       "0.99", "--seed", str(2**32 - 1), "--workers", "0"])
    assert (args.momentum, args.dropout, args.seed, args.workers) == (0, 0, 2**32 - 1, 0)
    assert async_sgd_cifar100.parse_args(["--straggler-delay", "0"]).straggler_delay == 0
