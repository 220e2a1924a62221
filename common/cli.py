"""Command line shared by every script, device choice, and the run's set-up."""
import argparse
import atexit
import datetime
import errno
import fcntl
import json
import os
import random
import socket
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import Interrupted, NonFiniteLoss, PeerLost, UserError
from .stopping import StopRequest


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def non_negative_float(text):
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except the uninformative None / False of optional flags."""

    def _get_help_string(self, action):
        if action.default in (None, False):
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
        from .outputs import tensorboard_missing
        why = tensorboard_missing()
        if why:
            parser.exit(2, f"error: {option_string}: {why}\n")
        setattr(namespace, self.dest, True)


def make_parser(description, script, **defaults):
    """The flags every script has; `defaults` sets the script's own recipe."""
    p = Parser(description=description, formatter_class=HelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data-dir", default="./data", help="folder holding the data set")
    d.add_argument("--download", action="store_true", help="download the data set into --data-dir")
    d.add_argument("--dummy", action="store_true", help="random data of the real shapes; no files")
    d.add_argument("--train-limit", type=positive_int, metavar="N",
                   help="use only N training samples, every class alike (a seeded subset)")
    d.add_argument("--test-limit", type=positive_int, metavar="N",
                   help="use only N test samples, every class alike (a seeded subset)")
    d.add_argument("--workers", type=int, default=min(8, len(os.sched_getaffinity(0))),
                   help="processes decoding image files (TinyImageNet, imagefolder)")

    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=positive_int, default=30, help="epochs to train")
    t.add_argument("--batch-size", type=positive_int, default=128, help="images per update")
    t.add_argument("--lr", type=non_negative_float, default=0.1, help="peak learning rate")
    t.add_argument("--momentum", type=non_negative_float, default=0.9,
                   help="SGD momentum (Nesterov)")
    t.add_argument("--weight-decay", type=non_negative_float, default=5e-4,
                   help="L2 on weights (not on BatchNorm or biases)")
    t.add_argument("--warmup-epochs", type=non_negative_float, default=1.0,
                   help="linear warm-up, then cosine decay to zero")
    t.add_argument("--label-smoothing", type=non_negative_float, default=0.1,
                   help="label smoothing of the training loss")
    t.add_argument("--seed", type=int, default=0,
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
    p.set_defaults(**defaults)
    return p


def add_workload_args(parser, *, dataset, arch, image_size_help=None):
    """--dataset, --arch, --image-size, --dropout: what trains on what."""
    from .data import DATASETS
    from .model import ARCHS
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default=dataset,
                   help="imagefolder: --data-dir holds train/<class>/* and val/<class>/* "
                        "(the ImageNet layout)")
    g.add_argument("--arch", choices=ARCHS, default=arch,
                   help="hw4: the handout's ResNet (Figures 1, 2); resnet18 / resnet50: "
                        "torchvision's (ResNet-50 v1.5)")
    g.add_argument("--image-size", type=positive_int, default=None,
                   help=image_size_help or "side of the training images (imagefolder: the crop, "
                        "default 224; cifar100/tinyimagenet: resized on the device, default native)")
    g.add_argument("--dropout", type=float, default=0.1,
                   help="dropout probability after conv1 (hw4 only, Figure 1)")
    return g


def precision_name(amp):
    """How the scripts compute: `--amp` means bf16 autocast with channels_last tensors."""
    return "bf16 autocast + channels_last" if amp else "fp32"


@dataclass
class Run:
    """Where a process runs and what it may write."""
    script: str
    out: str
    device: torch.device
    amp: bool
    rank: int = 0
    world_size: int = 1
    stop: StopRequest = field(default_factory=StopRequest)

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def precision(self):
        return precision_name(self.amp)

    def log(self, *parts):
        if self.is_main:
            print(*parts, flush=True)


def select_device(name, local_rank=0):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cpu_has_native_bf16():
    """AVX-512 BF16 or AMX: there bf16 autocast trains ~2x faster than fp32 (see
    BENCHMARKS.md); on other CPUs bf16 is emulated and slower, so fp32 stays the default."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_amp(device):
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_out_dir(out):
    """Create --out and prove it is writable before any training time is spent."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write there ({exc.strerror}); "
                        "choose a writable folder") from None


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
        try:
            os.remove(path)  # while still holding it: nobody can lock the old file meanwhile
        except OSError:
            pass
        os.close(fd)


def setup_run(args, script, rank=0, world_size=1, local_rank=0):
    device = select_device(args.device, local_rank)
    amp = default_amp(device) if args.amp is None else args.amp
    seed_everything(args.seed)
    if rank == 0 and not args.evaluate:
        prepare_out_dir(args.out)
        lock_out_dir(args.out)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        # --no-amp means strict fp32 (seed 001's FP32 training): no TF32 matmuls either.
        torch.backends.cuda.matmul.allow_tf32 = amp
        torch.backends.cudnn.allow_tf32 = amp
    run = Run(script, args.out, device, amp, rank, world_size)
    run.stop.install()  # from here on, SIGTERM/SIGINT ask the training loop to stop cleanly
    return run


def run_main(main):
    """Call `main()`; an expected failure becomes one line on stderr and its exit status.

    Exit statuses (see errors.py): 2 bad input, 3 non-finite loss -- permanent; 128 + signal
    after SIGTERM/SIGINT, 200 a rank was lost or never joined -- retryable: the same command
    resumes.
    """
    try:
        code = main()
    except (UserError, NonFiniteLoss, PeerLost, Interrupted) as exc:
        print(str(exc) if isinstance(exc, Interrupted) else f"error: {exc}", file=sys.stderr,
              flush=True)
        code = exc.exit_code
    sys.exit(code or 0)
