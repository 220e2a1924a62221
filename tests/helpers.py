"""What several test modules need: the repository root, a child's environment, argv parsing."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Open MPI's mpirun: the one pip installed beside this Python first, else one on PATH (or None)
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep
                      + os.environ.get("PATH", ""))


def child_env(**extra):
    """The environment of a script started by a test: one thread per process, no launcher
    variables inherited from the caller (so a child is a world of 1 unless the test says
    otherwise), and Open MPI allowed to run as root and to oversubscribe the 2 cores."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def last_value(argv, flag):
    """The value argparse keeps for `flag`: its last occurrence."""
    found = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    assert found, f"{flag} is not on the command line {argv}"
    return found[-1]


def ok(proc):
    """A finished script's stdout lines; fails with its output unless it exited 0."""
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout.splitlines()


def one_error_line(proc, *needles):
    """Bad input's contract: exit 2, exactly one line on stderr naming each needle, no
    traceback.  Returns the line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


def markdown_rows(text):
    """The cells of every Markdown table line in `text` (header, separator and rows), each
    stripped of its padding."""
    return [[cell.strip() for cell in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]


def finish(procs, timeout=240):
    """(returncode, stdout, stderr) of each process; none outlives the test."""
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *output) for p, output in zip(procs, outputs)]
    finally:
        for p in procs:
            p.kill()


def by_hand(args, ranks=2, cwds=None, **env):
    """`args` started as the ranks of one world by the launcher variables alone (as a pod per
    rank is; no mpirun to end them together), each in its folder of `cwds`: their (exit status,
    stdout, stderr)."""
    from common.network import free_port
    contract = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    WORLD_SIZE=str(ranks), **env)
    return finish([subprocess.Popen(args, cwd=cwd, env=child_env(RANK=str(rank), **contract),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for rank, cwd in enumerate(cwds or [ROOT] * ranks)])
