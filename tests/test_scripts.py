"""The three scripts end to end, as subprocesses, on tiny generated data (CPU)."""
import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ok, one_error_line
from tests.datagen import make_resnet18_weights, make_tinyimagenet, snapshot_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
           "epoch_seconds", "elapsed_seconds"]
SMALL = ["--train-limit", "48", "--test-limit", "24", "--batch-size", "16", "--device", "cpu",
         "--lr", "0.05"]
FINAL = re.compile(r"^final test accuracy: (\d+\.\d\d)%$")
EPOCH = re.compile(r"^epoch\s+(\d+)/(\d+)\b")
# what decides the numbers of an epoch (timings left out)
RESULT_COLUMNS = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr"]


def clean_env(**extra):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(OMP_NUM_THREADS="2")
    env.update(extra)
    return env


def run_script(script, *args, cwd, env=None, timeout=240):
    return subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)],
                          cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def read_rows(out):
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def results(rows):
    return [float(r[k]) for r in rows for k in RESULT_COLUMNS]


def check_run_outputs(out, log, epochs, trained, script):
    """The files and the log of a finished run of `epochs` epochs that trained `trained`."""
    # the log: one line per trained epoch, in order, then the final accuracy
    epoch_lines = [m for m in map(EPOCH.match, log) if m]
    assert [int(m.group(1)) for m in epoch_lines] == list(trained)
    assert all(int(m.group(2)) == epochs for m in epoch_lines)
    final = FINAL.match(log[-1])
    assert final, log[-1]
    # metrics.csv
    fields, rows = read_rows(out)
    assert fields[:len(COLUMNS)] == COLUMNS
    assert set(fields[len(COLUMNS):]) <= {"images_per_s"}
    assert [int(r["epoch"]) for r in rows] == list(range(1, epochs + 1))
    for r in rows:
        for k in fields:
            float(r[k])
        assert 0 <= float(r["train_acc"]) <= 100 and 0 <= float(r["test_acc"]) <= 100
        assert float(r["epoch_seconds"]) > 0
    assert [float(r["elapsed_seconds"]) for r in rows] == sorted(float(r["elapsed_seconds"])
                                                                 for r in rows)
    assert abs(float(final.group(1)) - float(rows[-1]["test_acc"])) < 0.0051
    # curve.png: a real PNG picture
    png = os.path.join(out, "curve.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    with Image.open(png) as img:
        img.load()
        assert img.width > 100 and img.height > 100
    # config.json: the arguments and the library versions
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["args"]["epochs"] == epochs
    assert config["args"]["batch_size"] == 16
    from importlib.metadata import version
    assert config["environment"]["torch"] == torch.__version__
    assert config["environment"]["torchvision"] == version("torchvision")
    # checkpoint.pt loads and holds the model after the last epoch
    state = torch.load(os.path.join(out, "checkpoint.pt"), map_location="cpu",
                       weights_only=False)
    assert state["epoch"] == epochs
    assert len(state["rows"]) == epochs
    model = state["model"]
    assert all(isinstance(v, torch.Tensor) for v in model.values())
    assert not [n for n in os.listdir(out) if ".tmp" in n]
    return rows, state


# -------------------------------------------------------------------------- shared runs

@pytest.fixture(scope="module")
def cifar_run(cifar_dir, tmp_path_factory):
    """An uninterrupted 2-epoch resnet_cifar100 run."""
    work = tmp_path_factory.mktemp("cifar_run")
    out = work / "out"
    proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out,
                      "--epochs", 2, *SMALL, cwd=work)
    return out, ok(proc)


def test_resnet_cifar100_end_to_end(cifar_run):
    out, log = cifar_run
    rows, state = check_run_outputs(str(out), log, 2, [1, 2], "resnet_cifar100")
    assert "resumed" not in "\n".join(log)
    assert state["model"]["fc.weight"].shape == (100, 256)
    assert state["model"]["conv1.weight"].shape == (32, 3, 3, 3)


def test_resnet_tinyimagenet_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_script("resnet_tinyimagenet.py", "--data-dir", tiny_dir, "--out", out,
                      "--epochs", 2, *SMALL, "--train-limit", "20", "--test-limit", "12",
                      "--workers", "0", cwd=tmp_path)
    log = ok(proc)
    rows, state = check_run_outputs(str(out), log, 2, [1, 2], "resnet_tinyimagenet")
    # one output per class of wnids.txt (200 in the real data set, 4 in the generated one)
    wnids = (tiny_dir / "tiny-imagenet-200" / "wnids.txt").read_text().split()
    assert state["model"]["fc.weight"].shape == (len(wnids), 256)
    # the opening line tells the sizes (--train-limit 20, --test-limit 12, 64x64 images)
    assert re.search(r"\b20\b", log[0]) and re.search(r"\b12\b", log[0]) and "64" in log[0]


