"""The homework report: every run's result in one table and one figure.

    python report.py                       # the runs under runs/
    python report.py runs/ elsewhere/runs  # several folders; --out says where the report goes

A run folder is any folder, at any depth, holding the config.json and metrics.csv that every
script writes into its --out, whatever launched it and however often it was resumed (the
scripts rewrite metrics.csv whole from the checkpoint each epoch).  report.py only reads them
and writes two files into --out (default: the first RUNS_DIR):

  report.md   a row per run: task, data set, architecture, homework target, final and best test
              accuracy, epochs done of planned (fewer: "in progress"), wall time, images/s,
              ranks or workers, precision, async staleness, whether the target is met
  report.png  test accuracy per epoch, one panel per data set, each homework target as a dashed
              line; async runs' staleness per epoch in a panel beside them

A run on --dummy data or on a --train-limit/--test-limit subset is marked so in both, and
its homework target is neither met nor missed.  A folder that is not a run, a half-written one,
or one whose files hold something the scripts never write is named in one line and skipped.
"""
import csv
import json
import math
import os
import reprlib
import statistics
import sys
from pathlib import Path

from common.checkpoint import atomic_write
from common.flags import HelpFormatter, Parser
from common.run import UserError, execute

# The homework's test-accuracy targets, %: a copy of each main's TARGET constant and of the data
# set it applies to (each main passes target=TARGET only when args.dataset is that one).
# tests/test_report.py checks that the two agree.  Their order is the table's.
TARGETS = {"resnet_cifar100": ("cifar100", 60.0),
           "resnet_tinyimagenet": ("tinyimagenet", 50.0),
           "pretrained_cifar100": ("cifar100", 70.0),
           "sync_sgd_cifar100": ("cifar100", 60.0),
           "async_sgd_cifar100": ("cifar100", 60.0)}
TABLE = ["run", "task", "data set", "architecture", "target", "final test acc", "best test acc",
         "epochs", "wall time", "images/s", "ranks / workers", "precision",
         "staleness mean / max", "target met"]
PANEL_INCHES = (5.2, 4.4)  # one panel of report.png
DPI = 100

# What report.py reads of a run's files: each field's test and, in words, what it must be.
# config.json's "args.x" is config["args"]["x"]; a count is an int, not JSON's true or false.
TEXT = (lambda v: isinstance(v, str) and v.isprintable() and v.strip() != "", "a line of text")
COUNT = (lambda v: type(v) is int and v >= 1, "a positive integer")
LIMIT = (lambda v: v is None or (type(v) is int and v >= 1), "a positive integer or null")
CONFIG_FIELDS = {"script": TEXT, "arch": TEXT, "world_size": COUNT, "precision": TEXT,
                 "args.dataset": TEXT, "args.epochs": COUNT, "args.batch_size": COUNT}
# A run from before --dummy and --train-limit/--test-limit lacks these: Run takes real data, all.
OPTIONAL_FIELDS = {"args.dummy": (lambda v: isinstance(v, bool), "true or false"),
                   "args.train_limit": LIMIT, "args.test_limit": LIMIT}
# metrics.csv's columns: each a finite number, and more; only the async runs' have staleness.
FROM_0 = (lambda v: v >= 0, "a number from 0")
METRIC_COLUMNS = {"epoch": (lambda v: v >= 1 and v == int(v), "a whole number from 1"),
                  "test_acc": (lambda v: 0 <= v <= 100, "a percentage from 0 to 100"),
                  "elapsed_seconds": FROM_0, "images_per_s": FROM_0}
STALENESS_COLUMNS = {"mean_staleness": FROM_0, "max_staleness": FROM_0}


class NotARun(Exception):
    """Why a folder is skipped: its message is the one line the user sees."""


