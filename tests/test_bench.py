"""The analysis tools behind BENCHMARKS.md's async figures still run, and say what it quotes.

The timed benchmarks are not run here (their figures are ratios taken side by side on a quiet
machine); these are the deterministic tools: the stability and noise-floor analysis, the
staleness simulator with every reply it offers, and the drift probe, on tiny sizes.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, child_env, markdown_rows, ok

pytestmark = pytest.mark.slow  # trains for minutes: scheduled first (conftest.py)

TIMEOUT = 300
# The simulator on tiny sizes: 2 workers, 64 images, batch 8 each, one epoch (4 rounds)
TINY = ["--workers", "2", "--train", "64", "--test", "32", "--epochs", "1", "--batch-size",
        "16", "--global-batch", "--lr", "0.05"]


def run_bench(script, *argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT,
                          env=child_env(BENCH_THREADS="1"))


@pytest.fixture(scope="module")
def staleness_main():
    """bench/staleness.py's main(argv), run in this process on one thread: a process per run
    spent more time importing torch than simulating.  (One run goes through the command line,
    in test_staleness_simulator_runs_every_reply.)"""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import staleness
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # main() keeps it (BENCH_THREADS unset)
    yield staleness.main
    torch.set_num_threads(threads)
    sys.path.remove(os.path.join(ROOT, "bench"))


@pytest.fixture(scope="module")
def simulate(tmp_path_factory, staleness_main):
    """simulate(*argv): one run of the simulator on TINY sizes, its JSON record; each
    configuration runs once per module, since the tests below share some."""
    records = {}

    def run(*argv):
        if argv not in records:
            out = tmp_path_factory.mktemp("simulate") / "results.jsonl"
            staleness_main([*TINY, *argv, "--json", str(out)])
            records[argv] = json.loads(out.read_text())
        return records[argv]
    return run


def test_stability_and_noise_floor_say_what_benchmarks_md_quotes():
    lines = ok(run_bench("stability.py"))
    text = "\n".join(lines)
    assert "delay 0: 1.360" in text  # Nesterov momentum 0.9's edge without delay
    floor = {}  # (workers, rule) -> variance ratios at h = 0.02, 0.05, 0.1, 0.2, 0.4
    for line in lines:
        m = re.match(r"\s+(\d) workers, (.+?)\s{2,}([\d. inf]+)$", line)
        if m:
            floor[int(m.group(1)), m.group(2).split(" (")[0].strip()] = \
                [float(x) for x in m.group(3).split()]
    # the figures BENCHMARKS.md quotes ("The noise floor"), 4 workers
    assert floor[4, "extrapolated N - 1"] == [1.00, 1.02, 1.10, 1.36, 2.27], floor
    assert floor[4, "nothing stale"] == [0.94, 0.88, 0.83, 0.78, 0.76], floor
    for n in (2, 4, 8):
        as_is, default, fresh = (floor[n, "reply as is"], floor[n, "extrapolated N - 1"],
                                 floor[n, "nothing stale"])
        for h in range(3):  # along the bulk (h <= 0.1) the order the simulator found
            assert fresh[h] < default[h] < as_is[h], (n, h, fresh, default, as_is)
    best = [line for line in lines if "the best split and extrapolation" in line]
    assert len(best) == 1, text
    ratios = [float(x) for x in best[0].split(":")[-1].split()]
    default = floor[4, "extrapolated N - 1"]
    for h in range(3):  # "within 4 % of the default" (BENCHMARKS.md, "The noise floor")
        assert ratios[h] >= 0.96 * default[h], (ratios, default)


def test_staleness_simulator_runs_every_reply(tmp_path, staleness_main):
    out = tmp_path / "results.jsonl"
    runs = [["--rule", "nesterov", "nesterovdc", "sync", "plain", "dana", "danaga",
             "--extra-ahead", "0.5", "--ahead-per-worker"],
            ["--rule", "nesterov", "--extra-ahead", "0.5", "--ahead-smooth", "0.9"],
            ["--rule", "nesterov", "--fresh", "--shuffle-order", "--log-every", "3"],
            ["--rule", "dana", "--spike", "--ahead-gradients"]]
    ok(run_bench("staleness.py", *TINY, *runs[0], "--json", str(out)))  # the command line
    for argv in runs[1:]:
        staleness_main([*TINY, *argv, "--json", str(out)])
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rule"] for r in results] == ["nesterov", "nesterovdc", "sync", "plain", "dana",
                                            "danaga", "nesterov", "nesterov", "dana"]
    for r in results:
        assert len(r["test_acc"]) == 1 and 0.0 <= r["test_acc"][0] <= 100.0, r
        assert 0.0 < r["train_loss"][0] < 20.0, r  # finite, a loss
    assert results[0]["ahead_per_worker"] and results[6]["ahead_smooth"] == 0.9
    # --log-every 3 over 4 rounds: a window of 3 and the last 1
    windows = results[7]["train_loss_every"]
    assert len(windows) == 2 and all(0.0 < w < 20.0 for w in windows), windows
    assert "train_loss_every" not in results[0]


def test_simulator_lookahead_extrapolates_as_far_as_ahead_says(simulate):
    """--ahead 0 replies the parameters as they are: the slides' rule (`plain`), step for step;
    the default (workers - 1 updates) replies elsewhere and trains differently."""
    plain, ahead_0, ahead_1 = [simulate(*argv) for argv in (
        ("--rule", "plain"), ("--rule", "lookahead", "--ahead", "0"), ("--rule", "lookahead"))]
    assert ahead_0["ahead"] == 0 and ahead_1["ahead"] is None
    assert ahead_0["train_loss"] == plain["train_loss"], (ahead_0, plain)
    assert ahead_1["train_loss"] != plain["train_loss"], (ahead_1, plain)


def test_simulator_fresh_head_and_fresh_only(simulate):
    """--fresh-head recomputes the head's gradient at the server's parameters: with 1 worker
    (nothing stale, fp32) that is the worker's own gradient, step for step; with 2 workers it
    trains differently.  --fresh-only with every module's prefix is --fresh; with fc. alone
    it is neither the stale run nor --fresh."""
    one = ("--rule", "nesterov", "--workers", "1", "--no-amp")
    two = ("--rule", "nesterov", "--extra-ahead", "0.5")
    every = ("conv1.", "bn1.", "conv2_x.", "conv3_x.", "conv4_x.", "conv5_x.", "fc.")
    runs = [simulate(*argv)["train_loss"] for argv in (
        one, (*one, "--fresh-head"), two, (*two, "--fresh-head"), (*two, "--fresh"),
        (*two, "--fresh-only", *every), (*two, "--fresh-only", "fc."))]
    one_stale, one_head, two_stale, two_head, fresh, all_fresh, fc_fresh = runs
    assert one_head == one_stale
    assert two_head != two_stale
    assert all_fresh == fresh
    assert fc_fresh not in (two_stale, fresh)


def test_drift_probe_prints_its_measurements():
    """Today's rule (the reply extrapolated, the head fresh): each probe prints the gap and,
    for each of the six estimates (three diagonals, the other batches' change, the empirical
    Fisher of the latest gradients about zero and about their mean), its best scale and the
    share of the gap it explains."""
    lines = ok(run_bench("drift.py", "--train", "128", "--epochs", "2", "--every", "2",
                         "--extra-ahead", "0.5", "--fresh-head", "--others", "2",
                         "--fisher", "3"))
    assert "2 other batches' change" in lines[0] and "Fisher of 3" in lines[0]
    probes = [line.split() for line in lines[1:] if line.strip()]
    assert probes, lines
    for cells in probes:
        assert len(cells) == 4 + 2 * 6, cells
        assert cells[1] == "2"  # probed after the first epoch only
        ratio = float(cells[3])  # |d| / |g|: the stale gradient differs, but not wildly
        assert 0.0 < ratio < 10.0, cells
        shares = [float(c.rstrip("%")) for c in cells[5::2]]
        assert all(0.0 <= share <= 100.0 for share in shares), cells


def test_simulator_pull(simulate):
    """--pull P moves each update P / N of the way back to where its gradient was computed:
    0 is the rule without it, step for step; with 1 worker there is no gap (its gradient is
    computed at the current parameters), so nothing changes; with 2 workers it trains
    differently."""
    one = ("--rule", "nesterov", "--workers", "1", "--no-amp")
    two = ("--rule", "nesterov", "--extra-ahead", "0.5", "--fresh-head")
    runs = [simulate(*argv)["train_loss"] for argv in (
        one, (*one, "--pull", "0.5"), two, (*two, "--pull", "0"), (*two, "--pull", "0.5"))]
    one_plain, one_pulled, two_plain, two_zero, two_pulled = runs
    assert one_pulled == one_plain
    assert two_zero == two_plain
    assert two_pulled != two_plain


def test_simulator_computes_in_the_scripts_precision(monkeypatch):
    """The simulator and the drift probe take the scripts' default precision: bf16 only on a
    CPU with native bf16.  Forced on elsewhere, emulated bf16 made them ~10x slower than fp32
    (an epoch of the simulator: 33 minutes instead of ~2), and measured another precision than
    the real runs they stand for."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import staleness
    from common import process
    for native in (False, True):
        monkeypatch.setattr(process, "cpu_has_native_bf16", lambda: native)
        assert staleness.parse_args([]).amp is native
        assert staleness.parse_args(["--amp"]).amp is True
        assert staleness.parse_args(["--no-amp"]).amp is False


