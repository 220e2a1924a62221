"""The run folder (--out): claimed by one run at a time, and its files: config.json, metrics.csv,
curve.png, checkpoint.pt (common/checkpoint.py) and, with --tensorboard, tb/."""
import csv
import io
import json
import os
import platform
import sys
from importlib.metadata import version

import torch

from . import checkpoint
from .folders import claim
from .run import Interrupted, NonFiniteLoss, resume_hint

COLUMNS = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
           "epoch_seconds", "elapsed_seconds", "images_per_s"]


class RunFolder:
    """--out of a training run; only the main rank writes.  Claimed at once (created, proved
    writable, locked), so that a second run into the same folder stops before it trains."""

    def __init__(self, args, run, target=None):
        self.args, self.run, self.target = args, run, target
        self.checkpoint = os.path.join(args.out, "checkpoint.pt")
        self.tensorboard = None  # --tensorboard's writer, made when the first row is written
        if run.is_main and not args.evaluate:  # before any training time is spent
            claim(args.out, args.fresh)

    def resume(self, model, optimizer=None, scheduler=None, comm=None):
        """The epochs done so far (a `checkpoint.State`), loaded into the model, optimizer and
        schedule, which `save` writes from then on."""
        self.trained = model, optimizer, scheduler
        return checkpoint.resume(self.checkpoint, self.args, self.run, *self.trained, comm)

    def write_config(self, state, **extra):
        """config.json, unless the run in --out has all its --epochs: then it stays its record."""
        if state.epoch >= self.args.epochs:
            self.run.log(f"{self.args.out} holds {state.epoch} epochs (--epochs "
                         f"{self.args.epochs}): nothing to train; a larger --epochs goes on")
        elif self.run.is_main:
            config = {"args": vars(self.args), "environment": environment(self.run.device),
                      "script": self.run.script, "arch": self.args.arch,
                      "world_size": self.run.world_size, "precision": self.run.precision,
                      "resumed_after_epoch": state.epoch, **extra}
            write_text(os.path.join(self.args.out, "config.json"),
                       json.dumps(config, indent=2, default=str) + "\n")

    def save(self, state, partial=None):
        """checkpoint.pt (with an interrupted epoch's `partial` progress), on the main rank."""
        model, optimizer, scheduler = self.trained  # never NaN weights: every rank checks
        if not all(t.isfinite().all() for t in model.state_dict().values()):
            raise NonFiniteLoss(f"the weights became NaN or inf; the last good checkpoint in "
                                f"{self.run.out} is kept; lower --lr or try --no-amp")
        if self.run.is_main:
            extra = dict(state.extra, world_size=self.run.world_size,
                         **({"partial": partial} if partial else {}))
            checkpoint.save(self.checkpoint, script=self.run.script, arch=self.args.arch,
                            model=model, optimizer=optimizer, scheduler=scheduler,
                            epoch=state.epoch, rows=state.rows, args=vars(self.args), extra=extra)

    def stop(self, state, metrics):
        """After a SIGTERM/SIGINT: checkpoint the step reached, and exit with 128 + signal."""
        self.save(state, partial=metrics.partial())
        raise Interrupted(f"stopped by {self.run.stop.name} during epoch {metrics.epoch + 1}: "
                          f"checkpoint written to {self.checkpoint}; {resume_hint(self.args)}",
                          self.run.stop.signum)

    def end_epoch(self, state, row, note=""):
        """Log the epoch's line (and `note`), checkpoint it, and rewrite metrics.csv and
        curve.png (and add to tb/) as the checkpoint holds them."""
        state.rows.append(row)
        state.epoch = row["epoch"]
        self.run.log(epoch_line(row, self.args.epochs) + note)
        self.save(state)  # resumable from here
        if not self.run.is_main:
            return
        if self.args.tensorboard and self.tensorboard is None:
            # a new writer (re)logs every epoch the checkpoint holds
            self.tensorboard = TensorBoardLog(self.args.out, first_epoch=state.rows[0]["epoch"])
            for earlier in state.rows[:-1]:
                self.tensorboard.add_row(earlier)
        if self.tensorboard is not None:
            self.tensorboard.add_row(row)
        write_metrics(self.args.out, state.rows)
        plot_curve(self.args.out, state.rows, self.run.script, self.target)


