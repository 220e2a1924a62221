"""Checkpoints: written aside and renamed into place, so a kill never leaves half a file.

A checkpoint holds only tensors, numbers, strings, None and lists, tuples and dicts of them, so
it is read with `torch.load(weights_only=True)`: a `checkpoint.pt` found in --out (a shared
folder, a run someone sent) cannot run code.  `python -m common.checkpoint convert PATH`
rewrites a trusted checkpoint of format 1 (which held numpy's RNG state as an ndarray).

Over 250 lines because the format's writer (every output file uses its atomic write), its
code-free reader, the resume of a run from it and the converter of the old format must agree.
"""
import collections
import os
import pickle
import random
import shlex
import shutil
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .flags import check_same_recipe
from .process import UserError

FORMAT = 2  # 1: numpy's RNG state kept as numpy's own tuple (an ndarray inside)
KEYS = ("script", "arch", "epoch", "model", "optimizer", "scheduler", "rows", "args", "rng",
        "extra")
PLAIN_LEAVES = (str, int, float, bool, type(None))
PLAIN_CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def atomic_write(path, write):
    """Call `write(tmp_path)`, flush it to disk, then rename it over `path`."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # a full disk (torch's writer raises RuntimeError)
        if isinstance(exc, RuntimeError) and "writ" not in str(exc) and "pos" not in str(exc):
            raise
        why = getattr(exc, "strerror", None) or f"{exc}: is the disk full?"
        raise UserError(f"{path}: could not be written ({why}); the previous one is kept: free "
                        "space or choose another --out") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def rng_state():
    """The generators' state at save time, kept for inspection: a resumed run does not need it,
    since every epoch's shuffling, augmentation and dropout are derived from (seed, epoch, rank)."""
    state = {"torch": torch.get_rng_state(), "numpy": numpy_rng_state(np.random.get_state()),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(path, *, script, arch, model, optimizer, scheduler, epoch, rows, args, extra=None):
    """Everything needed to continue after `epoch` completed epochs."""
    state = {
        "format": FORMAT, "script": script, "arch": arch, "epoch": epoch,
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rows": rows, "args": args, "rng": rng_state(), "extra": extra or {},
    }
    check_plain(state)
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def numpy_rng_state(state):
    """numpy's `(name, keys, pos, has_gauss, cached_gaussian)` in types weights_only accepts;
    `np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"],
    s["has_gauss"], s["cached_gaussian"]))` restores it."""
    name, keys, pos, has_gauss, cached_gaussian = state
    return {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian)}


def check_plain(value, where="checkpoint"):
    """Raise TypeError if `value` holds anything torch.load(weights_only=True) refuses: a new
    field of another type fails at its first save, not at the next resume.  (Exact types:
    numpy's float64 is a float subclass, but pickles as a numpy object.)"""
    if type(value) in PLAIN_CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            check_plain(key, where)
            check_plain(item, f"{where}[{key!r}]")
    elif type(value) not in PLAIN_LEAVES and not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}: "
                        "a checkpoint holds only tensors, numbers, strings, None, lists, "
                        "tuples and dicts")


def load_plain(path):
    """torch.load of a path or file with weights_only=True: tensors, numbers, strings and
    containers, no code."""
    with warnings.catch_warnings():  # torch's notes on odd files would break the one line
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def load(path, *, script, arch):
    """Read a checkpoint of this script and architecture, or fail with one clear line."""
    try:
        state = load_plain(path)
    except pickle.UnpicklingError:  # what weights_only raises for anything but plain data
        raise UserError(
            f"{path}: refused to load: it holds objects that could run code (a checkpoint in "
            "this project's older format, or a crafted file); pass --fresh to start over, or, "
            "only if you trust the file, convert it once from the repository's folder: "
            f"python -m common.checkpoint convert {shlex.quote(os.path.abspath(path))}"
        ) from None
    except Exception as exc:
        raise UserError(f"{path}: unreadable checkpoint ({exc.__class__.__name__}); "
                        "move it away or pass --fresh to start over") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT \
            or any(key not in state for key in KEYS):
        raise UserError(f"{path}: not a checkpoint of this project; use another --out or --fresh")
    if state["script"] != script or state["arch"] != arch:
        raise UserError(f"{path}: checkpoint of {state['script']} ({state['arch']}), not of "
                        f"{script} ({arch}); use another --out, or --fresh to overwrite it")
    return state


@dataclass
class State:
    """What a run has done: the epochs completed, their metrics.csv rows, the progress inside
    an epoch a signal interrupted, and what a script keeps of its own (`extra`)."""
    epoch: int = 0
    rows: list = field(default_factory=list)
    partial: dict = None
    extra: dict = field(default_factory=dict)

    def take_partial(self):
        """The interrupted epoch's progress, once: the epochs after it start from their first
        step."""
        partial, self.partial = self.partial, None
        return partial

    def add(self, row):
        self.rows.append(row)
        self.epoch = row["epoch"]


