"""Turn SIGTERM / SIGINT into a request to stop after the current step -- or at once, where the
process has nothing to save and cannot reach the loop that polls.

A pod eviction, a PBS or Slurm walltime warning, torchrun stopping its workers and Ctrl-C all
send one of these.  The training loop polls `StopRequest.signum` between steps, writes a
checkpoint and exits with status 128 + signal, which operators read as "retry"; the same command
then resumes.

Python runs a signal handler only when the main thread is back in Python code, and a process
blocked in C++ (init_process_group waiting for ranks that never come) is not.  So the signal is
also written to a pipe (`signal.set_wakeup_fd`) that a watcher thread reads.  Inside
`waiting(...)` -- a phase that waits on other processes with nothing to checkpoint yet, such as
start-up -- the watcher ends the process at once with one line, and ends it as well when the
phase outlasts its time limit.  A second signal ends the process at once wherever it is.
"""
import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import Interrupted


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class _Phase:
    what: str
    deadline: float = None  # time.monotonic() past which the process ends
    expired: str = ""  # the line it ends with then
    expired_code: int = 1


class StopRequest:
    def __init__(self):
        self.signum = None
        self._phase = None  # a _Phase while the main thread waits on other processes
        self._signals = 0  # how many the watcher has seen
        self._wakeup = None  # the write end of the watcher's pipe
        self._stderr = 2  # where the watcher writes: a copy of stderr, made by `install`

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._wakeup = write
        self._stderr = os.dup(2)  # stays the real stderr while start-up holds fd 2 back
        threading.Thread(target=self._watch, args=(read,), name="stop-watcher", daemon=True).start()
        return self

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else None

    @contextmanager
    def waiting(self, what, limit=None, expired="", expired_code=1):
        """Run the block as a phase that waits on other processes: a signal ends the process at
        once (status 128 + signal), and so does the end of `limit` seconds (`expired_code`, the
        line `expired`).  Without `install` the block just runs."""
        if self.signum:  # asked to stop before this phase began: there is nothing to save yet
            raise Interrupted(f"stopped by {self.name} before {what}; nothing to save: run the "
                              "same command to resume", self.signum)
        deadline = None if limit is None else time.monotonic() + limit
        self._phase = _Phase(what, deadline, expired, expired_code)
        self._nudge()  # the watcher recomputes how long it may sleep
        try:
            yield
        finally:
            self._phase = None

    def _nudge(self):
        if self._wakeup is not None:
            try:
                os.write(self._wakeup, b"\0")  # 0 is no signal number
            except OSError:  # the pipe is full: the watcher wakes up anyway
                pass

    def _watch(self, read):
        while True:
            phase = self._phase
            sleep = None if phase is None or phase.deadline is None \
                else max(0.0, phase.deadline - time.monotonic())
            ready, _, _ = select.select([read], [], [], sleep)
            # every signal with a Python handler comes through the pipe (DataLoader's SIGCHLD
            # too); a 0 is `_nudge`
            signums = [b for b in os.read(read, 64) if b in STOP_SIGNALS] if ready else []
            phase = self._phase
            for signum in signums:
                self._signals += 1
                name = signal.Signals(signum).name
                if phase is not None:
                    self._exit_now(f"stopped by {name} while {phase.what}; nothing to save: run "
                                   "the same command to resume", 128 + signum)
                if self._signals > 1:
                    self._exit_now(f"stopped by a second {name}: exiting at once, without writing "
                                   "a checkpoint (the last one is kept); run the same command to "
                                   "resume", 128 + signum)
            if phase is not None and phase.deadline is not None \
                    and time.monotonic() >= phase.deadline and self._phase is phase:
                self._exit_now(phase.expired, phase.expired_code)

    def _exit_now(self, line, code):
        """End the process from the watcher thread: the main thread is blocked where no
        exception can reach it.  Written straight to the file descriptor: no lock the main
        thread may hold is needed."""
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 -- exiting regardless
            pass
        os.write(self._stderr, (line.rstrip("\n") + "\n").encode())
        os._exit(code)
