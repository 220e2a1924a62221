"""The run folder (--out): claimed by one run at a time, and its files config.json, metrics.csv,
curve.png and, with --tensorboard, tb/ (checkpoint.pt: common/checkpoint.py).

Over 250 lines because it owns --out whole: claiming it (created, proved writable, locked, a
record without its checkpoint refused) as well as writing each of the run's files."""
import atexit
import contextlib
import csv
import datetime
import errno
import fcntl
import importlib.util
import json
import os
import platform
import re
import socket
import sys

import torch

from .checkpoint import atomic_write
from .process import UserError, make_folders, remove_empty

COLUMNS = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
           "epoch_seconds", "elapsed_seconds", "images_per_s"]


class RunFolder:
    """--out of a training run; only the main rank writes.  Claimed at once (created, proved
    writable, locked), so a second run into the same folder stops before it trains."""

    def __init__(self, args, proc, target=None):
        self.args, self.proc, self.target = args, proc, target
        self.tensorboard = None  # --tensorboard's writer, made when the first row is written
        if proc.is_main and not args.evaluate:  # before any training time is spent
            prepare_out_dir(args.out)
            lock_out_dir(args.out)
            check_out_dir(args.out, args.fresh)

    def write_config(self, resumed_after_epoch, **extra):
        """config.json, unless the run in --out has all its --epochs: then it stays its record."""
        if resumed_after_epoch >= self.args.epochs:
            self.proc.log(f"{self.args.out} holds {resumed_after_epoch} epochs (--epochs "
                          f"{self.args.epochs}): nothing to train; a larger --epochs goes on")
        elif self.proc.is_main:
            write_config(self.args.out, self.args, self.proc.device, script=self.proc.script,
                         arch=self.args.arch, world_size=self.proc.world_size,
                         precision=self.proc.precision, resumed_after_epoch=resumed_after_epoch,
                         **extra)

    def write(self, rows):
        """The epochs so far: metrics.csv and curve.png rewritten whole, the last row to tb/."""
        if not self.proc.is_main:
            return
        if self.args.tensorboard:
            if self.tensorboard is None:  # a new writer (re)logs every epoch the checkpoint has
                self.tensorboard = TensorBoardLog(self.args.out, first_epoch=rows[0]["epoch"])
                for row in rows[:-1]:
                    self.tensorboard.add_row(row)
            self.tensorboard.add_row(rows[-1])
        write_metrics(self.args.out, rows)
        plot_curve(self.args.out, rows, self.proc.script, self.target)


def environment(device):
    import numpy
    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "torchvision": torchvision_version(), "numpy": numpy.__version__,
           "platform": platform.platform(), "device": str(device),
           "threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def torchvision_version():
    """torchvision.__version__ without importing torchvision: its import pulls in torch._dynamo,
    about 2.5 s of CPU that a script that builds no torchvision model need not pay."""
    spec = importlib.util.find_spec("torchvision")
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            return re.search(r"^__version__ = ['\"](.+)['\"]", f.read(), re.M).group(1)
    except (AttributeError, TypeError, OSError):  # not installed, or laid out otherwise
        return None


def write_config(out, args, device, **extra):
    config = {"args": vars(args), "environment": environment(device), **extra}
    text = json.dumps(config, indent=2, default=str) + "\n"

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(os.path.join(out, "config.json"), write)


def write_metrics(out, rows):
    """Rewrite metrics.csv whole from the rows kept in the checkpoint.

    A resumed run therefore never duplicates nor truncates rows: the file always matches the
    checkpoint written with it.
    """
    columns = COLUMNS + [k for row in rows for k in row if k not in COLUMNS]
    columns = list(dict.fromkeys(columns))

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in rows:
                writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v
                                 for k, v in row.items()})
    atomic_write(os.path.join(out, "metrics.csv"), write)