def test_a_bad_image_decoded_in_a_worker_process_is_one_line(tmp_path):
    """Over 512 files (the real data set always) are decoded by --workers processes: a bad
    JPEG there still ends in one line naming it, not the worker's traceback flattened."""
    root = make_tinyimagenet(tmp_path / "data", n_classes=2, n_train_per_class=260,
                             n_val_per_class=1, size=8)
    bad = sorted((root / "train").glob("*/images/*.JPEG"))[300]
    bad.write_bytes(b"garbage")
    proc = run_script("resnet_tinyimagenet.py", "--data-dir", tmp_path / "data", "--out",
                      tmp_path / "out", "--workers", "2", "--device", "cpu", cwd=tmp_path)
    one_error_line(proc, bad.name)


def test_pretrained_end_to_end_loads_weights(cifar_dir, tmp_path):
    """--weights loads the file: with LR 0 the saved backbone equals the file's tensors."""
    # not the session fixture: its seed 0 is also the scripts' default --seed, so a script
    # that forgot to load the file would start from the very same tensors
    resnet18_weights = make_resnet18_weights(tmp_path / "imagenet.pth", seed=1234)
    out = tmp_path / "out"
    proc = run_script("pretrained_cifar100.py", "--data-dir", cifar_dir, "--out", out,
                      "--epochs", 2, *SMALL, "--lr", "0", "--weights", resnet18_weights,
                      "--image-size", "32", cwd=tmp_path)
    log = ok(proc)
    assert any("loaded" in line and str(resnet18_weights) in line for line in log), log
    rows, state = check_run_outputs(str(out), log, 2, [1, 2], "pretrained_cifar100")
    assert all(float(r["lr"]) == 0 for r in rows)
    source = torch.load(resnet18_weights, map_location="cpu", weights_only=True)
    saved = state["model"]
    assert saved["fc.weight"].shape == (100, 512)
    compared = 0
    for name, tensor in source.items():
        if name.startswith("fc.") or name.endswith(("running_mean", "running_var",
                                                     "num_batches_tracked")):
            continue  # the new head; BN statistics move in training mode even at LR 0
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
        compared += 1
    import torchvision
    backbone = [n for n, _ in torchvision.models.resnet18().named_parameters()
                if not n.startswith("fc.")]
    assert compared == len(backbone) == 60  # every conv and BN weight/bias of the backbone
    # and they are not what the script's own (seed 0) initialisation would give
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fresh = torchvision.models.resnet18().state_dict()
    assert not torch.equal(fresh["conv1.weight"], saved["conv1.weight"])


# -------------------------------------------------------------------------- resume, fresh, evaluate

@pytest.fixture(scope="module")
def resumed_run(cifar_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    out = work / "out"
    args = ["--data-dir", cifar_dir, "--out", out, *SMALL]
    first = ok(run_script("resnet_cifar100.py", *args, "--epochs", 1, cwd=work))
    _, rows1 = read_rows(out)
    second = ok(run_script("resnet_cifar100.py", *args, "--epochs", 2, cwd=work))
    return work, out, args, first, rows1, second


def test_resume_continues_where_it_stopped(resumed_run, cifar_run):
    work, out, args, first, rows1, second = resumed_run
    assert len(rows1) == 1
    assert any(line.startswith("resumed") and "epoch 1" in line for line in second), second
    rows, state = check_run_outputs(str(out), second, 2, [2], "resnet_cifar100")
    assert rows[0] == rows1[0]  # row 1 kept as it was, timings included
    # and the numbers equal those of the uninterrupted run
    _, uninterrupted = read_rows(cifar_run[0])
    assert results(rows) == pytest.approx(results(uninterrupted), rel=1e-4, abs=1e-6)


def test_a_larger_epochs_goes_on_along_the_longer_schedule(cifar_run, cifar_dir, tmp_path):
    """A finished 2-epoch run resumed with --epochs 3 trains epoch 3 on the 3-epoch cosine from
    the step it reached (half the peak LR), not at the LR it ended with (0)."""
    out = tmp_path / "out"
    shutil.copytree(cifar_run[0], out)
    ok(run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL,
                  "--epochs", 3, cwd=tmp_path))
    _, rows = read_rows(out)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[2]["lr"]) == pytest.approx(0.025)  # 0.05 x (1 + cos(pi / 2)) / 2
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["initial_lr"] == 0.05


@pytest.mark.parametrize("change", [["--batch-size", "8"], ["--lr", "0.1"],
                                    ["--dummy", "--dataset", "tinyimagenet"]])
