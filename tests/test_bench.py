"""bench/: the convergence benchmark's tables and files, every benchmark run alone and its
--help, and bench/async_rules.py (the async rules that were compared, as options of the main's
server: without one, the main's rule; with each, the rule it was).

The timed benchmarks are not run here (their figures are ratios taken side by side on a quiet
machine).
"""
import ast
import json
import math
import os
import pickle
import subprocess
import sys
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import async_sgd_cifar100
from common.checkpoint import State
from common.messages import CONTINUE, DONE, GRADIENT, HEADER
from common.run import execute
from helpers import MPIRUN, ROOT, child_env, markdown_rows, ok, one_error_line

sys.path.insert(0, os.path.join(ROOT, "bench"))  # bench/ is no package; its names stay out
import async_rules  # noqa: E402
sys.path.remove(os.path.join(ROOT, "bench"))

TIMEOUT = 300


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


# the config of a --json file of bench/convergence.py, as its run() writes it
CONVERGENCE_CONFIG = dict(n_train=64, n_test=32, epochs=1, batch=8, lr=0.1, seeds=[0],
                          sync=[2], workers=[2], async_flags=[], flags=[], device="cpu",
                          launcher="mpirun", parallel=1, real=None, straggler=None,
                          machine={"cpu": "x", "torch": "2.0", "precision": "fp32",
                                   "avx512": True})


def convergence_json(path, finals, without=(), **config):
    """Write a --json file of bench/convergence.py: `finals` maps a run's name to {seed: its
    test accuracy} (one epoch each); `config` changes the config, `without` leaves keys out
    (as files written before their flag existed did)."""
    config = {k: v for k, v in dict(CONVERGENCE_CONFIG, **config).items() if k not in without}
    runs = {name: {"per_seed": {str(seed): [{"epoch": 1.0, "test_acc": acc, "train_loss": 2.0,
                                             "mean_staleness": 1.0, "max_staleness": 2.0}]
                                for seed, acc in accs.items()}}
            for name, accs in finals.items()}
    path.write_text(json.dumps({"config": config, "runs": runs}))
    return str(path)


def test_convergence_merge_pools_files_from_before_real_and_straggler(monkeypatch, tmp_path):
    """A file written before --real and --straggler existed (no "real", no "straggler" in its
    config) ran what a file of today without them runs: --merge pools their seeds, in either
    order (it once refused them: a missing "real" read as [] against today's null), and still
    refuses a file of real photos beside them."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    old = convergence_json(tmp_path / "old.json", {"sync, 2 ranks": {0: 40.0}},
                           without=("real", "straggler"))
    today = convergence_json(tmp_path / "today.json", {"sync, 2 ranks": {1: 44.0}})
    for paths in ([old, today], [today, old]):
        merged = convergence.merge(paths)
        assert sorted(merged["summary"]["sync, 2 ranks"]["finals"]) == [40.0, 44.0]
        assert merged["config"]["seeds"] == [0, 1]
    photos = convergence_json(tmp_path / "photos.json", {"sync, 2 ranks": {2: 30.0}},
                              real="/data")
    with pytest.raises(SystemExit, match="same yardstick and recipe"):
        convergence.merge([old, photos])


def test_convergence_merge_keeps_the_straggler_pair_of_a_later_file(monkeypatch, tmp_path,
                                                                     capsys):
    """The straggler pair run in a later file only (--straggler there, not in the first) is in
    the merged table, the async run's gap taken to the slowed sync run, and the merged file
    says its delay (the table was once made from the first file's runs and left the pair out)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    plain = convergence_json(tmp_path / "plain.json",
                             {"sync, 2 ranks": {0: 40.0}, "async, 2 workers": {0: 41.0}})
    slow = convergence_json(tmp_path / "slow.json",
                            {"sync, 2 ranks, rank 1 slow": {0: 30.0},
                             "async, 2 workers, worker 1 slow": {0: 35.0}}, straggler=0.25)
    merged = convergence.merge([plain, slow])
    table = markdown_rows(capsys.readouterr().out)
    header, rows = table[0], {row[0]: row for row in table[2:]}
    assert set(rows) == {"sync, 2 ranks", "async, 2 workers", "sync, 2 ranks, rank 1 slow",
                         "async, 2 workers, worker 1 slow"}
    assert rows["async, 2 workers, worker 1 slow"][header.index("gap to sync")] == \
        "+5.00 (sync, 2 ranks, rank 1 slow)"
    assert merged["config"]["straggler"] == 0.25


