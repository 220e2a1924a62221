"""Checkpoints: written aside and renamed into place, so a kill never leaves half a file."""
import os
import random

import numpy as np
import torch

from .errors import UserError

FORMAT = 1


def atomic_write(path, write):
    """Call `write(tmp_path)`, flush it to disk, then rename it over `path`."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def rng_state():
    """The generators' state at save time, kept for inspection: a resumed run does not need it,
    since every epoch's shuffling, augmentation and dropout are derived from (seed, epoch, rank)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
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
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load(path, *, script, arch):
    """Read a checkpoint of this script and architecture, or fail with one clear line."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise UserError(f"{path}: unreadable checkpoint ({exc.__class__.__name__}); "
                        "move it away or pass --fresh to start over") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path}: not a checkpoint of this project; use another --out or --fresh")
    if state["script"] != script or state["arch"] != arch:
        raise UserError(f"{path}: checkpoint of {state['script']} ({state['arch']}), not of "
                        f"{script} ({arch}); use another --out, or --fresh to overwrite it")
    return state


def unwrap(model):
    """The plain module inside DDP / torch.compile wrappers, for state_dicts."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)
