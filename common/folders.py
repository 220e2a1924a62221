"""The folders a run makes and claims: created (and taken away again if the run fails before
writing into them), and --out locked for one run at a time."""
import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import socket
import sys

from .run import UserError


def make_folders(path):
    """os.makedirs(path); the folders it created, deepest first, so that a run that fails
    before writing into them can take them away again (`remove_empty`)."""
    made, folder = [], os.path.abspath(path)
    while not os.path.exists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        remove_empty([f for f in made if os.path.isdir(f)])  # the deepest ones were not made
        raise
    return made


def remove_empty(folders):
    """os.rmdir each of `folders` (deepest first) until one is not empty."""
    with contextlib.suppress(OSError):
        for folder in folders:
            os.rmdir(folder)


def claim(out, fresh):
    """Create --out (removed at exit if still empty) and prove it writable; lock it; remove the
    NAME.tmp.PID files a run killed mid-write left; refuse results without their checkpoint."""
    try:
        atexit.register(remove_empty, make_folders(out))  # after the lock's release (LIFO)
        probe = os.path.join(out, f".write-test.{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write there ({exc.strerror}); "
                        "choose a writable folder") from None
    lock(out)
    for name in os.listdir(out):
        if re.fullmatch(r".+\.tmp\.\d+", name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, name))
    if not fresh and os.path.exists(os.path.join(out, "metrics.csv")) \
            and not os.path.exists(os.path.join(out, "checkpoint.pt")):
        raise UserError(f"--out {out}: holds metrics.csv but no checkpoint.pt to resume from; "
                        "pass --fresh to overwrite those results, or choose another --out")


_held_locks = {}  # real path of a held lock file -> its open descriptor (held until exit)


def lock(out):
    """One run per --out: an advisory lock (flock) on --out/.lock while this process lives.  The
    kernel drops it when the process ends, however it ends, so a killed run never blocks the
    next; the holder writes its host, pid and start time there, for the next to name it."""
    path = os.path.realpath(os.path.join(out, ".lock"))
    if path in _held_locks:
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"--out {out} is in use by another run ({holder}); wait for it to "
                                "end or stop it, or choose another --out") from None
            print(f"note: --out {out}: cannot lock .lock ({exc.strerror}); make sure no other "
                  "run trains into it", file=sys.stderr, flush=True)
            return
        with contextlib.suppress(FileNotFoundError):  # the last holder may have removed it
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # between our open and our lock
                break
        os.close(fd)
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "since": since}).encode() + b"\n", 0)
    _held_locks[path] = fd
    atexit.register(release_lock, path)


def read_holder(fd):
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: it is starting"


def release_lock(path):
    fd = _held_locks.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):  # removed while still held: nobody locks it meanwhile
            os.remove(path)
        os.close(fd)