def test_convergence_merge_refuses_two_straggler_delays(monkeypatch, tmp_path):
    """The straggler pair's runs slowed by different delays are different experiments: --merge
    refuses to pool them as seeds of one run."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    pair = ("sync, 2 ranks, rank 1 slow", "async, 2 workers, worker 1 slow")
    short = convergence_json(tmp_path / "short.json", {name: {0: 30.0} for name in pair},
                             straggler=0.25)
    long = convergence_json(tmp_path / "long.json", {name: {1: 20.0} for name in pair},
                            straggler=0.5)
    with pytest.raises(SystemExit, match="one --straggler delay"):
        convergence.merge([short, long])


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
    from common import run
    for native in (False, True):  # a CPU with native bf16, and one without
        monkeypatch.setattr(run, "default_amp", lambda device: native)
        assert convergence.machine([])["precision"] == run.precision_name(native)
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
    monkeypatch.setattr(convergence, "make_yardstick", lambda root, n_train, n_test, real=None: root)

    def train(kind, processes, data_dir, cfg, seed, extra=()):
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
    monkeypatch.setattr(convergence, "make_yardstick", lambda root, n_train, n_test, real=None: root)
    monkeypatch.setattr(convergence, "save_partial", lambda results, path: None)

    def train(kind, processes, data_dir, cfg, seed, extra=()):
        if kind == "async" and seed == 1:
            raise RuntimeError("async on 3 processes, seed 1: exit 1")
        return [{"epoch": 1.0, "test_acc": 40.0 + seed + (kind == "async"), "train_loss": 2.0,
                 "mean_staleness": 1.0, "max_staleness": 2.0}], 1.0

    monkeypatch.setattr(convergence, "train", train)
    result = convergence.run(False, ["sync, 2 ranks", "async, 2 workers"], [2, 0, 1],
                             epochs=1, parallel=2)
    assert result["summary"]["sync, 2 ranks"]["finals"] == [40.0, 41.0, 42.0]
    assert result["summary"]["async, 2 workers"]["finals"] == [41.0, 43.0]


def test_convergence_straggler_pair_slows_rank_1_in_both(monkeypatch):
    """--straggler S: sync on 2 ranks and async with 2 workers, rank 1 of each sleeping S
    seconds after each step, the async run compared with that sync run."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence
    cfg = dict(convergence.FULL, straggler=0.25)
    runs = {run[0]: run for run in convergence.runs(cfg)}
    pair = runs["sync, 2 ranks, rank 1 slow"], runs["async, 2 workers, worker 1 slow"]
    assert pair[1][3] == "sync, 2 ranks, rank 1 slow"
    for name, kind, processes, _, extra in pair:
        command = convergence.command(kind, processes, "/d", "/o", cfg, 0, extra)
        assert command[command.index("--straggler-delay") + 1] == "0.25", command
    assert not any("slow" in run[0] for run in convergence.runs(convergence.FULL))


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
    instead of running (a tool once ran its whole analysis)."""
    bench = os.path.join(ROOT, "bench")
    names = {"exchange.py": "exchange", "gpu.py": "gpu", "param_server.py": "ps",
             "training.py": "step"}
    scripts = sorted(f for f in os.listdir(bench)
                     if f.endswith(".py") and f not in ("util.py", "harness.py", "augment.py"))
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
        assert "=== " not in out, (script, out)
        if script in names:
            assert "--only" not in out and "--quick" in out, (script, out)
    out, err = alone.communicate(timeout=TIMEOUT)
    assert alone.returncode == 0, (out, err)
    assert list(json.loads(record.read_text())["benchmarks"]) == ["gpu"]
    assert "skipped" in json.loads(record.read_text())["benchmarks"]["gpu"]


def bench_imports():
    """Each module of bench/ (by name) and the modules of bench/ it imports, at its top or in a
    function."""
    bench = os.path.join(ROOT, "bench")
    names = {f[:-3] for f in os.listdir(bench) if f.endswith(".py")}
    graph = {}
    for name in names:
        with open(os.path.join(bench, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        graph[name] = imported & names
    return graph


def test_bench_run_only_dispatches_and_no_module_imports_itself_back():
    """bench/run.py imports every benchmark and none imports it (four once did, for the loop
    that runs one alone): no module of bench/ reaches itself through its imports."""
    graph = bench_imports()
    assert {"training", "exchange", "param_server", "gpu", "convergence"} <= graph["run"]

    def reached(start):  # every module `start` imports, directly or through others
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
        return seen
    circles = {name: sorted(graph[name]) for name in sorted(graph) if name in reached(name)}
    assert not circles, f"modules of bench/ that import themselves back: {circles}"


def test_convergence_runs_the_async_runs_with_a_rules_option_through_async_rules(monkeypatch):
    """--async-flags with an option of the rule (which the main refuses) starts the async runs
    as bench/async_rules.py; any other flags leave them, and every other run, to the mains."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import convergence

    def script(kind, async_flags):
        cmd = convergence.command(kind, 3, "/d", "/o", dict(convergence.FULL,
                                                            async_flags=async_flags), 0)
        return next(arg for arg in cmd if arg.endswith(".py")), cmd

    for flags in (["--pull", "0.4"], ["--pull=0.4"], ["--in-turn", "--ahead", "0"],
                  ["--no-fresh-head"], ["--momentum", "0.95", "--dc-lambda", "2"]):
        path, cmd = script("async", flags)
        assert path == os.path.join(ROOT, "bench", "async_rules.py"), flags
        assert cmd[-len(flags):] == flags
    for flags in ([], ["--momentum", "0.95"]):
        assert script("async", flags)[0] == os.path.join(ROOT, "async_sgd_cifar100.py")
    assert script("sync", ["--pull", "0.4"])[0] == os.path.join(ROOT, "sync_sgd_cifar100.py")


