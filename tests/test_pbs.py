"""The cluster job scripts in pbs/: one PBS job per main script plus a generic Slurm
job. Each must be valid bash, keep its scheduler directives and user settings in
the marked block at the top, write to a fixed --out (so a resubmitted job resumes),
and call a script that exists at the repository root with flags that script
accepts (compared with `python <script> --help`). A missing script is a failure.
"""
import functools
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import last_value

REPO = Path(__file__).resolve().parent.parent
PBS = REPO / "pbs"
SCRIPTS = ["resnet_cifar100.py", "resnet_tinyimagenet.py", "pretrained_cifar100.py",
           "sync_sgd_cifar100.py", "async_sgd_cifar100.py"]
SINGLE = {"resnet_cifar100.py", "resnet_tinyimagenet.py", "pretrained_cifar100.py"}
PBS_JOBS = sorted(PBS.glob("*.pbs"))
SLURM_JOBS = sorted(PBS.glob("*.sbatch"))
ALL_JOBS = PBS_JOBS + SLURM_JOBS
BEGIN, END = "EDIT THIS BLOCK", "END OF THE BLOCK TO EDIT"


def job_id(path):
    return path.name


# --------------------------------------------------------------------------- parsing
def logical_lines(text):
    """Lines with backslash continuations joined."""
    return re.sub(r"\\\n", " ", text).splitlines()


def assignments(text):
    """NAME -> value of the first plain `NAME=value` line (the edit block's)."""
    found = {}
    for line in logical_lines(text):
        m = re.match(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)$", line)
        if m and m.group(1) not in found:
            words = shlex.split(m.group(2), comments=True)
            found[m.group(1)] = words[0] if words else ""
    return found


def _var(token):
    m = re.fullmatch(r"\$(?:\{(\w+)\}|(\w+))", token)
    return (m.group(1) or m.group(2)) if m else None


def _expand_script(token, env):
    """The script a `python` token names, with $VAR/${VAR} references resolved."""
    def sub(m):
        return env.get(m.group(1) or m.group(2), "")
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", sub, token)


def launch(text):
    """(script name, [--flags]) of the line that starts the Python script."""
    env = assignments(text)
    found = []
    for line in logical_lines(text):
        if line.lstrip().startswith("#"):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, tok in enumerate(tokens):
            script = _expand_script(tok, env)
            if script.endswith(".py") and i > 0 and tokens[i - 1].split("/")[-1] in (
                    "python", "python3", "$PYTHON", "${PYTHON}"):
                flags = []
                pending = list(tokens[i + 1:])
                while pending:
                    t = pending.pop(0)
                    name = _var(t)
                    if name is not None:                      # $EXTRA_ARGS etc.
                        pending[:0] = shlex.split(env.get(name, ""))
                    elif t.startswith("--"):
                        flags.append(t.split("=", 1)[0])
                found.append((os.path.basename(script), flags))
    assert len(found) == 1, f"expected one python launch line, found {found}"
    return found[0]