def test_a_changed_recipe_is_refused_and_changes_nothing(cifar_run, cifar_dir, tmp_path, change):
    """Resuming with another recipe would mix two runs (another batch size re-counts the steps
    the schedule has made; another data set does not fit the head): one line, no file touched."""
    out = tmp_path / "out"
    shutil.copytree(cifar_run[0], out)
    before = snapshot_tree(out)
    proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL,
                      "--epochs", 3, *change, cwd=tmp_path)
    one_error_line(proc, out / "checkpoint.pt", change[-2], "--fresh")
    assert snapshot_tree(out) == before


def test_results_without_their_checkpoint_are_not_overwritten(cifar_run, cifar_dir, tmp_path):
    """A folder whose metrics.csv has lost its checkpoint.pt (deleted to save space, say) holds
    results nothing could resume: a run into it stops at once unless --fresh says overwrite."""
    out = tmp_path / "out"
    shutil.copytree(cifar_run[0], out)
    (out / "checkpoint.pt").unlink()
    before = snapshot_tree(out)
    proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL,
                      "--epochs", 1, cwd=tmp_path)
    one_error_line(proc, out, "metrics.csv", "checkpoint.pt", "--fresh")
    assert snapshot_tree(out) == before
    ok(run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL,
                  "--epochs", 1, "--fresh", cwd=tmp_path))
    assert len(read_rows(out)[1]) == 1


def test_what_a_kill_mid_write_left_is_removed(cifar_run, cifar_dir, tmp_path):
    """A file being written aside when the run was killed (NAME.tmp.PID) is removed by the next
    run into the folder, which holds its lock; the files themselves stay as they were."""
    out = tmp_path / "out"
    shutil.copytree(cifar_run[0], out)
    before = snapshot_tree(out)
    (out / "checkpoint.pt.tmp.4242").write_bytes(b"half a checkpoint")
    ok(run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, *SMALL,
                  "--epochs", 2, cwd=tmp_path))
    assert snapshot_tree(out) == before