def test_convergence_merge_pools_seeds_of_one_precision_only(monkeypatch, tmp_path):
    """bench/convergence.py --merge pools seeds run at different times, but refuses runs of
    another precision or torch build: bf16 on one CPU and fp32 on another move a seed's final
    accuracy by points, which pooled would pass for seed-to-seed spread."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence

    def part(name, seed, acc, precision, avx512=True, gpu=None):
        rows = [{"epoch": 1.0, "test_acc": acc, "train_loss": 2.0}]
        config = dict(n_train=64, n_test=32, epochs=1, batch=8, lr=0.1, flags=[],
                      async_flags=[], seeds=[seed], sync=[2], workers=[2],
                      machine={"cpu": "x", "torch": "2.0", "precision": precision,
                               "avx512": avx512, **({"gpu": gpu} if gpu else {})})
        path = tmp_path / f"{name}-{seed}-{precision}-{gpu}.json"
        path.write_text(json.dumps({"config": config,
                                    "runs": {name: {"per_seed": {str(seed): rows}}}}))
        return str(path)

    pooled = convergence.merge([part("sync, 2 ranks", 0, 40.0, "fp32"),
                                part("sync, 2 ranks", 1, 44.0, "fp32"),
                                part("async, 2 workers", 0, 41.0, "fp32")])
    assert pooled["summary"]["sync, 2 ranks"]["finals"] == [40.0, 44.0]
    assert pooled["summary"]["sync, 2 ranks"]["final_mean"] == 42.0
    with pytest.raises(SystemExit, match="same torch build, precision and CPU or GPU kind"):
        convergence.merge([part("sync, 2 ranks", 2, 40.0, "fp32"),
                           part("sync, 2 ranks", 3, 44.0, "bf16 autocast + channels_last")])
    # fp32 on a CPU with AVX-512 and on one without: the same seed ends points apart
    with pytest.raises(SystemExit, match="same torch build, precision and CPU or GPU kind"):
        convergence.merge([part("sync, 2 ranks", 2, 40.0, "fp32", avx512=False),
                           part("sync, 2 ranks", 3, 44.0, "fp32", avx512=True)])
    # bf16 on a GPU (bench/convergence.py --device cuda) and on a CPU
    bf16 = "bf16 autocast + channels_last"
    with pytest.raises(SystemExit, match="same torch build, precision and CPU or GPU kind"):
        convergence.merge([part("sync, 2 ranks", 2, 40.0, bf16),
                           part("sync, 2 ranks", 3, 44.0, bf16, gpu="NVIDIA H200")])


def test_convergence_merge_of_a_missing_or_foreign_file_is_one_line(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"a": 1}')
    with pytest.raises(SystemExit, match="missing.json: cannot read it"):
        convergence.merge([str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="foreign.json: not a --json file of this script"):
        convergence.merge([str(foreign)])


def test_convergence_reports_the_training_loss_gap_beside_the_accuracy_gap(monkeypatch,
                                                                           capsys):
    """The table gives each async run's gap to sync in final training loss too (mean and
    standard error over seeds): the steadier measure of how well a rule optimises."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence

    def rows(acc, loss, **extra):
        return [{"epoch": 1.0, "test_acc": acc, "train_loss": loss, "mean_staleness": 1.0,
                 "max_staleness": 2.0, **extra}]
    results = {"sync, 2 ranks": {0: rows(40.0, 2.0), 1: rows(44.0, 2.2)},
               "async, 2 workers": {0: rows(39.0, 2.1, pulled=0.25),
                                    1: rows(41.0, 2.5, pulled=0.5)}}
    cfg = dict(convergence.FULL, epochs=1, seeds=(0, 1), sync=(2,), workers=(2,))
    convergence.report(cfg, convergence.summary(results), {},
                       ["sync, 2 ranks", "async, 2 workers"])
    table = markdown_rows(capsys.readouterr().out)
    header, row = table[0], next(r for r in table if r[0] == "async, 2 workers")
    # accuracy: 40.0 against 42.0; training loss: 2.3 against 2.1; the standard error of a
    # difference of two means over 2 seeds, sqrt(2 / 2 + 8 / 2) and sqrt(0.08 / 2 + 0.02 / 2)
    assert row[header.index("gap to sync")] == "-2.00 ± 2.24 (sync, 2 ranks)"
    assert row[header.index("train loss gap")] == "+0.200 ± 0.224"
    # the share of updates pulled back, over every epoch of every seed; sync has none
    assert row[header.index("pulled %")] == "37.5"
    assert next(r for r in table if r[0] == "sync, 2 ranks")[header.index("pulled %")] == "-"


