"""This process: its device and precision, its seeds, how signals stop it, its exit status, and
the folders it made (removed again if it fails before writing into them).

Over 250 lines because signals need a watcher thread (`StopRequest`): a process blocked in C++
(init_process_group waiting for ranks that never come) does not run Python signal handlers.

Exit statuses follow Kubeflow's `restartPolicy: ExitCode`: 1-127 are permanent failures
(retrying cannot help), 128-255 are retryable (the same command resumes from the checkpoint).
"""
import os
import random
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np
import torch


# ------------------------------------------------------------------------------ exit statuses

class UserError(Exception):
    """Bad input or environment: the message names the path or flag and the fix."""
    exit_code = 2


class NonFiniteLoss(Exception):
    """The loss became NaN or inf; the last good checkpoint is kept."""
    exit_code = 3


class PeerLost(Exception):
    """Another rank died, stopped answering within --timeout, or never joined at start-up.

    Retryable: once every rank runs again (torchrun's restart, the operator's, a resubmitted
    job) the same command resumes from the checkpoint.  200 lies above 128 + any signal number
    (at most 192), so it is never mistaken for "killed by a signal"."""
    exit_code = 200


class Interrupted(Exception):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.exit_code = 128 + signum


def execute(main):
    """Call `main()`; an expected failure becomes one line on stderr and its exit status:
    2 bad input, 3 non-finite loss (permanent); 128 + signal after SIGTERM/SIGINT, 200 a rank
    was lost or never joined (retryable: the same command resumes)."""
    try:
        code = main()
    except (UserError, NonFiniteLoss, PeerLost, Interrupted) as exc:
        message = str(exc)
        if "\nOriginal Traceback" in message:  # raised in a DataLoader worker: its line is last
            message = message.rstrip().splitlines()[-1].split("Error: ", 1)[-1]
        # One line even where the message quotes a library's multi-line text (pickle's, say).
        text = " ".join(part.strip() for part in message.splitlines() if part.strip())
        print(text if isinstance(exc, Interrupted) else f"error: {text}", file=sys.stderr,
              flush=True)
        code = exc.exit_code
        if isinstance(exc, (UserError, NonFiniteLoss)):
            abort_mpi_job(code)
    sys.exit(code or 0)


def abort_mpi_job(code):
    """Under mpirun, end every rank with this permanent status (MPI_Abort): Open MPI would
    otherwise leave the others waiting out --timeout, then report their retryable 200, which an
    MPIJob restarts for ever."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(code)


# ------------------------------------------------------------------------------------ signals

# SIGUSR1 too: Open MPI's mpirun forwards it to every rank, where a Ctrl-C (SIGINT) to mpirun
# becomes a SIGTERM that a SIGKILL follows within a quarter of a second; Slurm's --signal too.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@dataclass
class _Phase:
    what: str
    deadline: float = None  # time.monotonic() past which the process ends
    expired: str = ""  # the line it ends with then
    expired_code: int = 1


class StopRequest:
    """SIGTERM / SIGINT / SIGUSR1 as a request to stop after the current step -- or at once,
    where the process has nothing to save and cannot reach the loop that polls.

    A pod eviction, a PBS or Slurm walltime warning, torchrun stopping its workers, Ctrl-C and
    `kill -USR1 <mpirun's pid>` all send one of these.  The training loop polls `signum`
    between steps, writes a checkpoint and exits with status 128 + signal.  The signal is also
    written to a pipe (`signal.set_wakeup_fd`) that a watcher thread reads: inside
    `waiting(...)`, a phase that waits on other processes with nothing to save yet (start-up),
    the watcher ends the process at once with one line, and ends it as well when the phase
    outlasts its time limit.  A second signal ends the process at once wherever it is.
    """

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


# ---------------------------------------------------------------- the folders it made

def make_folders(path):
    """os.makedirs(path); the folders it created, deepest first (none if `path` existed), so
    that a run that fails before writing into them can take them away again (remove_empty).
    If making them fails part of the way, those made so far are taken away before it raises."""
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
    with suppress(OSError):
        for folder in folders:
            os.rmdir(folder)


# ------------------------------------------------------------- device, precision and seeds

def precision_name(amp):
    """How the scripts compute: `--amp` means bf16 autocast with channels_last tensors."""
    return "bf16 autocast + channels_last" if amp else "fp32"


@dataclass
class Process:
    """This process: its script, rank, device and precision, where it writes, and its stop
    request.  Only the main rank (0) writes files and logs."""
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

    def autocast(self):
        """bf16 autocast where --amp (the default on CUDA and CPUs with native bf16)."""
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                              enabled=self.amp)

    def prepare(self, model):
        """The model on this device, channels_last with --amp (what bf16 convolutions want)."""
        model = model.to(self.device)
        return model.to(memory_format=torch.channels_last) if self.amp else model

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


def start(args, script, rank=0, world_size=1, local_rank=0):
    """Choose the device and precision, seed the generators, and let SIGTERM/SIGINT ask the
    training loop to stop cleanly.

    Rank r seeds with --seed + r: its dropout masks and (until the broadcast) its initial
    weights are its own; the data order comes from --seed alone, so that the shards fit."""
    device = select_device(args.device, local_rank)
    amp = default_amp(device) if args.amp is None else args.amp
    seed_everything(args.seed + rank)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        # --no-amp means strict fp32 (seed 001's FP32 training): no TF32 matmuls either.
        torch.backends.cuda.matmul.allow_tf32 = amp
        torch.backends.cudnn.allow_tf32 = amp
    proc = Process(script, args.out, device, amp, rank, world_size)
    proc.stop.install()
    return proc