# ------------------------------------------------------- bench/async_rules.py: the rule's options

class _Done:
    def wait(self):
        pass


def _model():
    """The smallest model the server takes: a head (fc) and BatchNorm statistics."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(bn=nn.BatchNorm1d(4), fc=nn.Linear(4, 3)))


def _decay(args):
    """Weight decay on fc.weight alone: not on BatchNorm's weight and bias, nor fc.bias."""
    return torch.tensor([0.0] * 8 + [args.weight_decay] * 12 + [0.0] * 3)


def _variant(dc_lambda, *flags, workers=2, run=None):
    """A VariantServer; --pull 0 and --no-fresh-head: each test pins its own part of the rule
    (a test's own --pull comes later)."""
    args = async_rules.parse_args(["--lr", "0.2", "--epochs", "2", "--warmup-epochs", "0",
                                   "--pull", "0", "--dc-lambda", str(dc_lambda), *flags,
                                   "--no-fresh-head"])
    return (async_rules.VariantServer(_model(), workers, args, run, None, State(), 10,
                                      [0] * workers, None), args)


def _message(server, gradient, features=None, labels=None, buffers=None):
    """A worker's message: 4 samples (zero features unless given), `gradient`, statistics."""
    m = server.messages
    labels = torch.zeros(4, dtype=torch.int64) if labels is None else labels
    n = labels.numel()
    features = torch.zeros(n, m.n_features) if features is None else features
    message = torch.zeros(m.size)
    message[:HEADER] = torch.tensor([GRADIENT, float(n), 1.0, 5.0])
    body = message[HEADER:]
    body[:m.n_params] = gradient
    if buffers is not None:
        body[m.n_params:m.n_params + m.n_buffers] = buffers
    head = body[m.n_params + m.n_buffers:]
    head[:n * m.n_features] = features.reshape(-1)
    head[m.batch * m.n_features:][:n] = labels.float()
    return message


