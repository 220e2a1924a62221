"""Run the benchmarks of the HW4 ResNet project; print tables and write them all as JSON.

    python bench/run.py             # everything (about 10 minutes on 2 idle CPU cores)
    python bench/run.py --quick     # fewer steps and worker counts (about 2 minutes idle)
    python bench/run.py --only step,exchange --json out.json

1. step      training step: our loop vs the batch in place vs torchvision's per-sample
             pipeline; the data path alone; fp32 / channels_last / bf16 on CPU
2. exchange  sync SGD gradient exchange: ours (one flat all_reduce after backward) vs a bucketed
             all_reduce overlapped with backward vs DDP vs one blocking all_reduce per
             parameter, 2 and 4 ranks (gloo; nccl with >= 2 GPUs)
3. ps        async SGD parameter server: updates/s and busy fraction, 1..8 workers; a slow
             worker's cost to the run's length
4. gpu       CUDA only: resnet_cifar100.py epoch time, fraction of bf16 peak, options
5. convergence  on the yardstick (data that is hard to learn): test accuracy per epoch of one
             process, sync SGD on 2, 4 and 8 ranks, async SGD with 1, 2, 4 and 8 workers
             (not part of the default run: about 80 minutes on 2 quiet cores; --quick: 25 minutes)

BENCHMARKS.md explains each and holds the results.  Timings are only as good as the machine's
quiet: the load average and how busy the CPUs were before each benchmark are recorded.
"""
import argparse
import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import util  # noqa: E402  (sets sys.path for the repository)
from util import Skip, log  # noqa: E402

BENCHMARKS = ("step", "exchange", "ps", "gpu", "convergence")
DEFAULT = ("step", "exchange", "ps", "gpu")  # convergence takes hours: ask for it by name


def parse_args(argv=None, only=None, doc=__doc__):
    """run.py's flags; `only`: the one benchmark a module run as a script is (no --only), `doc`
    that module's docstring (its --help)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, steps and workers")
    if only:
        p.set_defaults(only=only)
    else:
        p.add_argument("--only", default=",".join(DEFAULT),
                       help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    p.add_argument("--json", metavar="PATH",
                   help="where to write the results (default bench/results/<date>.json)")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers of the reference pipeline")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="skip what would not finish in this time (default: 510 with --quick, "
                        "so that it ends within 10 minutes even on a loaded machine; else none)")
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = 510.0 if args.quick else 0.0
    args.only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(args.only) - set(BENCHMARKS)
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}")
    return args


def run_benchmark(name, args):
    if name == "step":
        import training
        return training.run(args.quick, workers=args.workers)
    if name == "exchange":
        import exchange
        return exchange.run(args.quick)
    if name == "ps":
        import param_server
        return param_server.run(args.quick)
    if name == "gpu":
        import gpu
        return gpu.run(args.quick)
    if name == "convergence":
        import convergence
        return convergence.run(args.quick)
    raise ValueError(name)


def main(argv=None, only=None, doc=__doc__):
    """Run the benchmarks --only names (`only`, `doc`: the one a module run as a script is, and
    its docstring)."""
    args = parse_args(argv, only, doc)
    now = datetime.datetime.now()
    path = args.json or os.path.join(util.BENCH_DIR, "results",
                                     now.strftime("%Y-%m-%d_%H%M%S") + (
                                         "_quick" if args.quick else "") + ".json")
    machine = util.machine_info()
    log(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), CUDA "
        f"{'yes: ' + ', '.join(machine.get('gpus', [])) if machine['cuda_available'] else 'no'}")
    result = {"date": now.isoformat(timespec="seconds"), "quick": args.quick,
              "argv": sys.argv[1:], "machine": machine, "benchmarks": {}}
    total = time.perf_counter()
    util.set_budget(args.budget)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    failed = False
    for name in BENCHMARKS:
        if name not in args.only:
            continue
        if util.out_of_time(30):
            msg = f"skipped: the --budget of {args.budget:.0f} s is spent"
            log(f"\n=== {name}: {msg} ===")
            result["benchmarks"][name] = {"skipped": msg}
            continue
        before = util.load_snapshot()
        log(f"\n=== {name} | load average {before['loadavg']} | CPUs busy before start "
            f"{before['cpu_busy_while_idle']} ===")
        start = time.perf_counter()
        meter = util.OthersMeter()
        entry = {"load_before": before}
        try:
            entry["result"] = run_benchmark(name, args)
        except Skip as exc:
            entry["skipped"] = str(exc)
            log(f"skipped: {exc}")
        except Exception as exc:  # record it and go on with the next benchmark
            failed = True
            entry["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        entry["seconds"] = round(time.perf_counter() - start, 1)
        entry["tables"] = util.TABLES[:]
        util.TABLES.clear()
        entry["load_after"] = util.load_snapshot(sample_seconds=0)
        entry["others"] = meter.stop()
        others = entry["others"] or {}
        # other processes taking more than a tenth of the CPUs distort the timings
        entry["reliable"] = others.get("others_share_of_capacity", 0.0) <= 0.10
        result["benchmarks"][name] = entry
        log(f"=== {name}: {entry['seconds']:.0f} s | load average after "
            f"{entry['load_after']['loadavg']} | other processes used "
            f"{100 * others.get('others_share_of_capacity', float('nan')):.1f} % of the CPUs "
            f"meanwhile ===")
        if not entry["reliable"]:
            log(f"WARNING: other processes used more than 10 % of the CPUs during {name}: "
                "its timings are distorted; run it again on a quiet machine")
        save()
    result["total_seconds"] = round(time.perf_counter() - total, 1)
    save()
    log(f"\ntotal {result['total_seconds']:.0f} s; results written to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
