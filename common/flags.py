"""The command-line flags every script shares; each main sets its recipe as their defaults."""
import argparse
import math
import os


def number(kind, low, high=math.inf, *, low_open=False, what=""):
    """An argparse type: a `kind` (int or float) from `low` (excluded if `low_open`) to below
    `high`; nan is refused."""
    def parse(text):
        value = kind(text)
        if not ((low < value) if low_open else (low <= value)) or not value < high:
            raise argparse.ArgumentTypeError(f"must be {what}, not {text}")
        return value
    return parse


positive_int = number(int, 1, what="a positive integer")
non_negative_int = number(int, 0, what="0 or more")
seed = number(int, 0, 2**32, what=f"from 0 to {2**32 - 1}")  # numpy's range: one for all
non_negative_float = number(float, 0, what="a finite number >= 0")
positive_float = number(float, 0, low_open=True, what="a finite number > 0")
fraction = number(float, 0, 1, what="at least 0 and below 1")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description (a script's docstring) laid out as written, and each flag's default
    shown, except the uninformative None / False of optional flags (a default of 0 is shown)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (and exit status 2), not a usage dump."""

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


class TensorBoardFlag(argparse.Action):
    """A store-true flag that exits (status 2, one line) while the arguments are parsed, on
    every rank, when the tensorboard package is missing: before any training."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as exc:
            parser.exit(2, f"error: {option_string}: the tensorboard package is not importable "
                           f"({exc}); pip install tensorboard\n")
        setattr(namespace, self.dest, True)


def make_parser(description, script, recipe, *, dataset, arch):
    """A parser with every shared flag; `recipe` (epochs, batch_size, lr, ...) sets the script's
    defaults, `dataset` and `arch` what it trains by default."""
    from .data import DATASETS
    from .model import ARCHS
    p = Parser(description=description, formatter_class=HelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data-dir", default="./data", help="folder holding the data set")
    d.add_argument("--download", action="store_true", help="download the data set into --data-dir")
    d.add_argument("--dummy", action="store_true", help="random data of the real shapes; no files")
    d.add_argument("--train-limit", type=positive_int, metavar="N",
                   help="use only N training samples, every class alike (a seeded subset)")
    d.add_argument("--test-limit", type=positive_int, metavar="N",
                   help="use only N test samples, every class alike (a seeded subset)")
    d.add_argument("--workers", type=non_negative_int,
                   default=min(8, len(os.sched_getaffinity(0))),
                   help="processes decoding image files (TinyImageNet, imagefolder)")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default=dataset,
                   help="imagefolder: --data-dir holds train/<class>/* and val/<class>/* "
                        "(the ImageNet layout)")
    w.add_argument("--arch", choices=ARCHS, default=arch,
                   help="hw4: the handout's ResNet (Figures 1, 2); resnet18 / resnet50: "
                        "torchvision's (ResNet-50 v1.5)")
    w.add_argument("--image-size", type=positive_int, default=None,
                   help="side of the training images (imagefolder: the crop, 224 when unset; "
                        "cifar100/tinyimagenet: resized to it on the device, native when "
                        "unset)")
    w.add_argument("--dropout", type=fraction, default=0.1,
                   help="dropout probability after conv1 (hw4 only, Figure 1)")

    t = p.add_argument_group("training (the recipe)")
    t.add_argument("--epochs", type=positive_int, help="epochs to train")
    t.add_argument("--batch-size", type=positive_int, help="images per update")
    t.add_argument("--lr", type=non_negative_float, help="peak learning rate")
    t.add_argument("--momentum", type=fraction, help="SGD momentum (Nesterov)")
    t.add_argument("--weight-decay", type=non_negative_float,
                   help="L2 on weights (not on BatchNorm or biases)")
    t.add_argument("--warmup-epochs", type=non_negative_float,
                   help="linear warm-up, then cosine decay to zero")
    t.add_argument("--label-smoothing", type=fraction,
                   help="label smoothing of the training loss")
    t.add_argument("--auto-augment", choices=["none", "ta_wide"], default="none",
                   help="ta_wide: TrivialAugment (torchvision's TrivialAugmentWide) on the "
                        "training images, after the crop and flip")
    t.add_argument("--seed", type=seed, default=0,
                   help="seeds model init, shuffling, augmentation and dropout")

    r = p.add_argument_group("run")
    r.add_argument("--out", default=os.path.join("runs", script),
                   help="output folder: config.json, metrics.csv, curve.png, checkpoint.pt")
    r.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when present")
    r.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast + channels_last; --no-amp: strict fp32 (no TF32 either). "
                        "default: on with CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX)")
    r.add_argument("--fresh", action="store_true",
                   help="start over even if --out holds a checkpoint (without it: resume)")
    r.add_argument("--evaluate", action="store_true",
                   help="only evaluate the checkpoint in --out on the test set")
    r.add_argument("--tensorboard", action=TensorBoardFlag,
                   help="also write each epoch's scalars to --out/tb (needs: pip install "
                        "tensorboard)")
    p.set_defaults(**recipe)
    return p


def add_distributed_flags(parser, backends=("auto", "gloo", "nccl", "mpi")):
    g = parser.add_argument_group("distributed")
    g.add_argument("--backend", choices=backends, default=backends[0],
                   help="torch.distributed backend (auto: nccl on CUDA, else gloo)")
    g.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds a collective may wait for the other ranks before failing")
    g.add_argument("--straggler-delay", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="make rank 1 sleep this long at each step (a slow rank)")