def test_async_rules_without_an_option_is_the_mains_rule_reply_for_reply(monkeypatch):
    """bench/async_rules.py restates the main's `Server.update` with its options: with none,
    it must reply with, and end on, exactly the parameters the main's server does, over a
    sequence of 3 workers' gradients arriving 0 to 3 updates stale (so that some are pulled),
    the head fresh, BatchNorm statistics beside them, the learning rate warming up."""
    sent = []
    monkeypatch.setattr(async_sgd_cifar100.dist, "isend",
                        lambda tensor, dst: sent.append((dst, tensor.clone())) or _Done())
    flags = ["--lr", "0.2", "--epochs", "2", "--batch-size", "12"]
    main = async_sgd_cifar100.Server(_model(), 3, async_sgd_cifar100.parse_args(flags), None,
                                     None, State(), 10, [0, 0, 0], None)
    variant = async_rules.VariantServer(_model(), 3, async_rules.parse_args(flags), None, None,
                                        State(), 10, [0, 0, 0], None)
    assert torch.equal(main.theta, variant.theta)
    torch.manual_seed(1)
    for worker in (1, 2, 3, 1, 3, 2, 2, 1, 1, 3, 2, 3):
        n = int(torch.randint(1, 5, ()))  # up to its batch, 12 / 3
        message = _message(main, torch.randn(23), torch.randn(n, 4), torch.randint(0, 3, (n,)),
                           torch.rand(8))
        for server in (main, variant):
            server.apply(worker, message.clone())
            server.reply(worker, CONTINUE, {1, 2, 3})
        (to_main, from_main), (to_variant, from_variant) = sent[-2:]
        assert to_main == to_variant == worker
        assert torch.equal(from_main, from_variant), worker
        assert torch.equal(main.theta, variant.theta), worker
    assert main.epoch.staleness == variant.epoch.staleness == [0, 1, 2, 2, 1, 3, 0, 3, 0, 4, 3,
                                                                1]
    assert main.epoch.pulled == variant.epoch.pulled == 6
    for server in (main, variant):  # what evaluation and the checkpoint see
        server.average_statistics()
    assert all(torch.equal(a, b) for a, b in zip(main.model.state_dict().values(),
                                                  variant.model.state_dict().values()))


def test_async_rules_compensates_a_stale_gradient_for_the_updates_it_missed(monkeypatch):
    """--dc-lambda L.  Two workers start from theta_0.  Worker 1's first gradient is not stale
    and is applied as it is; worker 2's (computed at theta_0) is one update stale, and so is
    worker 1's second (computed at theta_1, the reply to its first).  The server moves each to
    the current parameters by delay compensation, g + L g^2 (theta - theta_sent) /
    sqrt(mean g^2), then takes the Nesterov step with that worker's own buffer."""
    monkeypatch.setattr(async_sgd_cifar100.dist, "isend", lambda tensor, dst: _Done())
    server, args = _variant(2.0, "--ahead", "0")  # replies: the parameters as they are
    theta0 = server.theta.clone()
    g1, g2, g3 = (torch.randn_like(theta0) for _ in range(3))
    decay = _decay(args)
    lr = server.lr(server.version)
    server.apply(1, _message(server, g1.clone()))
    server.reply(1, CONTINUE, {1, 2})
    v1 = g1 + decay * theta0
    theta1 = theta0 - lr * (v1 + 0.9 * v1)
    assert torch.allclose(server.theta, theta1, atol=1e-7)
    lr = server.lr(server.version)
    server.apply(2, _message(server, g2.clone()))
    server.reply(2, CONTINUE, {1, 2})
    mean_square = 0.95 * 0.05 * g1 * g1 + 0.05 * g2 * g2
    v2 = g2 + 2.0 * g2 * g2 * (theta1 - theta0) / (mean_square.sqrt() + 1e-7) + decay * theta1
    theta2 = theta1 - lr * (v2 + 0.9 * v2)
    assert torch.allclose(server.theta, theta2, atol=1e-6), (server.theta - theta2).abs().max()
    lr = server.lr(server.version)
    server.apply(1, _message(server, g3.clone()))
    mean_square = 0.95 * mean_square + 0.05 * g3 * g3
    d = g3 + 2.0 * g3 * g3 * (theta2 - theta1) / (mean_square.sqrt() + 1e-7) + decay * theta2
    v1 = 0.9 * v1 + d
    theta3 = theta2 - lr * (d + 0.9 * v1)
    assert torch.allclose(server.theta, theta3, atol=1e-6), (server.theta - theta3).abs().max()
    plain, _ = _variant(0, "--ahead", "0")  # --dc-lambda 0: the stale gradient as it came
    plain.apply(1, _message(plain, g1.clone()))
    plain.apply(2, _message(plain, g2.clone()))
    assert (plain.theta - theta2).abs().max() > 1e-3


