"""Run benchmarks one after another and write their results as one JSON file: the machine, and
around each benchmark the load, the time it took, its tables and how much of the CPUs other
processes used meanwhile.  bench/run.py runs them all through `main`; each benchmark run as a
script runs itself alone through it."""
import argparse
import datetime
import json
import os
import sys
import time
import traceback

import util
from util import Skip, log


def parse_args(argv, names, default, doc):
    """The flags: --only among `names` (default: `default`) where there are several; `doc` is
    the running script's docstring (its --help)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="fewer repetitions, steps and workers")
    if len(names) > 1:
        p.add_argument("--only", default=",".join(default),
                       help=f"comma-separated subset of {','.join(names)}")
    else:
        p.set_defaults(only=names[0])
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
    unknown = set(args.only) - set(names)
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}")
    return args


def run_one(name, benchmark, args):
    """Run `benchmark(args)`; its entry in the JSON: its result (or why it was skipped, or its
    error), seconds, tables, and the load before and after."""
    before = util.load_snapshot()
    log(f"\n=== {name} | load average {before['loadavg']} | CPUs busy before start "
        f"{before['cpu_busy_while_idle']} ===")
    start = time.perf_counter()
    meter = util.OthersMeter()
    entry = {"load_before": before}
    try:
        entry["result"] = benchmark(args)
    except Skip as exc:
        entry["skipped"] = str(exc)
        log(f"skipped: {exc}")
    except Exception as exc:  # record it and go on with the next benchmark
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
    log(f"=== {name}: {entry['seconds']:.0f} s | load average after "
        f"{entry['load_after']['loadavg']} | other processes used "
        f"{100 * others.get('others_share_of_capacity', float('nan')):.1f} % of the CPUs "
        f"meanwhile ===")
    if not entry["reliable"]:
        log(f"WARNING: other processes used more than 10 % of the CPUs during {name}: "
            "its timings are distorted; run it again on a quiet machine")
    return entry


def main(benchmarks, argv=None, default=None, doc=""):
    """Run those of `benchmarks` (name -> function of the parsed flags that returns its result)
    that --only names (default: the names in `default`, else all), in their order; write the
    JSON after each; 1 if one failed.  `doc`: the running script's docstring."""
    args = parse_args(argv, list(benchmarks), default or list(benchmarks), doc)
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

    for name, benchmark in benchmarks.items():
        if name not in args.only:
            continue
        if util.out_of_time(30):
            msg = f"skipped: the --budget of {args.budget:.0f} s is spent"
            log(f"\n=== {name}: {msg} ===")
            result["benchmarks"][name] = {"skipped": msg}
            continue
        result["benchmarks"][name] = run_one(name, benchmark, args)
        save()
    result["total_seconds"] = round(time.perf_counter() - total, 1)
    save()
    log(f"\ntotal {result['total_seconds']:.0f} s; results written to {path}")
    return 1 if any("error" in entry for entry in result["benchmarks"].values()) else 0
