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


def plot_curve(out, rows, title, target=None):
    """curve.png: test accuracy per epoch (train accuracy beside it, the target as a line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    ax.plot(epochs, [r["test_acc"] for r in rows], "o-", lw=2, ms=3, label="test accuracy")
    if all(r.get("train_acc") is not None for r in rows):
        ax.plot(epochs, [r["train_acc"] for r in rows], "-", lw=1, alpha=0.7,
                label="train accuracy (augmented)")
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"homework target {target:g}%")
    best = max(r["test_acc"] for r in rows)
    ax.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100),
           title=f"{title}: final {rows[-1]['test_acc']:.2f}%, best {best:.2f}%")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    atomic_write(os.path.join(out, "curve.png"), lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