class Checkpoint:
    """--out/checkpoint.pt: the model, optimizer and LR schedule of a run, with its `State`.

    Only the main rank reads and writes it; `resume` hands what it read to every rank."""

    def __init__(self, args, proc, model, optimizer, scheduler, comm=None):
        self.path = os.path.join(args.out, "checkpoint.pt")
        self.args, self.proc, self.comm = args, proc, comm
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def exists(self):
        """Will `resume` read a checkpoint?  (Not with --fresh.)"""
        return os.path.exists(self.path) and not self.args.fresh

    def resume(self):
        """The State of the checkpoint in --out, loaded into the model, optimizer and schedule;
        an empty State where there is none (or with --fresh)."""
        state, error = None, None
        if self.proc.is_main and self.exists():
            try:
                state = load(self.path, script=self.proc.script, arch=self.args.arch)
                check_same_recipe(self.path, state["args"], vars(self.args))
                world = (state.get("extra") or {}).get("world_size", self.proc.world_size)
                if world != self.proc.world_size and not self.args.evaluate:
                    raise UserError(f"{self.path}: that run had {world} processes, this one has "
                                    f"{self.proc.world_size} (its shards and per-rank batch, or "
                                    f"workers, depend on it); resume with {world}, or start "
                                    "over with --fresh (or another --out)")
            except UserError as exc:  # tell the other ranks too, rather than leave them waiting
                error = str(exc)
        if self.comm is not None:
            state, error = self.comm.broadcast_state((state, error))
        if error:
            raise UserError(error)
        if state is None:
            return State()
        unwrap(self.model).load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:  # this command's schedule (a larger --epochs) at the
            # step reached: step onto that step again, so that the next batch uses its LR
            self.scheduler.load_state_dict(state["scheduler"])
            self.scheduler.last_epoch -= 1
            self.scheduler.step()
        extra = state.get("extra") or {}
        resumed = State(state["epoch"], state["rows"], extra.pop("partial", None), extra)
        where = f"epoch {resumed.epoch}" + (f" and step {resumed.partial['step']} of epoch "
                                            f"{resumed.epoch + 1}" if resumed.partial else "")
        self.proc.log(f"resumed from {self.path} after {where}")
        return resumed

    def save(self, state, partial=None):
        """Write the state (and an interrupted epoch's `partial` progress) on the main rank."""
        if not self.proc.is_main:
            return
        extra = dict(state.extra, world_size=self.proc.world_size,
                     **({"partial": partial} if partial else {}))
        save(self.path, script=self.proc.script, arch=self.args.arch, model=self.model,
             optimizer=self.optimizer, scheduler=self.scheduler, epoch=state.epoch,
             rows=state.rows, args=vars(self.args), extra=extra)


def unwrap(model):
    """The plain module inside DDP / torch.compile wrappers, for state_dicts."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def convert(path):
    """Rewrite a format-1 checkpoint in the current format, keeping the original as PATH.bak.

    Only on the user's explicit request, for a file they trust: the old format can be read
    only with weights_only=False, which runs whatever code the file holds.
    """
    backup = path + ".bak"
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such checkpoint")
    try:
        state = load_plain(path)
        if isinstance(state, dict) and state.get("format") == FORMAT:
            print(f"{path}: already in checkpoint format {FORMAT}; nothing to convert")
            return
    except Exception:
        pass  # not readable safely: the old format (or not a checkpoint); read it as trusted
    if os.path.exists(backup):
        raise UserError(f"{backup} already exists; move it away, then convert again")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise UserError(f"{path}: unreadable checkpoint ({exc.__class__.__name__}); "
                        "nothing converted") from None
    if not isinstance(state, dict) or state.get("format") != 1 \
            or any(key not in state for key in KEYS):
        raise UserError(f"{path}: not a checkpoint of this project (format 1); nothing converted")
    try:
        state["rng"]["numpy"] = numpy_rng_state(state["rng"]["numpy"])
        state["format"] = FORMAT
        check_plain(state)
    except (TypeError, ValueError, KeyError) as exc:
        raise UserError(f"{path}: cannot convert it ({exc}); nothing converted") from None

    def write_and_verify(tmp):
        torch.save(state, tmp)
        load_plain(tmp)

    atomic_write(backup, lambda tmp: shutil.copyfile(path, tmp))
    atomic_write(path, write_and_verify)
    print(f"{path}: converted to checkpoint format {FORMAT}; the original is kept as {backup}")


def main(argv=None):
    from .flags import Parser
    parser = Parser(prog="python -m common.checkpoint",
                    description="Tools for checkpoint.pt files of the HW4 scripts.")
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("convert", help="rewrite a trusted checkpoint of the older format "
                            "(1) so that it loads without running code; keeps PATH.bak")
    c.add_argument("path", metavar="PATH", help="the checkpoint.pt to convert")
    args = parser.parse_args(argv)
    convert(args.path)


if __name__ == "__main__":
    from .process import execute
    execute(main)
