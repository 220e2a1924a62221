"""Benchmark 5 (`convergence`): does async SGD learn as well as sync SGD, on data that is hard
to learn?

Trains on the yardstick (tests/yardstick.py: 100 classes of shape x texture x colour under
clutter and noise, written in the CIFAR-100 pickle layout) with the real scripts, as a user
runs them:

* one process          python resnet_cifar100.py
* sync SGD             mpirun -np R python sync_sgd_cifar100.py            R = 2, 4, 8
* async SGD            mpirun -np W+1 python async_sgd_cifar100.py         W = 1, 2, 4, 8

all with the same epochs, samples, global batch (--batch-size) and learning rate, and
without TrivialAugment (its colour operations rewrite the yardstick's colour, a third of each
class; --flags "--auto-augment ta_wide" puts it back), over several seeds (--seed: initial
weights, data order, augmentation, dropout; the data set is the same).  It prints the test
accuracy per epoch (mean over seeds), the final accuracy's mean and spread, the async runs'
mean and max staleness, and the gap of each async run to
sync SGD with as many ranks as it has workers (W = 1: the one process), with its standard
error over the seeds: with batch / N samples per process, BatchNorm sees the same batch size
in both.  Every process gets cores / processes threads; on 2 cores a full run takes about 80
minutes (quiet), --quick (one seed, a smaller yardstick) about 25 minutes.

On a GPU machine: --device cuda --launcher torchrun --parallel K trains K runs at once, every
rank of every run on the one GPU (over gloo: nccl takes one rank per GPU), so that many seeds
fit in a few minutes; its figures are a machine kind of their own (--merge keeps them apart).

--async-flags "..." adds flags to the async runs; where they hold an option of the update rule
(--pull, --ahead, ...: bench/async_rules.py), those runs are `bench/async_rules.py` instead.

--real DIR trains on real photos instead: the folder DIR/tiny-imagenet-200 made CIFAR-100-shaped
by bench/tiny_to_cifar.py (its first 100 classes, 32x32), of each class the first
n_train / 100 training and n_test / 100 validation images in file order.  --straggler SECONDS
adds a pair with rank 1 made slow (--straggler-delay: SECONDS of sleep after each of its steps):
async with 2 workers against sync on 2 ranks under the same delay.
"""
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from util import REPO_ROOT, SMOKE, TESTS_DIR, log, mpirun, out_of_time, set_budget, table

# lr 0.15: on the plateau of one process's accuracy (the staleness simulator, since removed,
# seed 0: 25.9 % at 0.05, 37.3 % at 0.075, 45.5 % at 0.1, 45.0 % at 0.15); 0.05, used before,
# left every run short of steps and measured that more than the update rule (BENCHMARKS.md,
# benchmark 5).
FULL = dict(n_train=6400, n_test=2000, epochs=6, batch=64, lr=0.15, seeds=(0, 1, 2),
            sync=(2, 4, 8), workers=(1, 2, 4, 8))
# --quick and the smoke sizes keep lr 0.05: not swept (their numbers check the code paths
# and a first look, not the bar); the smoke runs two seeds for the standard-error path.
QUICK = dict(n_train=3200, n_test=1000, epochs=4, batch=32, lr=0.05, seeds=(0,),
             sync=(2, 4), workers=(2, 4, 8))
SMOKE_SIZES = dict(n_train=256, n_test=128, epochs=1, batch=32, lr=0.05, seeds=(0, 1),
                   sync=(2,), workers=(2,))
# what --merge requires alike in every file, with the value of a run that did not use it (the
# files written before the flag existed lack it)
RECIPE = dict(n_train=None, n_test=None, epochs=None, batch=None, lr=None, flags=[],
              async_flags=[], real=None)