class Run:
    """One run folder: its config.json and its metrics.csv rows (numbers)."""

    def __init__(self, folder, name, config, rows):
        self.folder, self.name, self.config, self.rows = folder, name, config, rows
        args = config["args"]
        self.script, self.arch = config["script"], config["arch"]
        self.dataset, self.planned = args["dataset"], args["epochs"]
        # not a homework result: random data (--dummy), or a subset (--train-limit/--test-limit)
        self.dummy = args.get("dummy", False)
        self.limits = args.get("train_limit"), args.get("test_limit")
        self.subset = self.limits != (None, None)
        own_dataset, target = TARGETS.get(self.script, (None, None))
        self.target = target if self.dataset == own_dataset else None
        self.done = int(rows[-1]["epoch"])
        self.in_progress = self.done < self.planned
        self.staleness = [r for r in rows if all(c in r for c in STALENESS_COLUMNS)]

    @property
    def data(self):
        """The data set, and what the run saw of it when not all of the real data."""
        notes = ["dummy data"] if self.dummy else []
        if self.subset:
            train, test = (f"{n}" if n else "all" for n in self.limits)
            notes.append(f"subset: {train} train / {test} test")
        return f"{self.dataset} ({', '.join(notes)})" if notes else self.dataset

    @property
    def layout(self):
        """Who computed: the processes, and the share of the global batch each one took."""
        world, batch = self.config["world_size"], self.config["args"]["batch_size"]
        if "updates_per_epoch" in self.config:  # async SGD: a server and its workers
            workers = world - 1
            return (f"1 server + {workers} worker{'s' * (workers > 1)} x {batch // workers} = "
                    f"global batch {batch // workers * workers}")
        if world > 1:  # sync SGD
            return f"{world} ranks x {batch // world} = global batch {batch // world * world}"
        return f"1 process, batch {batch}"

    @property
    def label(self):
        """The run in the figure's legend."""
        name = self.script if os.path.basename(self.name) == self.script else \
            f"{self.script} [{self.name}]"
        detail = [self.arch, self.layout]
        if self.in_progress:
            detail.append(f"in progress {self.done}/{self.planned}")
        detail += ["dummy data"] * self.dummy + ["subset"] * self.subset
        return f"{name} ({', '.join(detail)})"

    def table_row(self):
        final, best = self.rows[-1]["test_acc"], max(r["test_acc"] for r in self.rows)
        target = "-" if self.target is None else f"{self.target:g}%"
        if self.target is None:
            met = "- (no target on this data set)"
        elif self.dummy or self.subset:
            met = f"- ({'dummy data' if self.dummy else 'a subset'}: not a homework result)"
        elif final >= self.target:
            met = "yes"
        else:
            met = "not yet" if self.in_progress else "no"
        staleness = "-"
        if self.staleness:
            staleness = (f"{statistics.mean(r['mean_staleness'] for r in self.staleness):.2f} / "
                         f"{max(r['max_staleness'] for r in self.staleness):g}")
        epochs = f"{self.done}/{self.planned}" + (" (in progress)" if self.in_progress else "")
        images_per_s = statistics.median(r["images_per_s"] for r in self.rows)
        return [self.name, self.script, self.data, self.arch, target, f"{final:.2f}%",
                f"{best:.2f}%", epochs, duration(self.rows[-1]["elapsed_seconds"]),
                f"{images_per_s:.0f}", self.layout, self.config["precision"], staleness, met]