def test_async_rules_replies_with_the_parameters_extrapolated_over_the_updates_in_flight(
        monkeypatch):
    """--ahead K.  With N workers a gradient arrives about N - 1 updates after its parameters
    left, and meanwhile the parameters move mostly along the momentum (lr / N * v_j per update,
    v_j worker j's buffer).  So the reply is theta - K * lr / N * mean_j v_j, K = N - 1 by
    default (0: theta as it is); the server's own theta is not moved by it."""
    sent = []
    monkeypatch.setattr(async_sgd_cifar100.dist, "isend",
                        lambda tensor, dst: sent.append((dst, tensor.clone())) or _Done())
    for workers, flags, ahead in ((2, (), 1.0), (4, (), 3.0), (4, ("--ahead", "5"), 5.0),
                                  (4, ("--ahead", "0"), 0.0)):
        server, args = _variant(0, *flags, workers=workers)
        reference, _ = _variant(0, "--ahead", "0", workers=workers)
        decay = _decay(args)
        v = torch.zeros(workers, 23)
        for step, worker in enumerate([1, 2, 1, workers]):
            g = torch.randn(23)
            theta = server.theta.clone()
            lr = server.lr(server.version)
            server.apply(worker, _message(server, g.clone()))
            reference.apply(worker, _message(reference, g.clone()))
            d = g + decay * theta
            v[worker - 1] = 0.9 * v[worker - 1] + d
            assert torch.allclose(server.theta, theta - lr * (d + 0.9 * v[worker - 1]),
                                  atol=1e-6)
            assert torch.equal(server.theta, reference.theta)  # the rule itself is unchanged
            server.reply(worker, CONTINUE, set(range(1, workers + 1)))
            expected = server.theta - ahead * server.lr(server.version) / workers * v.sum(0)
            assert sent[-1][0] == worker
            assert torch.allclose(sent[-1][1][1:], expected, atol=1e-6), (workers, step)
            if step:
                assert ahead == 0 or (sent[-1][1][1:] - server.theta).abs().max() > 1e-4