def epoch_line(row, epochs):
    return (f"epoch {row['epoch']:>3}/{epochs} | train loss {row['train_loss']:.4f} "
            f"acc {row['train_acc']:6.2f}% | test loss {row['test_loss']:.4f} "
            f"acc {row['test_acc']:6.2f}% | lr {row['lr']:.4g} | "
            f"{row['epoch_seconds']:.1f} s | {row['images_per_s']:.0f} img/s")


def environment(device):
    # torchvision's version from its installed metadata: importing it pulls in torch._dynamo,
    # seconds of CPU that a script building no torchvision model need not pay
    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "torchvision": version("torchvision"), "numpy": version("numpy"),
           "platform": platform.platform(), "device": str(device),
           "threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return env


def write_text(path, text):
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            f.write(text)
    checkpoint.atomic_write(path, write)


def write_metrics(out, rows):
    """metrics.csv, rewritten whole from the rows the checkpoint keeps: a resumed run never
    duplicates nor truncates rows."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(dict.fromkeys(
        COLUMNS + [k for row in rows for k in row])))
    writer.writeheader()
    for row in rows:
        writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
    write_text(os.path.join(out, "metrics.csv"), text.getvalue())


def curve_figure(rows, title, target=None):
    """curve.png's figure: accuracy per epoch (test, train beside it, the homework target as a
    line) on the left, training and test loss on the right (a diverging run shows there)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in rows]
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10.4, 4.2), dpi=100)
    for ax, metric, train_label in ((acc, "acc", "train accuracy (augmented)"),
                                    (loss, "loss", "train loss (label-smoothed)")):
        ax.plot(epochs, [r[f"test_{metric}"] for r in rows], "o-", color="C0", lw=2, ms=3,
                label=f"test {'accuracy' if metric == 'acc' else 'loss'}")
        ax.plot(epochs, [r[f"train_{metric}"] for r in rows], ".-", color="C1", lw=1, alpha=0.7,
                label=train_label)
    if target is not None:
        acc.axhline(target, color="gray", ls="--", lw=1, label=f"homework target {target:g}%")
    best = max(r["test_acc"] for r in rows)
    acc.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100),
            title=f"{title}: final {rows[-1]['test_acc']:.2f}%, best {best:.2f}%")
    loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss", ylim=(0, None))
    for ax in (acc, loss):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(epochs) == 1:  # one point: whole epochs on the axis, not a zoom around it
            ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.tight_layout()
    return fig


def plot_curve(out, rows, title, target=None):
    import matplotlib.pyplot as plt
    fig = curve_figure(rows, title, target)
    checkpoint.atomic_write(os.path.join(out, "curve.png"),
                            lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


class TensorBoardLog:
    """--tensorboard: each epoch's scalars in <out>/tb, at step = epoch number.  `purge_step`,
    the first epoch this process writes, drops what an earlier process wrote from there on."""
    TAGS = {"train_loss": "loss/train", "test_loss": "loss/test", "train_acc": "accuracy/train",
            "test_acc": "accuracy/test", "lr": "learning_rate", "images_per_s": "images_per_s",
            "mean_staleness": "staleness/mean", "max_staleness": "staleness/max"}

    def __init__(self, out, first_epoch):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=first_epoch)

    def add_row(self, row):
        for column, tag in self.TAGS.items():
            if row.get(column) is not None:
                self.writer.add_scalar(tag, row[column], row["epoch"])
        self.writer.flush()  # on disk now: a kill loses nothing already logged
