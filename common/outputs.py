"""The files of a run: config.json, metrics.csv and curve.png (checkpoint.pt: checkpoint.py)."""
import csv
import json
import os
import platform
import sys

import torch

from .checkpoint import atomic_write

COLUMNS = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
           "epoch_seconds", "elapsed_seconds", "images_per_s"]


def environment(device):
    import numpy
    import torchvision
    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "torchvision": torchvision.__version__, "numpy": numpy.__version__,
           "platform": platform.platform(), "device": str(device),
           "threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


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
                writer.writerow({k: _fmt(v) for k, v in row.items()})
    atomic_write(os.path.join(out, "metrics.csv"), write)


def _fmt(value):
    return f"{value:.6g}" if isinstance(value, float) else value


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
        acc.plot(epochs, [r["train_acc"] for r in rows], "-", color="C1", lw=1, alpha=0.7,
                 label="train accuracy (augmented)")
    if target is not None:
        acc.axhline(target, color="gray", ls="--", lw=1, label=f"homework target {target:g}%")
    best = max(r["test_acc"] for r in rows)
    acc.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100),
            title=f"{title}: final {rows[-1]['test_acc']:.2f}%, best {best:.2f}%")
    # The loss shows a diverging run first; training loss includes label smoothing.
    loss.plot(epochs, [r["test_loss"] for r in rows], "o-", color="C0", lw=2, ms=3,
              label="test loss")
    loss.plot(epochs, [r["train_loss"] for r in rows], "-", color="C1", lw=1, alpha=0.7,
              label="train loss (label-smoothed)")
    loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss", ylim=(0, None))
    for ax, where in ((acc, "lower right"), (loss, "best")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
INSTALL_TENSORBOARD = "pip install tensorboard"


def tensorboard_missing():
    """Why --tensorboard cannot write (None when it can): torch's writer needs the package."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        return f"the tensorboard package is not importable ({exc}); {INSTALL_TENSORBOARD}"
    return None


class TensorBoardLog:
    """--tensorboard: each epoch's scalars in <out>/tb, at step = epoch number.

    A resumed run therefore continues at the next epoch.  `purge_step` is the first epoch this
    process writes: TensorBoard drops the points at or after it that an earlier, crashed
    process wrote (an epoch logged before its checkpoint was), so no epoch shows twice.
    """

    def __init__(self, out, first_epoch):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=first_epoch)

    def add_row(self, row):
        for column, tag in TENSORBOARD_TAGS.items():
            if row.get(column) is not None:
                self.writer.add_scalar(tag, row[column], row["epoch"])
        self.writer.flush()  # on disk now: a kill loses nothing already logged
