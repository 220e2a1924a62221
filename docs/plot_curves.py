"""Draw the README's figure: test accuracy per epoch on the yardstick, one line per run.

    python bench/convergence.py --runs "one process" "sync, 2 ranks" "async, 2 workers" \
        "sync, 4 ranks" "async, 4 workers" --seeds 0 1 2 --json conv.json
    python docs/plot_curves.py conv.json              # writes docs/curves.png

Reads the JSON that `bench/convergence.py --json` (or `--merge`) writes, or the one of
`bench/run.py --json` that holds its convergence benchmark; each line is the mean over the
seeds of a run's test accuracy after each epoch, as the benchmark prints it.
"""
import argparse
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CLASSES = 100  # the yardstick's classes: chance is 1 %
COLORS = {1: "black", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}  # by ranks or workers


def convergence_result(doc):
    """The convergence result in `doc`: bench/convergence.py's own, or bench/run.py's entry."""
    if "summary" not in doc:
        doc = doc.get("benchmarks", {}).get("convergence", {}).get("result") or {}
    if "summary" not in doc:
        raise SystemExit("not a JSON file of bench/convergence.py --json (no 'summary')")
    return doc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="the file bench/convergence.py --json wrote")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "curves.png"),
                        help="the picture to write (default: docs/curves.png)")
    parser.add_argument("--runs", nargs="+", metavar="NAME",
                        help='which runs to draw, in this order (default: all of them)')
    args = parser.parse_args(argv)
    with open(args.json) as f:
        result = convergence_result(json.load(f))
    summary, config = result["summary"], result.get("config", {})
    names = args.runs or list(summary)
    missing = [name for name in names if name not in summary]
    if missing:
        raise SystemExit(f"--runs: {missing} not in {args.json}; it holds {list(summary)}")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in names:
        curve = summary[name]["curve"]
        seeds = len(summary[name]["finals"])
        # as many ranks as workers: one colour; sync solid, async dashed
        n = re.search(r"\d+", name)
        color = COLORS.get(int(n.group()) if n else 1, None)
        style = "--" if name.startswith("async") else "-"
        ax.plot(range(1, len(curve) + 1), curve, style, color=color, marker="o", markersize=3,
                label=f"{name} ({curve[-1]:.1f} %, {seeds} seed{'s' * (seeds > 1)})")
    ax.axhline(100 / CLASSES, color="grey", linestyle=":", label="chance (1 %)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%), mean over seeds")
    recipe = ", ".join(text.format(config[key]) for key, text in
                       (("n_train", "{} training"), ("n_test", "{} test images"),
                        ("batch", "global batch {}"), ("lr", "lr {}")) if key in config)
    ax.set_title(f"The yardstick, 100 classes{': ' + recipe if recipe else ''}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
