"""Helpers shared by the benchmarks: paths, machine description, load, timing, tables, mpirun."""
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
TESTS_DIR = os.path.join(REPO_ROOT, "tests")

# BENCH_SMOKE=1: every benchmark at its smallest, to check the code paths (numbers meaningless)
SMOKE = os.environ.get("BENCH_SMOKE") == "1"

for _p in (REPO_ROOT, BENCH_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common.run import precision_name  # noqa: E402,F401  (re-exported: the scripts' own label)


_deadline = None


def set_budget(seconds):
    """From now, `out_of_time` says whether `seconds` have (nearly) run out (0: no budget)."""
    global _deadline
    _deadline = time.monotonic() + seconds if seconds else None


def out_of_time(need_seconds):
    """True when the next piece of work (about `need_seconds`) would overrun the budget."""
    return _deadline is not None and time.monotonic() + need_seconds > _deadline


def log(*parts):
    print(*parts, flush=True)


def median(values):
    return statistics.median(values) if values else float("nan")


def spread(values):
    """(min, max) of a list, for the tables' +- columns."""
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def mpirun():
    """The mpirun beside this Python (the venv's Open MPI), else the one on PATH."""
    exe = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.exists(exe):
        return exe
    found = shutil.which("mpirun")
    if not found:
        raise Skip("mpirun not found (pip install -r requirements-dev.txt adds Open MPI)")
    return found


def sync(device):
    import torch
    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------- machine and load

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_busy_fraction(seconds=1.0):
    """Fraction of all CPUs busy over `seconds` (from /proc/stat): the load others put on it
    when sampled while this program is idle."""
    def read():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle
    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except OSError:
        return None
    total = t1 - t0
    return round(1.0 - (i1 - i0) / total, 3) if total > 0 else None


def cpu_seconds():
    """(CPU-seconds all CPUs were busy since boot, CPU-seconds used by this process and its
    reaped children).  Their difference over a benchmark is what everything else used."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None, None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = (sum(fields[:8]) - idle) / tick  # user..steal; guest time is inside user
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


class OthersMeter:
    """Share of the machine's CPU capacity used by other processes while a benchmark ran."""

    def __init__(self):
        self.start = time.perf_counter()
        self.busy0, self.own0 = cpu_seconds()

    def stop(self):
        busy1, own1 = cpu_seconds()
        if self.busy0 is None or busy1 is None:
            return None
        wall = time.perf_counter() - self.start
        others = max(0.0, (busy1 - self.busy0) - (own1 - self.own0))
        return {"others_cpu_seconds": round(others, 1),
                "others_share_of_capacity": round(others / (wall * (os.cpu_count() or 1)), 3)}


def load_snapshot(sample_seconds=1.0):
    """Load average and, sampled while we are idle, how busy the CPUs are."""
    snap = {"time": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        snap["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        snap["loadavg"] = None
    if sample_seconds:
        snap["cpu_busy_while_idle"] = cpu_busy_fraction(sample_seconds)
    return snap


def machine_info():
    import torch
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_bf16": sorted(f for f in cpu_flags() if f in ("avx512_bf16", "amx_bf16", "amx_tile",
                                                           "avx512f", "avx2")),
        "memory_gib": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "hostname": platform.node(),
        "os": platform.platform(),
    }
    try:
        import torchvision
        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
            text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout
        info["git_dirty"] = bool(dirty.strip())
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


# ----------------------------------------------------------------------------- tables

def fmt(value, digits=3):
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


TABLES = []  # every table printed, in order: run.py stores them in the JSON


def default_amp(device):
    """The scripts' default precision on `device` ("cpu", "cuda" or a torch.device)."""
    import torch
    from common.run import default_amp as scripts_default
    return scripts_default(torch.device(device))


def table(title, header, rows):
    """A plain-text table (also valid Markdown) as a string; also kept in TABLES."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
              for i, h in enumerate(header)]
    head = "| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |"
    lines = [f"\n{title}", head, "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    text = "\n".join(lines)
    TABLES.append(text.strip())
    return text


class Skip(Exception):
    """A benchmark that cannot run here (no GPU, too few GPUs, ...): its message is recorded."""