def test_async_rules_pull_centered_measures_the_gap_beyond_the_expected_drift(monkeypatch):
    """--pull-centered: the pull's gap is measured from where the reply's forecast puts the
    parameters by the time the gradient comes back -- the reply plus K - s updates along the
    mean buffer for a gradient s updates stale (--ahead K) -- so that, when the updates in
    flight move the parameters as forecast, the pull moves nothing.  Three workers, --ahead 4,
    the order 1, 2, 3, 1, 3, 2, 2 (staleness 0, 1, 2, 2, 1, 3, 0): K - s is never 0."""
    sent = {}
    monkeypatch.setattr(async_sgd_cifar100.dist, "isend",
                        lambda tensor, dst: sent.update({dst: tensor[1:].clone()}) or _Done())
    server, args = _variant(0, "--pull", "0.6", "--pull-from", "0", "--ahead", "4",
                            "--pull-centered", workers=3)
    decay = _decay(args)
    held = {w: server.theta.clone() for w in (1, 2, 3)}
    v = torch.zeros(3, 23)
    torch.manual_seed(1)
    for worker, staleness in zip((1, 2, 3, 1, 3, 2, 2), (0, 1, 2, 2, 1, 3, 0)):
        g, theta, lr = torch.randn(23), server.theta.clone(), server.lr(server.version)
        forecast = held[worker] + (4 - staleness) * lr * v.mean(0)  # before this update
        server.apply(worker, _message(server, g.clone()))
        assert server.epoch.staleness[-1] == staleness
        d = g + decay * theta
        v[worker - 1] = 0.9 * v[worker - 1] + d
        expected = theta - lr * (d + 0.9 * v[worker - 1]) - 0.2 * (theta - forecast)
        assert torch.allclose(server.theta, expected, atol=1e-6), \
            (worker, staleness, (server.theta - expected).abs().max())
        # the centring is seen: the gap from the reply alone differs from it
        assert staleness == 0 and worker != 2 or (forecast - held[worker]).abs().max() > 1e-3
        server.reply(worker, CONTINUE, {1, 2, 3})
        held[worker] = sent[worker]

    # When the drift is as forecast, the centred pull moves next to nothing, the pull from the
    # reply a lot: one gradient for every update, the turns in order (each gradient N - 1 = 2
    # updates stale, the reply K = 4 ahead); the buffers build up over the first rounds
    def run(*flags):
        server = _variant(0, "--ahead", "4", "--weight-decay", "0", "--epochs", "30", *flags,
                          workers=3)[0]
        g = torch.randn(23)
        for worker in (1, 2, 3) * 60:
            server.apply(worker, _message(server, g.clone()))
            server.reply(worker, CONTINUE, {1, 2, 3})
        return server.theta
    plain = run("--pull", "0")
    centred = run("--pull", "0.6", "--pull-from", "0", "--pull-centered")
    from_reply = run("--pull", "0.6", "--pull-from", "0")
    assert (centred - plain).abs().max() < 0.1 * (from_reply - plain).abs().max()


def test_async_rules_in_turn_replies_from_theta_as_it_is_when_no_worker_computes(monkeypatch):
    """--in-turn --ahead 0, the loop driven message by message: each reply is held until no
    other worker computes, then sent with the parameters as they are at that moment (not as
    they were after that worker's own update); only the first round's second gradient is
    stale; a worker done releases the next in line."""
    events, replies = [], []

    def isend(tensor, dst):
        events.append(f"reply {dst}")
        replies.append((tensor[1:].clone(), server.theta.clone()))
        return _Done()

    monkeypatch.setattr(async_sgd_cifar100.dist, "isend", isend)
    monkeypatch.setattr(async_sgd_cifar100.dist, "send", lambda tensor, dst: None)  # release

    class Inbox:  # each worker sends 2 gradients, each after its reply, then DONE
        def __init__(self, workers, *rest):
            self.ready, self.left = list(workers), {w: 2 for w in workers}

        def next(self):
            worker = self.ready.pop(0)
            self.left[worker] -= 1
            events.append(f"{'done' if self.left[worker] < 0 else 'gradient'} {worker}")
            if self.left[worker] < 0:
                return worker, torch.tensor([DONE, 2.0, 0.0, 0.0]), None
            return worker, _message(server, torch.randn(23)), None

        def expect(self, worker):
            self.ready.append(worker)

    monkeypatch.setattr(async_rules, "Inbox", Inbox)
    monkeypatch.setattr(async_rules, "Heartbeat", lambda timeout: SimpleNamespace(
        stop=lambda: None))
    run = SimpleNamespace(log=lambda *parts: None, stop=SimpleNamespace(signum=None))
    server, _ = _variant(0, "--in-turn", "--ahead", "0", run=run)
    server.end_epoch = lambda: None  # no test set here
    server.serve()
    assert events == ["gradient 1", "gradient 2", "reply 1", "gradient 1", "reply 2",
                      "gradient 2", "reply 1", "done 1", "reply 2", "done 2"]
    assert all(torch.equal(sent, theta) for sent, theta in replies)
    assert server.epoch.staleness == [0, 1, 0, 0]


