"""Running the scripts as the fault tests do: small runs on the generated set, each started as a
user would (`run`, `start`), the files they leave (`rows`, `state`, `digest`), and faults put in
by environment variables (`with_faults`)."""
import hashlib
import os
import subprocess
import sys
import time

import torch

from helpers import ROOT, child_env

TIMEOUT = 240


def cmd(script, data_dir, out, *extra):
    return [sys.executable, script, "--data-dir", str(data_dir), "--out", str(out),
            "--device", "cpu", "--train-limit", "96", "--test-limit", "32",
            "--batch-size", "16", "--epochs", "2", *extra]


def run(args, **env):
    return subprocess.run(args, cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=TIMEOUT)


def start(args, **env):
    return subprocess.Popen(args, cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout=TIMEOUT, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def cpu_seconds(pid):
    """The CPU time a live process has used (user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(process, quiet=3.0, what="the process to wait"):
    """Until `process` has used almost no CPU for `quiet` seconds: it waits in a receive.  (A
    fixed sleep guessed how long its part takes, and a loaded CI machine took longer.)"""
    deadline, since, used = time.time() + TIMEOUT, time.time(), cpu_seconds(process.pid)
    while time.time() - since < quiet:
        assert process.poll() is None, f"the process ended while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
        now = cpu_seconds(process.pid)
        if now - used > 0.05:  # still computing
            since, used = time.time(), now


def rows(out):
    path = os.path.join(out, "metrics.csv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()[1:]


def digest(folder):
    """sha1 of every file in a folder: proof that nothing was overwritten."""
    result = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            result[name] = hashlib.sha1(f.read()).hexdigest()
    return result


def state(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)


def one_error_line(result, *words):
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# A `python -c` program that runs the script named by its first argument with faults put in by
# environment variables, on the rank FAULT_RANK only (default 0): after step STOP_STEP of an
# epoch, a SIGTERM to itself; after the update of the run's NAN_STEP-th step, a NaN weight; at
# step BAD_LOSS_STEP, a NaN loss counted (this rank's alone: the update is not touched).
WITH_FAULTS = r"""
import os, runpy, signal, sys, torch
from common import training
env = lambda name: int(os.environ.get(name, 0))
here = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0))) == env("FAULT_RANK")
update, updates = training.EpochMetrics.update, [0]
def update_with_faults(self, loss, output, labels):
    bad = here and self.step + 1 == env("BAD_LOSS_STEP")
    update(self, loss * float("nan") if bad else loss, output, labels)
    if here and self.step == env("STOP_STEP"):
        os.kill(os.getpid(), signal.SIGTERM)
def nan_weight(optimizer, args, kwargs):
    updates[0] += 1
    if here and updates[0] == env("NAN_STEP"):
        optimizer.param_groups[0]["params"][0].data.fill_(float("nan"))
training.EpochMetrics.update = update_with_faults
from torch.optim.optimizer import register_optimizer_step_post_hook
register_optimizer_step_post_hook(nan_weight)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_faults(args):
    """`args` (a script's command line, as `cmd` makes it) run under WITH_FAULTS."""
    return [args[0], "-c", WITH_FAULTS, *args[1:]]