def test_convergence_records_the_precision_the_flags_choose(monkeypatch):
    """--flags=--no-amp on a CPU with native bf16 runs fp32, and the JSON must say so (it
    once recorded the CPU's default, bf16, for fp32 runs)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    from common import process
    for native in (False, True):
        monkeypatch.setattr(process, "cpu_has_native_bf16", lambda: native)
        assert convergence.machine([])["precision"] == process.precision_name(native)
        assert convergence.machine(["--no-amp"])["precision"] == "fp32"
        assert convergence.machine(["--lr", "0.1", "--amp"])["precision"] != "fp32"


def test_convergence_on_a_gpu_machine_shares_the_gpu_and_the_cores(monkeypatch):
    """--device cuda --launcher torchrun --parallel K: every rank on the one GPU, so sync SGD
    over gloo (nccl refuses two ranks on one GPU), started by torchrun (no MPI there), each
    process with cores / (processes x K) threads."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cfg = dict(convergence.FULL, device="cuda", launcher="torchrun", parallel=2)
    sync = convergence.command("sync", 4, "/data", "/out", cfg, seed=7)
    assert sync[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port"]
    assert sync[7].endswith("sync_sgd_cifar100.py")
    assert sync[sync.index("--device") + 1] == "cuda"
    assert sync[sync.index("--backend") + 1] == "gloo"
    assert sync[sync.index("--seed") + 1] == "7"
    worker = convergence.command("async", 5, "/data", "/out", cfg, seed=7)
    assert worker[7].endswith("async_sgd_cifar100.py") and "--backend" not in worker
    assert convergence.threads(4, cfg) == "2" and convergence.threads(5, cfg) == "1"
    assert "--backend" not in convergence.command("sync", 4, "/d", "/o", convergence.FULL, 0)


def test_convergence_calls_side_by_side_keep_their_partial_runs_apart(monkeypatch, tmp_path):
    """Each call's runs done so far go beside its own --json (F.partial.json), so that calls
    running at once from one repository (one per variant of the rule, on the same seeds) do
    not write one file; without --json they go to bench/results/ as before."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    monkeypatch.setattr(convergence, "REPO_ROOT", str(tmp_path / "repo"))
    monkeypatch.setattr(convergence, "make_yardstick", lambda root, n_train, n_test: root)

    def train(kind, processes, data_dir, cfg, seed):
        acc = 40.0 + seed + (10.0 if cfg["async_flags"] else 0.0)
        return [{"epoch": 1.0, "test_acc": acc, "train_loss": 2.0, "mean_staleness": 1.0,
                 "max_staleness": 2.0}], 1.0

    monkeypatch.setattr(convergence, "train", train)
    paths = {flags: convergence.partial_path(str(tmp_path / f"{name}.json"))
             for name, flags in (("default", ""), ("variant", "--pull 0.3"))}
    assert len(set(paths.values())) == 2
    for flags, path in paths.items():
        convergence.run(False, ["async, 2 workers"], [3], async_flags=flags.split(), epochs=1,
                        partial=path)
    for flags, path in paths.items():
        with open(path) as f:
            kept = json.load(f)
        assert kept["async, 2 workers"]["3"][0]["test_acc"] == (53.0 if flags else 43.0)
    assert not (tmp_path / "repo").exists()  # nothing in the shared file
    assert convergence.partial_path() == os.path.join(str(tmp_path / "repo"), "bench",
                                                      "results", "convergence_partial.json")


def test_convergence_in_parallel_keeps_every_run_that_ended(monkeypatch, tmp_path):
    """With --parallel K a failed run is left out and the others are kept, by seed."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    monkeypatch.setattr(convergence, "make_yardstick", lambda root, n_train, n_test: root)
    monkeypatch.setattr(convergence, "save_partial", lambda results, path: None)

    def train(kind, processes, data_dir, cfg, seed):
        if kind == "async" and seed == 1:
            raise RuntimeError("async on 3 processes, seed 1: exit 1")
        return [{"epoch": 1.0, "test_acc": 40.0 + seed + (kind == "async"), "train_loss": 2.0,
                 "mean_staleness": 1.0, "max_staleness": 2.0}], 1.0

    monkeypatch.setattr(convergence, "train", train)
    result = convergence.run(False, ["sync, 2 ranks", "async, 2 workers"], [2, 0, 1],
                             epochs=1, parallel=2)
    assert result["summary"]["sync, 2 ranks"]["finals"] == [40.0, 41.0, 42.0]
    assert result["summary"]["async, 2 workers"]["finals"] == [41.0, 43.0]


def test_convergence_table_counts_the_seeds_that_ran(monkeypatch, capsys):
    """The table's title gives how many seeds its means are over: where --budget skipped some
    runs it must not claim all the seeds asked (it once said 12 where 9 had run)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence

    cfg = dict(epochs=1, seeds=[0, 1, 2], sync=[2], workers=[2])
    names = ["sync, 2 ranks", "async, 2 workers"]

    def results(seeds):  # one epoch per run, for each of these seeds
        return {name: {s: [{"epoch": 1.0, "test_acc": 40.0 + s, "train_loss": 2.0}]
                       for s in seeds} for name in names}

    convergence.report(cfg, convergence.summary(results([0, 1, 2])), {}, names)
    assert "mean over 3 seed(s)" in capsys.readouterr().out
    some = results([0, 1])  # seed 2's runs skipped by --budget
    convergence.report(cfg, convergence.summary(some), {}, names)
    title = next(line for line in capsys.readouterr().out.splitlines() if "mean over" in line)
    assert "3 seed(s)" not in title and "of 3 asked" in title, title


def test_each_benchmark_runs_alone_and_answers_help_without_running(tmp_path):
    """`python bench/exchange.py` is benchmark 2 alone, as `bench/run.py --only exchange` runs
    it (it used to import, do nothing and exit 0), and every tool's --help prints its usage
    instead of running (bench/stability.py used to run its whole analysis)."""
    bench = os.path.join(ROOT, "bench")
    names = {"exchange.py": "exchange", "gpu.py": "gpu", "param_server.py": "ps",
             "training.py": "step"}
    scripts = sorted(f for f in os.listdir(bench) if f.endswith(".py") and f != "util.py")
    assert set(names) <= set(scripts)
    env = child_env(BENCH_THREADS="1", CUDA_VISIBLE_DEVICES="")

    def start(script, *argv):
        return subprocess.Popen([sys.executable, os.path.join(bench, script), *argv], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    helps = {script: start(script, "--help") for script in scripts}
    # the GPU benchmark alone, where no GPU is visible: skipped, and its record written
    record = tmp_path / "gpu.json"
    alone = start("gpu.py", "--json", str(record))
    for script, proc in helps.items():
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0 and out.startswith(f"usage: {script}"), (script, out, err)
        assert "delay 0:" not in out and "=== " not in out, (script, out)
        if script in names:
            assert "--only" not in out and "--quick" in out, (script, out)
    out, err = alone.communicate(timeout=TIMEOUT)
    assert alone.returncode == 0, (out, err)
    assert list(json.loads(record.read_text())["benchmarks"]) == ["gpu"]
    assert "skipped" in json.loads(record.read_text())["benchmarks"]["gpu"]