def curve_figure(rows, title, target=None):
    """The figure of curve.png: accuracy per epoch (test, train beside it, the homework target
    as a line) on the left, training and test loss per epoch on the right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in rows]
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10.4, 4.2), dpi=100)
    acc.plot(epochs, [r["test_acc"] for r in rows], "o-", color="C0", lw=2, ms=3,
             label="test accuracy")
    if all(r.get("train_acc") is not None for r in rows):
        acc.plot(epochs, [r["train_acc"] for r in rows], ".-", color="C1", lw=1, alpha=0.7,
                 label="train accuracy (augmented)")
    if target is not None:
        acc.axhline(target, color="gray", ls="--", lw=1, label=f"homework target {target:g}%")
    best = max(r["test_acc"] for r in rows)
    acc.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100),
            title=f"{title}: final {rows[-1]['test_acc']:.2f}%, best {best:.2f}%")
    # The loss shows a diverging run first; training loss includes label smoothing.
    loss.plot(epochs, [r["test_loss"] for r in rows], "o-", color="C0", lw=2, ms=3,
              label="test loss")
    loss.plot(epochs, [r["train_loss"] for r in rows], ".-", color="C1", lw=1, alpha=0.7,
              label="train loss (label-smoothed)")
    loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss", ylim=(0, None))
    for ax, where in ((acc, "best"), (loss, "best")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(epochs) == 1:  # one point: whole epochs on the axis, not a zoom around it
            ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
        ax.grid(alpha=0.3)
        ax.legend(loc=where)
    fig.tight_layout()
    return fig


def plot_curve(out, rows, title, target=None):
    """curve.png: see curve_figure."""
    import matplotlib.pyplot as plt
    fig = curve_figure(rows, title, target)
    atomic_write(os.path.join(out, "curve.png"), lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


# --tensorboard: metrics.csv column -> scalar tag (async rows add the staleness columns).
TENSORBOARD_TAGS = {"train_loss": "loss/train", "test_loss": "loss/test",
                    "train_acc": "accuracy/train", "test_acc": "accuracy/test",
                    "lr": "learning_rate", "images_per_s": "images_per_s",
                    "mean_staleness": "staleness/mean", "max_staleness": "staleness/max"}


class TensorBoardLog:
    """--tensorboard: each epoch's scalars in <out>/tb, at step = epoch number, so a resumed run
    continues at the next epoch.  `purge_step` is the first epoch this process writes:
    TensorBoard drops the points at or after it that an earlier process wrote, and RunFolder
    writes them again from the checkpoint's rows, so tb/ shows every epoch it holds, once."""

    def __init__(self, out, first_epoch):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=first_epoch)

    def add_row(self, row):
        for column, tag in TENSORBOARD_TAGS.items():
            if row.get(column) is not None:
                self.writer.add_scalar(tag, row[column], row["epoch"])
        self.writer.flush()  # on disk now: a kill loses nothing already logged


def prepare_out_dir(out):
    """Create --out and prove it writable before any training time is spent.  Folders made here
    are removed at exit if still empty: a run that fails before writing anything leaves none."""
    try:
        made = make_folders(out)
        atexit.register(remove_empty, made)  # after _release_lock: atexit runs last-in first-out
        probe = os.path.join(out, f".write-test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write there ({exc.strerror}); "
                        "choose a writable folder") from None


def check_out_dir(out, fresh):
    """Under the lock: remove the NAME.tmp.PID files a run killed mid-write left, and refuse a
    folder whose results (metrics.csv) have no checkpoint.pt to resume from."""
    for name in os.listdir(out):
        if re.fullmatch(r".+\.tmp\.\d+", name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, name))
    if not fresh and os.path.exists(os.path.join(out, "metrics.csv")) \
            and not os.path.exists(os.path.join(out, "checkpoint.pt")):
        raise UserError(f"--out {out}: holds metrics.csv but no checkpoint.pt to resume from; "
                        "pass --fresh to overwrite those results, or choose another --out")


LOCK_FILE = ".lock"
_held_locks = {}  # real path of a held lock file -> its open descriptor (held until exit)


def lock_out_dir(out):
    """One run per --out: hold an advisory lock (flock) on --out/.lock while this process lives.

    The kernel drops a flock when its process ends, however it ends, so the file a killed run
    leaves behind never blocks the next.  The holder writes its host, pid and start time into
    the file, so that a second run can say who holds it; a clean exit removes the file."""
    path = os.path.realpath(os.path.join(out, LOCK_FILE))
    if path in _held_locks:
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"--out {out} is in use by another run ({holder}); wait for it to "
                                "end or stop it, or choose another --out") from None
            print(f"note: --out {out}: cannot lock {LOCK_FILE} ({exc.strerror}); make sure no "
                  "other run trains into it", file=sys.stderr, flush=True)
            return
        try:  # the previous holder may have removed the file between our open and our lock
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "since": since}).encode() + b"\n", 0)
    _held_locks[path] = fd
    atexit.register(_release_lock, path)


def _read_holder(fd):
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: it is starting"


def _release_lock(path):
    fd = _held_locks.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):  # removed while still held: nobody locks it meanwhile
            os.remove(path)
        os.close(fd)
