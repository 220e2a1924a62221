"""Turn SIGTERM / SIGINT into a request to stop after the current step.

A pod eviction, a PBS or Slurm walltime warning and Ctrl-C all send one of these.  The
training loop polls `StopRequest.signum` between steps, writes a checkpoint and exits with
status 128 + signal, which operators read as "retry"; the same command then resumes.  A
second Ctrl-C stops at once.
"""
import signal
import threading


class StopRequest:
    def __init__(self):
        self.signum = None

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: now

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else None
