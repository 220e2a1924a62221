"""This run's process: its device, precision and seeds, how signals stop it, and its exit status.

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


class UserError(Exception):
    """Bad input or environment: the message names the path or flag and the fix."""
    exit_code = 2


class NonFiniteLoss(Exception):
    """The loss became NaN or inf; the last good checkpoint is kept."""
    exit_code = 3


class PeerLost(Exception):
    """Another rank died, stopped answering within --timeout, or never joined at start-up.
    Retryable: once every rank runs again the same command resumes from the checkpoint.  200
    lies above 128 + any signal number, so it is never mistaken for "killed by a signal"."""
    exit_code = 200


class Interrupted(Exception):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.exit_code = 128 + signum


def execute(main):
    """Call `main()`; an expected failure becomes one line on stderr and its exit status."""
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


def resume_hint(args):
    """How to go on from the checkpoint this run wrote: with --fresh, the same command would
    start over."""
    return f"run the same command{' without --fresh' * bool(args.fresh)} to resume"


# SIGUSR1 too: Open MPI's mpirun forwards it to every rank, where a Ctrl-C (SIGINT) to mpirun
# becomes a SIGTERM that a SIGKILL follows within a quarter of a second; Slurm's --signal too.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """SIGTERM / SIGINT / SIGUSR1 (a pod eviction, a walltime warning, torchrun, Ctrl-C) as a
    request to stop after the current step: the loops poll `signum`, write a checkpoint and exit
    with 128 + signal.  A process blocked in C++ (start-up waiting for the other ranks) runs no
    Python handler, so the signal also wakes a watcher thread (`signal.set_wakeup_fd`): inside
    `waiting(...)`, where there is nothing to save yet, it ends the process at once, and also
    when that phase outlasts its limit.  A second signal ends the process at once anywhere."""

    def __init__(self):
        self.signum, self.phase, self.seen, self.wakeup = None, None, 0, None

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
        read, self.wakeup = os.pipe()
        os.set_blocking(self.wakeup, False)
        signal.set_wakeup_fd(self.wakeup, warn_on_full_buffer=False)
        self.stderr = os.dup(2)  # stays the real stderr while start-up holds fd 2 back
        threading.Thread(target=self.watch, args=(read,), daemon=True).start()

    def handle(self, signum, frame):
        self.signum = self.signum or signum

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else None

    @contextmanager
    def waiting(self, what, limit, expired, expired_code):
        """Run the block as a phase that waits on other processes: a signal ends the process at
        once (128 + signal), and so does the end of `limit` seconds (the line `expired`)."""
        if self.signum:  # asked to stop before this phase began: there is nothing to save yet
            raise Interrupted(f"stopped by {self.name} before {what}; nothing to save: run the "
                              "same command to resume", self.signum)
        self.phase = (what, time.monotonic() + limit, expired, expired_code)
        if self.wakeup is not None:  # the watcher recomputes how long it may sleep
            with suppress(OSError):  # the pipe is full: it wakes up anyway
                os.write(self.wakeup, b"\0")  # 0 is no signal number
        try:
            yield
        finally:
            self.phase = None

    def watch(self, read):
        while True:
            phase = self.phase
            sleep = None if phase is None else max(0.0, phase[1] - time.monotonic())
            ready, _, _ = select.select([read], [], [], sleep)
            # every signal with a Python handler comes through the pipe (DataLoader's SIGCHLD too)
            signums = [b for b in os.read(read, 64) if b in STOP_SIGNALS] if ready else []
            phase = self.phase
            for signum in signums:
                self.seen += 1
                name = signal.Signals(signum).name
                if phase is not None:
                    self.exit_now(f"stopped by {name} while {phase[0]}; nothing to save: run "
                                  "the same command to resume", 128 + signum)
                if self.seen > 1:
                    self.exit_now(f"stopped by a second {name}: exiting at once, without writing "
                                  "a checkpoint (the last one is kept); run the same command to "
                                  "resume", 128 + signum)
            if phase is not None and time.monotonic() >= phase[1] and self.phase is phase:
                self.exit_now(phase[2], phase[3])

    def exit_now(self, line, code):
        """End the process from the watcher thread, written straight to the file descriptor:
        the main thread is blocked where no exception reaches it, maybe holding stderr's lock."""
        with suppress(Exception):
            sys.stdout.flush()
        os.write(self.stderr, (line.rstrip("\n") + "\n").encode())
        os._exit(code)


def precision_name(amp):
    """How the scripts compute: `--amp` means bf16 autocast with channels_last tensors."""
    return "bf16 autocast + channels_last" if amp else "fp32"


@dataclass
class Run:
    """This process of a run: its script, rank, device and precision, where it writes, and its
    stop request.  Only the main rank (0) writes files and logs."""
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


def default_amp(device):
    """bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX: there it trains about 2x
    faster than fp32); elsewhere bf16 is emulated and slower, so fp32."""
    if device.type == "cuda":
        return True
    with suppress(OSError), open("/proc/cpuinfo") as f:
        flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False  # no /proc/cpuinfo: not Linux


def start_run(args, script, rank=0, world_size=1, local_rank=0):
    """Choose the device and precision, seed the generators, and let SIGTERM/SIGINT ask the
    training loop to stop cleanly.  Rank r seeds with --seed + r: its dropout masks and (until
    the broadcast) its initial weights are its own; the data order comes from --seed alone."""
    device = select_device(args.device, local_rank)
    amp = default_amp(device) if args.amp is None else args.amp
    random.seed(args.seed + rank)
    np.random.seed((args.seed + rank) % 2**32)
    torch.manual_seed(args.seed + rank)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        # --no-amp means strict fp32: no TF32 matmuls either.
        torch.backends.cuda.matmul.allow_tf32 = amp
        torch.backends.cudnn.allow_tf32 = amp
    run = Run(script, args.out, device, amp, rank, world_size)
    run.stop.install()
    return run