def test_a_full_disk_is_one_line_and_leaves_no_debris(cifar_dir, tmp_path):
    """The first checkpoint (28 MB) does not fit a 4 MB file system: one line naming the file
    and the cause, and no half-written file left in --out."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", disk],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): the full disk is not simulated")
    try:
        proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", disk / "out",
                          *SMALL, "--epochs", 1, cwd=tmp_path)
        one_error_line(proc, disk / "out" / "checkpoint.pt", "disk full")
        assert not [p for p in os.listdir(disk / "out") if ".tmp." in p]
    finally:
        subprocess.run(["umount", disk], check=True)


def test_fresh_starts_over(resumed_run, cifar_run):
    work, out, args, *_ = resumed_run
    log = ok(run_script("resnet_cifar100.py", *args, "--epochs", 1, "--fresh", cwd=work))
    assert not any("resumed" in line for line in log)
    rows, state = check_run_outputs(str(out), log, 1, [1], "resnet_cifar100")
    _, uninterrupted = read_rows(cifar_run[0])
    assert results(rows) == pytest.approx(results(uninterrupted[:1]), rel=1e-4, abs=1e-6)


def test_evaluate_reports_checkpoint_accuracy_and_writes_nothing(cifar_run, cifar_dir, tmp_path):
    out, _ = cifar_run
    before = snapshot_tree(out)
    proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, "--evaluate",
                      *SMALL, cwd=tmp_path)
    log = ok(proc)
    assert not any(EPOCH.match(line) for line in log)
    final = FINAL.match(log[-1])
    assert final, log
    _, rows = read_rows(out)
    assert abs(float(final.group(1)) - float(rows[-1]["test_acc"])) < 0.0051
    assert snapshot_tree(out) == before
    assert os.listdir(tmp_path) == []


def test_evaluate_takes_any_batch_but_not_another_data_set(cifar_run, cifar_dir, tmp_path):
    """Evaluation depends on the data the network was made for, not on the training recipe: a
    checkpoint of CIFAR-100's 100 classes is not tested on TinyImageNet's 200 (a traceback of
    mismatched shapes before), while another --batch-size or --seed changes nothing."""
    out, _ = cifar_run
    ok(run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, "--evaluate",
                  *SMALL, "--batch-size", "7", "--seed", "3", cwd=tmp_path))
    proc = run_script("resnet_cifar100.py", "--out", out, "--evaluate", *SMALL, "--dummy",
                      "--dataset", "tinyimagenet", cwd=tmp_path)
    one_error_line(proc, "--dataset was cifar100 in that run, here tinyimagenet")


def test_evaluate_without_checkpoint(cifar_dir, tmp_path):
    out = tmp_path / "none"
    proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, "--evaluate",
                      *SMALL, cwd=tmp_path)
    one_error_line(proc, "--evaluate", os.path.join(str(out), "checkpoint.pt"))


# -------------------------------------------------------------------------- errors

@pytest.mark.parametrize("script,folder", [("resnet_cifar100.py", "cifar-100-python"),
                                           ("resnet_tinyimagenet.py", "tiny-imagenet-200"),
                                           ("pretrained_cifar100.py", "cifar-100-python")])
def test_missing_data(script, folder, tmp_path, resnet18_weights):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    weights = ["--weights", resnet18_weights] if script.startswith("pretrained") else []
    proc = run_script(script, "--data-dir", data_dir, "--out", tmp_path / "out", "--epochs", 1,
                      *SMALL, *weights, cwd=tmp_path)
    one_error_line(proc, os.path.join(str(data_dir), folder), "--download")
    assert os.listdir(data_dir) == []
    assert not (tmp_path / "out").exists()  # a failed start leaves no empty run folder


def test_failed_start_keeps_a_folder_it_did_not_create(tmp_path):
    data_dir, out = tmp_path / "data", tmp_path / "mine"
    data_dir.mkdir()
    out.mkdir()  # the user's own (empty) folder: it was there before, so it stays
    proc = run_script("resnet_cifar100.py", "--data-dir", data_dir, "--out", out / "a" / "b",
                      "--epochs", 1, *SMALL, cwd=tmp_path)
    one_error_line(proc, "--download")
    assert out.is_dir() and os.listdir(out) == []  # a/b made by the run: gone; mine: kept


def test_an_out_that_cannot_be_made_leaves_none_of_its_parents(tmp_path):
    """makedirs fails part of the way (a name too long for the file system): the folders it
    had made above that name are taken away, as for any failed start."""
    out = tmp_path / "runs" / "a" / ("x" * 300)
    proc = run_script("resnet_cifar100.py", "--data-dir", tmp_path, "--out", out, "--epochs", 1,
                      *SMALL, cwd=tmp_path)
    one_error_line(proc, f"--out {out}: cannot write there", "choose a writable folder")
    assert os.listdir(tmp_path) == []


def _bad_weights(path, kind):
    if kind == "wrong_keys":
        torch.save({"features.0.weight": torch.zeros(3, 3)}, path)
    elif kind == "resnet34":
        import torchvision
        torch.save(torchvision.models.resnet34().state_dict(), path)
    elif kind == "whole_model":  # a pickled module, not a state_dict
        import torchvision
        torch.save(torchvision.models.resnet18(), path)
    elif kind == "text":
        path.write_text("not weights\n")
    elif kind == "missing":
        pass


@pytest.mark.parametrize("kind", ["wrong_keys", "whole_model", "text", "missing"])
def test_bad_weights_file(kind, cifar_dir, tmp_path):
    path = tmp_path / f"{kind}.pth"
    _bad_weights(path, kind)
    proc = run_script("pretrained_cifar100.py", "--data-dir", cifar_dir, "--out", tmp_path / "out",
                      "--epochs", 1, *SMALL, "--image-size", "32", "--weights", path,
                      cwd=tmp_path)
    line = one_error_line(proc, str(path))
    assert "\x1b" not in line
    assert not os.path.exists(tmp_path / "out" / "checkpoint.pt")


def test_missing_weights_offline(cifar_dir, tmp_path):
    torch_home = tmp_path / "torch_home"
    torch_home.mkdir()
    proxy = "http://127.0.0.1:9"
    env = clean_env(TORCH_HOME=str(torch_home), https_proxy=proxy, http_proxy=proxy,
                    HTTPS_PROXY=proxy, HTTP_PROXY=proxy)
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(name, None)
    proc = run_script("pretrained_cifar100.py", "--data-dir", cifar_dir, "--out", tmp_path / "out",
                      "--epochs", 1, *SMALL, "--image-size", "32", cwd=tmp_path, env=env,
                      timeout=120)
    one_error_line(proc, os.path.join(str(torch_home), "hub", "checkpoints"),
                   "resnet18-f37072fd.pth", "--weights")
    assert not os.path.exists(tmp_path / "out" / "checkpoint.pt")


def test_unwritable_out(cifar_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker / "out"
    proc = run_script("resnet_cifar100.py", "--data-dir", cifar_dir, "--out", out, "--epochs", 1,
                      *SMALL, cwd=tmp_path)
    one_error_line(proc, "--out", out)
    assert blocker.read_text() == "x"


def test_recording_the_versions_does_not_import_torchvision():
    """config.json names torchvision's version without importing it: the import pulls in
    torch._dynamo, some 2.5 s of CPU in every process of a script that builds no torchvision
    model (async SGD's server and workers use no torch.optim, which would import it anyway)."""
    probe = ("import sys; from common import outputs; env = outputs.environment('cpu'); "
             "print(env['torchvision'], 'torchvision' in sys.modules, "
             "'torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    from importlib.metadata import version
    assert result.stdout.split() == [version("torchvision"), "False", "False"], result