def test_async_rules_in_turn_computes_every_gradient_on_the_current_parameters(tmp_path):
    """--in-turn --ahead 0, the no-staleness control, in a real run of 2 workers: only the first
    round's gradients are stale (the second to arrive by 1 update), each batch is applied once,
    the run ends, and config.json records the options."""
    out = tmp_path / "in_turn"
    proc = subprocess.run(
        [MPIRUN, "-np", "3", sys.executable, os.path.join("bench", "async_rules.py"),
         "--in-turn", "--ahead", "0", "--dummy", "--train-limit", "64", "--test-limit", "32",
         "--batch-size", "16", "--epochs", "1", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    log = "\n".join(ok(proc))
    # 64 samples over 2 workers, batch 8 each: 4 updates per worker, 8 in the epoch
    assert "worker 1: 4 gradients sent, 4 applied" in log
    assert "worker 2: 4 gradients sent, 4 applied" in log
    with open(out / "metrics.csv") as f:
        header, row = [line.split(",") for line in f.read().splitlines()]
    row = dict(zip(header, row))
    assert int(row["updates"]) == 8
    assert math.isclose(float(row["mean_staleness"]), 1 / 8, abs_tol=1e-5)
    assert int(row["max_staleness"]) == 1
    options = json.loads((out / "config.json").read_text())["args"]
    assert options["in_turn"] is True and options["ahead"] == 0.0 and options["pull"] == 0.2


def test_async_rules_refuses_a_bad_option_in_one_line(capsys):
    """Negative or non-finite values, and a pull beyond 1 (it would overshoot the gap over a
    round of N updates): one line and exit 2, before anything starts."""
    one_error_line(subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "async_rules.py"), "--pull", "1.5"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT),
        "--pull 1.5", "more than 1")
    for argv, needle in ((["--dc-lambda", "-1"], "--dc-lambda -1 is negative"),
                         (["--ahead", "nan"], "--ahead nan is not a number"),
                         (["--ahead", "inf"], "--ahead inf is not a number"),
                         (["--pull-from", "-2"], "--pull-from -2 is negative"),
                         (["--pull", "-0.1"], "--pull -0.1 is negative"),
                         (["--pull-from", "x"], "argument --pull-from: invalid int value")):
        with pytest.raises(SystemExit) as stopped:
            execute(lambda: async_rules.main(["--dummy", *argv]))
        lines = capsys.readouterr().err.strip().splitlines()
        assert stopped.value.code == 2 and len(lines) == 1 and needle in lines[0], (argv, lines)


def test_tiny_to_cifar_validation_split_holds_out_training_photos_only(monkeypatch, tmp_path):
    """--validation N, for choosing a recipe without the test set: its test pickle is the last N
    of each class's training photos, its train pickle the others, no photo in both, and no
    photo of the real test (val) set anywhere."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    from tiny_to_cifar import convert
    from common import data
    from tests.datagen import make_tinyimagenet
    make_tinyimagenet(tmp_path / "d", n_classes=101, n_train_per_class=5, n_val_per_class=2)
    convert(tmp_path / "d", tmp_path / "c", per_class_train=5, validation=2)
    train, held = data.read_cifar100(tmp_path / "c", True), data.read_cifar100(tmp_path / "c",
                                                                             False)
    assert train.labels.tolist() == [k // 3 for k in range(300)]
    assert held.labels.tolist() == [k // 2 for k in range(200)]
    files, val, _ = data.tinyimagenet_files(tmp_path / "d")
    class_0 = [path for path, label in files if label == 0]
    names = {}
    for split in ("train", "test"):
        with open(tmp_path / "c" / "cifar-100-python" / split, "rb") as f:
            names[split] = [n.decode() for n in pickle.load(f, encoding="bytes")[b"filenames"]]
    assert names["test"][:2] == [os.path.basename(p) for p in class_0[3:5]]
    assert names["train"][:3] == [os.path.basename(p) for p in class_0[:3]]
    assert not set(names["train"]) & set(names["test"])
    assert not {os.path.basename(p) for p, _ in val} & set(names["test"])