def make_yardstick(root, n_train, n_test, real=None):
    """The data set in the CIFAR-100 layout in `root`: the yardstick, or real photos from the
    TinyImageNet tree in `real`."""
    if real:
        from tiny_to_cifar import convert
        convert(real, root, 100, n_train // 100, n_test // 100)
        return root
    sys.path.insert(0, TESTS_DIR)
    from yardstick import make_cifar100_yardstick
    make_cifar100_yardstick(root, n_train, n_test, seed=0)
    return root


def threads(processes, cfg):
    """Each process's share of the cores, with --parallel runs at once."""
    return str(max(1, (os.cpu_count() or 1) // (processes * cfg.get("parallel", 1))))


def command(kind, processes, data_dir, out, cfg, seed, extra=()):
    device = cfg.get("device", "cpu")
    flags = ["--data-dir", data_dir, "--out", out, "--epochs", str(cfg["epochs"]),
             "--batch-size", str(cfg["batch"]), "--lr", str(cfg["lr"]), "--seed", str(seed),
             "--device", device, "--fresh", "--auto-augment", "none"]  # (--flags may change it)
    if device == "cuda" and kind == "sync":
        flags += ["--backend", "gloo"]  # the ranks share the GPU; nccl wants one each
    flags += cfg.get("flags", []) + list(extra)
    if kind == "async":
        flags += cfg.get("async_flags", [])
    if kind == "one process":
        return [sys.executable, os.path.join(REPO_ROOT, "resnet_cifar100.py"), *flags]
    from async_rules import uses_options
    script = os.path.join(REPO_ROOT, "sync_sgd_cifar100.py" if kind == "sync" else
                          "bench/async_rules.py" if uses_options(cfg.get("async_flags", []))
                          else "async_sgd_cifar100.py")
    if cfg.get("launcher") == "torchrun":  # where there is no MPI (threads: the environment's)
        from common.network import free_port
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(processes), "--master-port", str(free_port()), script, *flags]
    return [mpirun(), "-np", str(processes), "--oversubscribe", "--bind-to", "none",
            "-x", f"OMP_NUM_THREADS={threads(processes, cfg)}", "-x", "PYTHONPATH",
            sys.executable, script, *flags]


def train(kind, processes, data_dir, cfg, seed, extra=()):
    """One run; its metrics.csv rows and wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as out:
        env = dict(os.environ, PYTHONPATH=REPO_ROOT,
                   OMP_NUM_THREADS=threads(processes, cfg))
        if os.geteuid() == 0:  # Open MPI refuses root unless told
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        start = time.perf_counter()
        proc = subprocess.run(command(kind, processes, data_dir, out, cfg, seed, extra),
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=4 * 3600)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} on {processes} processes, seed {seed}: exit "
                               f"{proc.returncode}\n{(proc.stdout + proc.stderr)[-2000:]}")
        with open(os.path.join(out, "metrics.csv")) as f:
            rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return rows, wall


def machine(flags=(), device="cpu"):
    """What moves a run besides its seed: the CPU (or GPU), the torch build and the precision
    the scripts compute in (bf16 autocast on GPUs and on CPUs with native bf16, fp32
    elsewhere, unless `flags` say --amp or --no-amp). The CPU's kind counts even in fp32: the
    same build's kernels differ between CPUs with and without AVX-512, and so does a seed's
    run."""
    import torch
    from util import cpu_flags, cpu_model, default_amp, precision_name
    amp = default_amp(device)
    for flag in flags:
        amp = {"--amp": True, "--no-amp": False}.get(flag, amp)
    found = {"cpu": cpu_model(), "torch": torch.__version__, "precision": precision_name(amp),
             "avx512": any(f.startswith("avx512") for f in cpu_flags())}
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def runs(cfg):
    """(name, kind, processes, reference name, flags of its own) of every configuration."""
    out = [("one process", "one process", 1, None, ())]
    out += [(f"sync, {r} ranks", "sync", r, None, ()) for r in cfg["sync"]]
    largest = f"sync, {max(cfg['sync'])} ranks"
    for w in cfg["workers"]:
        ref = "one process" if w == 1 else (f"sync, {w} ranks" if w in cfg["sync"] else largest)
        out.append((f"async, {w} worker{'s' * (w > 1)}", "async", w + 1, ref, ()))
    if cfg.get("straggler"):  # rank 1 (async: worker 1) slowed alike in both
        slow = ("--straggler-delay", str(cfg["straggler"]))
        out += [("sync, 2 ranks, rank 1 slow", "sync", 2, None, slow),
                ("async, 2 workers, worker 1 slow", "async", 3, "sync, 2 ranks, rank 1 slow",
                 slow)]
    return out


def summary(results):
    """Per configuration: mean per-epoch accuracy, final mean / min / max, staleness."""
    out = {}
    for name, per_seed in results.items():
        finals = [rows[-1]["test_acc"] for rows in per_seed.values()]
        train_losses = [rows[-1]["train_loss"] for rows in per_seed.values()]
        # the share of updates the rule pulled back (runs recorded before the column have none)
        pulled = [r["pulled"] for rows in per_seed.values() for r in rows if "pulled" in r]
        epochs = len(next(iter(per_seed.values())))
        out[name] = {
            "final_mean": statistics.mean(finals), "final_min": min(finals),
            "final_max": max(finals), "finals": finals,
            "final_train_loss": statistics.mean(train_losses), "train_losses": train_losses,
            "curve": [statistics.mean(rows[e]["test_acc"] for rows in per_seed.values())
                      for e in range(epochs)],
            "mean_staleness": statistics.mean(
                r.get("mean_staleness", 0.0) for rows in per_seed.values() for r in rows),
            "max_staleness": max(r.get("max_staleness", 0.0)
                                 for rows in per_seed.values() for r in rows),
            "pulled": statistics.mean(pulled) if pulled else None,
            "train_loss_after_first": max(r["train_loss"] for rows in per_seed.values()
                                          for r in rows[1:]) if epochs > 1 else None,
        }
    return out


def gap_error(finals, reference):
    """The standard error of the difference of two means over seeds (None below 2 seeds):
    a gap smaller than about twice it is not resolved by this many seeds."""
    if len(finals) < 2 or len(reference) < 2:
        return None
    return math.sqrt(statistics.variance(finals) / len(finals) +
                     statistics.variance(reference) / len(reference))


def partial_path(json_path=None):
    """Where the runs done so far are kept: beside --json F (F's name with .partial.json), so
    that calls side by side (say one per variant of the rule) keep apart; without --json, in
    bench/results/."""
    if json_path:
        return os.path.splitext(json_path)[0] + ".partial.json"
    return os.path.join(REPO_ROOT, "bench", "results", "convergence_partial.json")


def save_partial(results, path):
    """The runs done so far, so that hours of training survive a killed benchmark."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({name: {str(k): v for k, v in per_seed.items()}
                   for name, per_seed in results.items()}, f, indent=1)
    os.replace(path + ".tmp", path)


def gap(stats, name, ref, key, digits):
    """'+gap ± its standard error' of `key` (a list per seed) between two runs, or None."""
    if ref not in stats:
        return None
    ours, theirs = stats[name][key], stats[ref][key]
    error = gap_error(ours, theirs)
    return (f"{statistics.mean(ours) - statistics.mean(theirs):+.{digits}f}" +
            ("" if error is None else f" ± {error:.{digits}f}"))


def report(cfg, stats, walls, names):
    """Print the table from `summary`'s `stats`: per run, the accuracy per epoch and the final
    one (mean over seeds), its spread, the final training loss, the gaps to sync in both with
    their standard errors, staleness.  The training loss's gap is the steadier measure of how
    well a rule optimises."""
    references = {name: ref for name, _, _, ref, _ in runs(cfg)}
    header = ["run", *[f"epoch {e + 1}" for e in range(cfg["epochs"])], "final mean",
              "min", "max", "seeds", "train loss", "gap to sync", "train loss gap",
              "staleness mean", "max", "pulled %", "wall s"]
    lines = []
    for name in names:
        if name not in stats:
            continue
        s, ref = stats[name], references[name]
        accuracy_gap = gap(stats, name, ref, "finals", 2)
        lines.append([name, *[round(a, 2) for a in s["curve"]], round(s["final_mean"], 2),
                      round(s["final_min"], 2), round(s["final_max"], 2), len(s["finals"]),
                      round(s["final_train_loss"], 3),
                      None if accuracy_gap is None else f"{accuracy_gap} ({ref})",
                      gap(stats, name, ref, "train_losses", 3),
                      round(s["mean_staleness"], 2) if ref else None,
                      int(s["max_staleness"]) if ref else None,
                      None if s["pulled"] is None else round(100 * s["pulled"], 1),
                      round(statistics.mean(walls[name])) if walls.get(name) else None])
    # runs skipped by --budget (or failed) leave fewer seeds than were asked
    asked, ran = len(cfg["seeds"]), {len(stats[name]["finals"]) for name in names
                                     if name in stats}
    over = (f"{asked} seed(s)" if ran == {asked} else
            f"the seeds each run finished (column 'seeds'), of {asked} asked")
    data = "real photos (TinyImageNet as CIFAR-100)" if cfg.get("real") else "the yardstick"
    log(table(f"Convergence on {data}: test accuracy (%) per epoch, mean over {over}",
              header, lines))


def merge(paths):
    """One table from several --json files of the same yardstick and recipe (more seeds, run
    at different times): each run's seeds are pooled.  The straggler pair may come from some
    of the files only, at one delay."""
    cfg, results = None, {}
    for path in paths:
        try:
            with open(path) as f:
                part = json.load(f)
            recipe = {k: part["config"].get(k, unused) for k, unused in RECIPE.items()}
            delay = part["config"].get("straggler")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            what = (f"cannot read it ({exc.strerror})" if isinstance(exc, OSError)
                    else "not a --json file of this script")
            raise SystemExit(f"--merge: {path}: {what}; name the files its --json wrote") from None
        here = {k: part["config"].get("machine", {}).get(k)
                for k in ("torch", "precision", "avx512", "gpu")}
        if cfg is None:
            cfg, first, first_machine = dict(part["config"]), recipe, here
        elif recipe != first:
            raise SystemExit(f"--merge: {path} ran {recipe}, {paths[0]} ran {first}; merge "
                             "only runs of the same yardstick and recipe")
        elif here != first_machine:  # another precision is another experiment, not a seed
            raise SystemExit(f"--merge: {path} ran on {here}, {paths[0]} on {first_machine}; "
                             "merge only runs of the same torch build, precision and CPU or "
                             "GPU kind")
        if delay is not None:  # the table holds the pair from the files that ran it
            if cfg.get("straggler") not in (None, delay):
                raise SystemExit(f"--merge: {path} slowed rank 1 by {delay} s, an earlier file "
                                 f"by {cfg['straggler']} s; merge only one --straggler delay")
            cfg["straggler"] = delay
        for name, run_ in part["runs"].items():
            for seed, rows in run_["per_seed"].items():
                if int(seed) in results.get(name, {}):
                    raise SystemExit(f"--merge: {name}, seed {seed} is in two files "
                                     f"(again in {path}); keep one")
                results.setdefault(name, {})[int(seed)] = rows
    cfg["seeds"] = sorted({seed for per_seed in results.values() for seed in per_seed})
    log(f"[5] merged {len(paths)} files: " + (
        f"{first_machine['precision']}, torch {first_machine['torch']}"
        if first_machine["precision"] else "machine not recorded (files from before it was)"))
    stats = summary(results)
    report(cfg, stats, {}, [name for name, *_ in runs(cfg)])
    return {"config": cfg, "runs": {name: {"per_seed": {str(k): v for k, v in per_seed.items()}}
                                    for name, per_seed in results.items()},
            "summary": stats}


def run(quick, names=None, seeds=None, async_flags=(), epochs=None, flags=(), device="cpu",
        launcher="mpirun", parallel=1, partial=None, real=None, straggler=None):
    """The whole benchmark, or the runs called `names` (as in its table) over `seeds`, every
    run with `flags` added (another recipe) and the async runs with `async_flags` too (a
    rule's variant), for `epochs` if given; on `device`, started by `launcher`, `parallel`
    runs at a time; the runs done so far kept in `partial` (default: partial_path()); on real
    photos from the TinyImageNet tree in `real`; with the pair slowed by `straggler` s."""
    partial = partial or partial_path()
    cfg = dict(SMOKE_SIZES if SMOKE else (QUICK if quick else FULL))
    cfg["seeds"] = tuple(seeds or cfg["seeds"])
    cfg["epochs"] = epochs or cfg["epochs"]
    cfg["async_flags"] = list(async_flags)
    cfg["flags"] = list(flags)
    cfg.update(device=device, launcher=launcher, parallel=parallel, real=real,
               straggler=straggler)
    cfg["machine"] = machine(cfg["flags"], device)
    chosen = [r for r in runs(cfg) if names is None or r[0] in names]
    if names is not None and len(chosen) != len(names):
        raise SystemExit(f"--runs: choose among {[r[0] for r in runs(cfg)]}")
    results, walls = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-yardstick-") as data_dir:
        make_yardstick(data_dir, cfg["n_train"], cfg["n_test"], real)
        log(f"[5] {'real photos' if real else 'yardstick'}: {cfg['n_train']} training / "
            f"{cfg['n_test']} test images, 100 "
            f"classes; {cfg['epochs']} epochs, global batch {cfg['batch']}, lr {cfg['lr']}, "
            f"seeds {list(cfg['seeds'])}; {cfg['machine']['precision']} on "
            f"{cfg['machine']['cpu']}, torch {cfg['machine']['torch']}" +
            (f", every run with {' '.join(cfg['flags'])}" if cfg["flags"] else "") +
            (f", async runs with {' '.join(cfg['async_flags'])}" if cfg["async_flags"] else "") +
            (f"; {cfg['machine']['gpu']}, {parallel} runs at a time" if device == "cuda" else ""))
        lock = threading.Lock()

        def one(seed, name, kind, processes, extra):
            if out_of_time(120):
                log(f"[5] {name}, seed {seed}: skipped (--budget)")
                return
            try:
                rows, wall = train(kind, processes, data_dir, cfg, seed, extra)
            except RuntimeError as exc:
                if parallel == 1:
                    raise
                log(f"[5] {name}, seed {seed}: failed, left out: {exc}")  # the others go on
                return
            with lock:
                results.setdefault(name, {})[seed] = rows
                walls.setdefault(name, []).append(wall)
                log(f"[5] {name}, seed {seed}: final test accuracy "
                    f"{rows[-1]['test_acc']:.2f}% ({wall:.0f} s)")
                save_partial(results, partial)

        # every configuration once per seed, in turn (so that a seed's runs end together)
        jobs = [(seed, name, kind, processes, extra) for seed in cfg["seeds"]
                for name, kind, processes, _, extra in chosen]
        with ThreadPoolExecutor(parallel) as pool:
            for done in [pool.submit(one, *job) for job in jobs]:
                done.result()
        results = {name: dict(sorted(per_seed.items())) for name, per_seed in results.items()}
    stats = summary(results)
    report(cfg, stats, walls, [name for name, *_ in chosen])
    return {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
            "runs": {name: {"per_seed": {str(k): v for k, v in per_seed.items()}}
                     for name, per_seed in results.items()},
            "summary": stats}


if __name__ == "__main__":  # some runs alone, e.g. to try a variant of the async rule
    import argparse
    p = argparse.ArgumentParser(description="Benchmark 5, some of its runs (bench/run.py "
                                "--only convergence runs it whole and records the machine)")
    p.add_argument("--runs", nargs="+", metavar="NAME",
                   help='runs by their name in the table, e.g. "async, 2 workers"')
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--epochs", type=int, help="instead of the benchmark's (a longer budget)")
    p.add_argument("--async-flags", default="", help='added to the async runs, e.g. '
                   '"--pull 0.4" (an option of the rule: they run bench/async_rules.py)')
    p.add_argument("--flags", default="", help='added to every run, e.g. "--momentum 0.95"')
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every rank computes (cuda: all on GPU 0)")
    p.add_argument("--launcher", choices=["mpirun", "torchrun"], default="mpirun",
                   help="what starts the ranks (torchrun: where there is no MPI)")
    p.add_argument("--parallel", type=int, default=1, metavar="K",
                   help="runs at a time (each process gets cores / (processes x K) threads)")
    p.add_argument("--budget", type=float, default=0, metavar="SECONDS",
                   help="start no run after this many seconds less two minutes (0: no limit)")
    p.add_argument("--json", metavar="PATH", help="write the results here (the runs done so "
                   "far are kept in PATH's name with .partial.json until then)")
    p.add_argument("--real", metavar="DIR", help="real photos: the folder holding "
                   "tiny-imagenet-200/, made CIFAR-100-shaped (bench/tiny_to_cifar.py)")
    p.add_argument("--straggler", type=float, metavar="SECONDS", help="add sync on 2 ranks and "
                   "async with 2 workers, rank 1 sleeping SECONDS after each step")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="train nothing: one table from "
                   "these --json files (the same recipe; more seeds, run at different times)")
    a = p.parse_args()
    set_budget(a.budget)
    partial = None if a.merge else partial_path(a.json)  # a merge trains nothing
    if a.merge:
        result = merge(a.merge)
    else:
        result = run(a.quick, a.runs, a.seeds, a.async_flags.split(), a.epochs, a.flags.split(),
                     a.device, a.launcher, max(1, a.parallel), partial, a.real, a.straggler)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        if partial and os.path.exists(partial):
            os.remove(partial)  # all of it is in PATH now