def duration(seconds):
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def read_config(folder):
    """config.json, each field report.py reads checked; anything else raises NotARun."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise NotARun("no config.json") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise NotARun(f"config.json is not readable JSON ({why})") from None
    if not isinstance(config, dict) or not isinstance(config.get("args"), dict):
        raise NotARun("config.json holds no 'args' object")
    for key, (test, what) in {**CONFIG_FIELDS, **OPTIONAL_FIELDS}.items():
        holder, name = (config["args"], key[5:]) if key.startswith("args.") else (config, key)
        if name not in holder:
            if key in OPTIONAL_FIELDS:
                continue
            raise NotARun(f"config.json lacks '{key}'")
        if not test(holder[name]):
            raise NotARun(f"config.json: '{key}' is {reprlib.repr(holder[name])}, not {what}")
    # the processes that each take a share of the global batch: the workers of an async run
    world, batch = config["world_size"], config["args"]["batch_size"]
    takers = world - 1 if "updates_per_epoch" in config else world
    if takers < 1:
        raise NotARun(f"config.json: an async run (it has 'updates_per_epoch') with "
                      f"'world_size' {world}; it needs a server and at least one worker")
    if batch < takers:
        raise NotARun(f"config.json: 'args.batch_size' {batch} is less than its {takers} ranks "
                      "or workers")
    return config


def read_metrics(folder):
    """The rows of metrics.csv as numbers; a missing or half-written file raises NotARun."""
    try:
        with open(os.path.join(folder, "metrics.csv"), newline="") as f:
            reader = csv.DictReader(f)
            columns, lines = reader.fieldnames, list(reader)
    except FileNotFoundError:
        raise NotARun("no metrics.csv yet (no epoch finished)") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise NotARun(f"metrics.csv is not readable CSV ({exc})") from None
    if not columns:
        raise NotARun("metrics.csv is empty")
    missing = [c for c in METRIC_COLUMNS if c not in columns]
    if missing:
        raise NotARun(f"metrics.csv lacks the column(s) {', '.join(missing)}")
    if not lines:
        raise NotARun("metrics.csv has no epoch yet")
    rows = []
    for number, line in enumerate(lines, start=2):  # line 1 is the header
        if None in line or None in line.values() or any(line[c] == "" for c in METRIC_COLUMNS):
            raise NotARun(f"metrics.csv line {number} is incomplete or has extra fields")
        try:
            row = {c: float(v) for c, v in line.items() if v != ""}
        except ValueError:
            raise NotARun(f"metrics.csv line {number} holds something not a number") from None
        for column, (test, what) in {**METRIC_COLUMNS, **STALENESS_COLUMNS}.items():
            if column in row and not (math.isfinite(row[column]) and test(row[column])):
                raise NotARun(f"metrics.csv line {number}: {column} is {row[column]:g}, "
                              f"not {what}")
        if rows and row["epoch"] <= rows[-1]["epoch"]:
            raise NotARun(f"metrics.csv line {number}: epochs out of order")
        rows.append(row)
    return rows


def find_runs(roots, say):
    """Every run under `roots`, and a line for each folder skipped (also passed to `say`)."""
    runs, skipped = [], []
    for root in roots:
        if not os.path.isdir(root):
            what = "a file, not a folder" if os.path.exists(root) else "no such folder"
            raise UserError(f"{root}: {what}; name the folder holding the runs "
                            "(the scripts' --out, runs/ by default)")
        found = False
        for folder, subfolders, files in os.walk(root):
            subfolders.sort()
            if not {"config.json", "metrics.csv", "checkpoint.pt"} & set(files):
                continue  # no file that a run writes
            found = True
            name = os.path.relpath(folder, root)
            name = os.path.basename(os.path.abspath(root)) if name == "." else name
            try:
                runs.append(Run(folder, name, read_config(folder), read_metrics(folder)))
            except NotARun as exc:
                skipped.append(f"{folder}: {exc}")
                say(f"skipped {folder}: {exc}")
        if not found:
            say(f"{root}: holds no run folder (config.json and metrics.csv)")
    order = list(TARGETS)
    runs.sort(key=lambda r: (order.index(r.script) if r.script in order else len(order), r.name))
    return runs, skipped


def markdown(runs, skipped):
    def cells(values):
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    lines = ["# HW4 report", "",
             "Final and best test accuracy of each run; the homework target applies on the "
             "task's own data set, and counts as met when the final accuracy reaches it.", "",
             cells(TABLE), cells(["---"] * len(TABLE))]
    lines += [cells(run.table_row()) for run in runs]
    lines += ["", "![test accuracy per epoch](report.png)", ""]
    if skipped:
        lines += ["Skipped (not a run, half-written, or holding what no script writes):", ""]
        lines += [f"- {line}" for line in skipped] + [""]
    return "\n".join(lines)


def figure(runs):
    """Test accuracy per epoch, a panel per data set, the targets as dashed lines; then async
    runs' staleness per epoch.  A run keeps its colour in every panel."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure  # not pyplot: no window, nothing to close
    from matplotlib.ticker import MaxNLocator

    datasets = list(dict.fromkeys(run.dataset for run in runs))
    stale = [run for run in runs if run.staleness]
    panels = len(datasets) + bool(stale)
    colour = {run: f"C{i % 10}" for i, run in enumerate(runs)}
    # every text as written: a '$' in a folder or config value opens no formula
    with rc_context({"text.parse_math": False}):
        fig = Figure(figsize=(PANEL_INCHES[0] * panels, PANEL_INCHES[1]), dpi=DPI)
        axes = fig.subplots(1, panels, squeeze=False)[0]
        for ax, dataset in zip(axes, datasets):
            here = [run for run in runs if run.dataset == dataset]
            for run in here:
                ax.plot([r["epoch"] for r in run.rows], [r["test_acc"] for r in run.rows],
                        "o--" if run.in_progress else "o-", color=colour[run], ms=3, lw=1.5,
                        label=run.label)
            for target in sorted({run.target for run in here} - {None}):
                scripts = dict.fromkeys(run.script for run in here if run.target == target)
                ax.axhline(target, color="gray", ls="--", lw=1,
                           label=f"target {target:g}%: {', '.join(scripts)}")
                ax.text(0.01, target + 1, f"target {target:g}%", color="gray", fontsize="x-small",
                        transform=ax.get_yaxis_transform())  # x in axes fraction, y in data
            ax.set(title=f"{dataset}: test accuracy", xlabel="epoch",
                   ylabel="test accuracy (%)", ylim=(0, 100))
        for run in stale:
            epochs = [r["epoch"] for r in run.staleness]
            axes[-1].plot(epochs, [r["mean_staleness"] for r in run.staleness], "o-",
                          color=colour[run], ms=3, label=f"{run.name}: mean")
            axes[-1].plot(epochs, [r["max_staleness"] for r in run.staleness], ":",
                          color=colour[run], label=f"{run.name}: max")
        if stale:
            axes[-1].set(title="async SGD: staleness per epoch", xlabel="epoch",
                         ylabel="updates between read and apply", ylim=(0, None))
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="x-small",
                      frameon=False)
        fig.tight_layout()
    return fig