@functools.lru_cache(maxsize=None)
def help_flags(script):
    path = REPO / script
    assert path.is_file(), f"{script} does not exist at the repository root (yet)"
    proc = subprocess.run([sys.executable, str(path), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", proc.stdout))


# --------------------------------------------------------------------------- tests
def test_one_pbs_job_per_script_and_a_slurm_job():
    assert sorted(p.stem for p in PBS_JOBS) == sorted(Path(s).stem for s in SCRIPTS)
    assert SLURM_JOBS, "no generic Slurm script (pbs/*.sbatch)"
    assert (PBS / "README.md").is_file()
    readme = (PBS / "README.md").read_text()
    for needle in ("qsub", "sbatch", "qstat", "squeue", "curve.png", "metrics.csv",
                   "cifar-100-python", "tiny-imagenet-200", "resnet18-f37072fd.pth",
                   "mpi4py", "bwpy-mpi"):
        assert needle in readme, f"pbs/README.md does not mention {needle}"


@pytest.mark.parametrize("job", ALL_JOBS, ids=job_id)
def test_bash_syntax(job):
    proc = subprocess.run(["bash", "-n", str(job)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("job", ALL_JOBS, ids=job_id)
def test_edit_block_at_the_top(job):
    text = job.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("#!/bin/bash")
    begin = next(i for i, l in enumerate(lines) if BEGIN in l)
    end = next(i for i, l in enumerate(lines) if END in l)
    assert begin < end
    prefix = "#PBS" if job.suffix == ".pbs" else "#SBATCH"
    directives = [i for i, l in enumerate(lines) if l.startswith(prefix + " ")]
    assert directives, f"no {prefix} directives"
    assert all(begin < i < end for i in directives), "directives outside the edit block"
    # Schedulers stop reading directives at the first command.
    first_command = next(i for i, l in enumerate(lines)
                         if l.strip() and not l.lstrip().startswith("#"))
    assert max(directives) < first_command
    # Every setting the launch line uses is set inside the block.
    block = "\n".join(lines[begin:end])
    for name in ("CODE_DIR", "DATA_DIR", "OUT_DIR", "EXTRA_ARGS"):
        assert re.search(rf"^{name}=", block, re.M), f"{name} is not set in the edit block"
    # A fixed --out: no job id or date in it, so a resubmitted job resumes.
    out_dir = assignments(text)["OUT_DIR"]
    assert not re.search(r"JOBID|JOB_ID|date|\$\$|RANDOM", out_dir), out_dir
    assert "resume" in text.lower()


@pytest.mark.parametrize("job", PBS_JOBS, ids=job_id)
def test_pbs_job_for_cray_xk(job):
    text = job.read_text()
    script, _ = launch(text)
    assert script == job.stem + ".py"
    nodes = re.search(r"^#PBS -l nodes=(\d+):ppn=16:xk\s*$", text, re.M)
    assert nodes, "no `#PBS -l nodes=N:ppn=16:xk`"
    for pattern in (r"^#PBS -l walltime=\d+:\d\d:\d\d\s*$", r"^#PBS -N \S+",
                    r"^#PBS -o \S+", r"^#PBS -e \S+"):
        assert re.search(pattern, text, re.M), pattern
    assert re.search(r'^MODULES="[^"]*\bbwpy\b[^"]*\bbwpy-mpi\b', text, re.M)
    assert "module load $MODULES" in text
    aprun = [l for l in logical_lines(text) if l.lstrip().startswith("aprun ")]
    assert len(aprun) == 1
    if script in SINGLE:
        assert int(nodes.group(1)) == 1
        assert re.search(r"aprun -n 1 -N 1\b", aprun[0])
    else:
        assert int(nodes.group(1)) >= 2
        assert re.search(r'aprun -n "\$NPROC" -N 1\b', aprun[0])
        assert "PBS_NUM_NODES" in text
    assert re.search(r'--out "\$OUT_DIR"', aprun[0])


@pytest.mark.parametrize("job", SLURM_JOBS, ids=job_id)
def test_slurm_job_uses_srun_one_task_per_gpu(job):
    text = job.read_text()
    assert re.search(r"^#SBATCH --ntasks-per-node=\d+", text, re.M)
    assert re.search(r"^#SBATCH --gres=gpu:\d+", text, re.M)
    assert re.search(r"^#SBATCH --time=", text, re.M)
    srun = [l for l in logical_lines(text) if l.lstrip().startswith("srun ")]
    assert len(srun) == 1 and re.search(r'--out "\$OUT_DIR"', srun[0])


@pytest.mark.parametrize("job", ALL_JOBS, ids=job_id)
def test_calls_an_existing_script_with_flags_it_accepts(job):
    script, flags = launch(job.read_text())
    assert script in SCRIPTS, f"{job.name} runs {script}, not a HW4 script"
    assert "--data-dir" in flags and "--out" in flags
    accepted = help_flags(script)
    unknown = sorted(set(flags) - accepted)
    assert not unknown, f"{job.name}: {script} does not accept {unknown}"


FAKE = """#!/bin/sh
printf '%s\\n' "$(basename "$0")" "$@" > "$FAKE_LOG"
"""


def dry_run(job, tmp_path):
    """Run the job script with a fake aprun/srun/module; (the launcher's argv, $HOME)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "ie534-hw4").symlink_to(REPO)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("aprun", "srun", "module"):
        p = bindir / name
        p.write_text(FAKE if name != "module" else "#!/bin/sh\nexit 0\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "argv"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(home), "FAKE_LOG": str(log),
           "PBS_JOBID": "123.bw", "PBS_NUM_NODES": "2", "SLURM_JOB_ID": "456"}
    proc = subprocess.run(["bash", str(job)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines(), home


@pytest.mark.parametrize("job", ALL_JOBS, ids=job_id)
def test_dry_run_with_fake_scheduler_tools(job, tmp_path):
    """Run the job script with a fake aprun/srun/module and check what it starts."""
    argv, home = dry_run(job, tmp_path)
    script, _ = launch(job.read_text())
    py = argv.index(script)
    assert argv[0] == ("aprun" if job.suffix == ".pbs" else "srun")
    if job.suffix == ".pbs":
        assert argv[argv.index("-n") + 1] == ("1" if script in SINGLE else "2")
    args = argv[py + 1:]
    out = args[args.index("--out") + 1]
    assert out.startswith(str(home)) and Path(out).is_dir(), out
    assert set(a.split("=")[0] for a in args if a.startswith("--")) <= help_flags(script)


# --------------------------------------------------------------------------- ResNet-50
IMAGENET_JOB = PBS / "resnet50_imagenet.sbatch"


def test_imagenet_job_runs_resnet50_fp32_on_an_image_folder(tmp_path):
    """ResNet-50 on an ImageNet-layout folder under Slurm: v1.5, FP32, the folder in DATA_DIR."""
    assert IMAGENET_JOB in SLURM_JOBS
    text = IMAGENET_JOB.read_text()
    script, flags = launch(text)
    assert script == "sync_sgd_cifar100.py"
    assert {"--dataset", "--arch", "--no-amp"} <= set(flags)
    assert re.search(r"^#SBATCH --nodes=2\s*$", text, re.M), "2 processes, as Intel's 2 workers"
    argv, home = dry_run(IMAGENET_JOB, tmp_path)
    args = argv[argv.index(script) + 1:]
    assert last_value(args, "--dataset") == "imagefolder"
    assert last_value(args, "--arch") == "resnet50"
    assert "--no-amp" in args and "--amp" not in args
    assert last_value(args, "--data-dir") == str(home / "scratch" / "imagenet")
    out = last_value(args, "--out")
    assert out.startswith(str(home)) and Path(out).is_dir() and "imagenet" in out
    # The script's own parser reads the ImageNet recipe from this command line.
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            "import sync_sgd_cifar100 as m\n"
            "print(json.dumps(vars(m.parse_args(sys.argv[1:])), default=str))\n")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ns = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (ns["dataset"], ns["arch"], ns["amp"]) == ("imagefolder", "resnet50", False)
    assert (ns["epochs"], ns["batch_size"]) == (90, 256)
    assert ns["lr"] == pytest.approx(0.1) and ns["weight_decay"] == pytest.approx(1e-4)


def test_readme_shows_the_imagenet_workload():
    readme = (PBS / "README.md").read_text()
    assert "## ResNet-50 on an ImageNet-layout folder" in readme
    for needle in ("resnet50_imagenet.sbatch", "--dataset imagefolder --arch resnet50",
                   "--no-amp", "train/<wnid>/", "val/<wnid>/", "sync_sgd_cifar100.pbs"):
        assert needle in readme, f"pbs/README.md does not mention {needle}"
