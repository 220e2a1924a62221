"""checkpoint.pt: everything a run needs to go on, written aside and renamed into place (a kill
never leaves half a file), and holding only tensors, numbers, strings, None and lists, tuples and
dicts of them, so that it is read with torch.load(weights_only=True): a checkpoint found in --out
(a shared folder, a run someone sent) cannot run code.  A run resumes it only with the recipe it
was made with (the flags a resumed run, --evaluate or another rank may change stand below)."""
import collections
import os
import pickle
import warnings
from dataclasses import dataclass, field

import torch

from .run import UserError

FORMAT = 2
KEYS = ("script", "arch", "epoch", "model", "optimizer", "scheduler", "rows", "args", "extra")
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


def check_plain(value, where="checkpoint"):
    """Raise TypeError if `value` holds anything torch.load(weights_only=True) refuses: a new
    field of another type fails at its first save, not at the next resume.  (Exact types:
    numpy's float64 is a float subclass, but pickles as a numpy object.)"""
    if type(value) in PLAIN_CONTAINERS:
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            check_plain(key, where)
            check_plain(item, f"{where}[{key!r}]")
    elif type(value) not in PLAIN_LEAVES and not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}: "
                        "a checkpoint holds only tensors, numbers, strings, None, lists, "
                        "tuples and dicts")


def load_plain(path):
    """torch.load of a path or file with weights_only=True: plain data, never code."""
    with warnings.catch_warnings():  # torch's notes on odd files would break the one line
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def load(path, *, script, arch):
    """Read a checkpoint of this script and architecture, or fail with one clear line."""
    try:
        state = load_plain(path)
    except pickle.UnpicklingError:  # what weights_only raises for anything but plain data
        raise UserError(f"{path}: refused to load: it holds objects that could run code (a "
                        "crafted file, or a checkpoint of an older version of these scripts); "
                        "pass --fresh to start over, or use another --out") from None
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


def save(path, *, script, arch, model, optimizer, scheduler, epoch, rows, args, extra=None):
    """Everything needed to continue after `epoch` completed epochs."""
    state = {"format": FORMAT, "script": script, "arch": arch, "epoch": epoch,
             "model": model.state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rows": rows, "args": args, "extra": extra or {}}
    check_plain(state)
    atomic_write(path, lambda tmp: torch.save(state, tmp))


@dataclass
class State:
    """What a run has done: the epochs completed, their metrics.csv rows, the progress inside
    an epoch a signal interrupted, and what a script keeps of its own (`extra`)."""
    epoch: int = 0
    rows: list = field(default_factory=list)
    partial: dict = None
    extra: dict = field(default_factory=dict)

    def take_partial(self):
        """The interrupted epoch's progress, once: the epochs after it start from step 0."""
        partial, self.partial = self.partial, None
        return partial


# What a resumed run may change: where and how it runs, not what it computes. A larger --epochs
# goes on along the longer schedule.  --evaluate needs only the data its network was made for.
RUN_FLAGS = {"data_dir", "download", "workers", "epochs", "out", "device", "amp", "fresh",
             "evaluate", "tensorboard", "backend", "timeout", "straggler_delay", "weights",
             "no_pretrained"}
EVALUATED_WITH = {"dataset", "image_size"}
# What the ranks of one run may be given differently: a host's own data folder, say.
RANK_FLAGS = RUN_FLAGS - {"epochs", "evaluate"}


def recipe_difference(theirs, ours, names):
    """The first of the flags `names` whose value in `theirs` differs from `ours` (dicts of
    flags), as "--name", theirs, ours; or None.  Flags one of them lacks are not compared."""
    for name in sorted(set(names) & set(theirs) & set(ours)):
        if theirs[name] != ours[name]:
            then, now = ("unset" if v is None else v for v in (theirs[name], ours[name]))
            return f"--{name.replace('_', '-')}", then, now
    return None


def check_same_recipe(path, saved, args):
    """Refuse, in one line, the checkpoint `path` of a run (its flags `saved`) whose recipe
    differs from this command's (`args`, a dict); with --evaluate, only its data."""
    differ = recipe_difference(saved, args, EVALUATED_WITH if args.get("evaluate")
                               else set(args) - RUN_FLAGS)
    if differ:
        raise UserError(f"{path}: {differ[0]} was {differ[1]} in that run, here {differ[2]}; "
                        "resume with that run's flags, or start over with --fresh (or another "
                        "--out)")


def resume(path, args, run, model, optimizer, scheduler, comm=None):
    """The State of the checkpoint at `path`, loaded into the model, optimizer and schedule on
    every rank (the main rank reads it); an empty State where there is none, or with --fresh."""
    state, error = None, None
    if run.is_main and os.path.exists(path) and not args.fresh:
        try:
            state = load(path, script=run.script, arch=args.arch)
            check_same_recipe(path, state["args"], vars(args))
            world = state["extra"].get("world_size", run.world_size)
            if world != run.world_size and not args.evaluate:
                raise UserError(f"{path}: that run had {world} processes, this one has "
                                f"{run.world_size} (its shards and per-rank batch, or workers, "
                                f"depend on it); resume with {world}, or start over with "
                                "--fresh (or another --out)")
        except UserError as exc:  # tell the other ranks too, rather than leave them waiting
            error = str(exc)
    elif run.is_main and args.evaluate:  # (the other ranks' --out may be another disk)
        error = f"--evaluate: no checkpoint at {path}; train first, or point --out at a run"
    if comm is not None:
        state, error = comm.broadcast_state((state, error))
    if error:
        raise UserError(error)
    if state is None:
        return State()
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:  # this command's schedule (a larger --epochs) at the step
        # reached: step onto that step again, so that the next batch uses its LR
        scheduler.load_state_dict(state["scheduler"])
        scheduler.last_epoch -= 1
        scheduler.step()
    extra = state["extra"]
    resumed = State(state["epoch"], state["rows"], extra.pop("partial", None), extra)
    where = f"epoch {resumed.epoch}" + (f" and step {resumed.partial['step']} of epoch "
                                        f"{resumed.epoch + 1}" if resumed.partial else "")
    run.log(f"resumed from {path} after {where}")
    return resumed