def write_report(runs, skipped, out):
    try:
        os.makedirs(out, exist_ok=True)
        atomic_write(os.path.join(out, "report.md"),
                     lambda tmp: Path(tmp).write_text(markdown(runs, skipped)))
        fig = figure(runs)
        atomic_write(os.path.join(out, "report.png"), lambda tmp: fig.savefig(tmp, format="png"))
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write the report there ({exc.strerror}); "
                        "choose a writable folder") from None


def parse_args(argv=None):
    parser = Parser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("runs_dirs", nargs="*", metavar="RUNS_DIR",
                        help="folders searched, at any depth, for run folders (default: runs)")
    parser.add_argument("--out", help="folder that gets report.md and report.png "
                                      "(default: the first RUNS_DIR)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    roots = args.runs_dirs or ["runs"]
    runs, skipped = find_runs(roots, lambda line: print(line, file=sys.stderr))
    if not runs:
        raise UserError(f"no run to report under {', '.join(roots)}; train one first "
                        "(e.g. python resnet_cifar100.py) or name the folders holding the runs")
    out = args.out or roots[0]
    write_report(runs, skipped, out)
    in_progress = sum(run.in_progress for run in runs)
    print(f"{os.path.join(out, 'report.md')}, {os.path.join(out, 'report.png')}: "
          f"{len(runs)} runs ({in_progress} in progress), {len(skipped)} folders skipped")


if __name__ == "__main__":
    execute(main)
