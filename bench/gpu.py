"""Benchmark 4 (CUDA only): the HW4 ResNet on a GPU.

1. The epoch time of `resnet_cifar100.py --dummy` at CIFAR size with the script's default
   settings (batch 128, bf16 autocast + channels_last, cudnn.benchmark, TF32): the real
   script as a subprocess, its metrics.csv read back; images/s of training, and the fraction
   of the GPU's dense bf16 peak that makes (FLOPs per training image = 3 x the forward FLOPs
   counted by torch.utils.flop_counter.FlopCounterMode).
2. Options, each on a batch already on the GPU (forward + backward + the scripts' optimizer
   step, fused SGD as in the scripts): fp32 (TF32), channels_last, bf16 autocast, both, the
   foreach SGD kernel instead of the fused one, batch 256 and 512, torch.compile, and
   torch.compile(mode="reduce-overhead") (CUDA graphs).

Without CUDA the benchmark is skipped with a message.  `BENCH_GPU_DRYRUN=1` runs the same
code on the CPU with tiny sizes, to check it where no GPU is available (numbers meaningless).
"""
import csv
import os
import subprocess
import sys
import tempfile
import time

import torch

from util import REPO_ROOT, Skip, log, median, table

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, by device name; first match wins.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
    ("GH200", 989.4), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
    ("A30", 165.0), ("A40", 149.7), ("RTX 4090", 165.2), ("RTX 3090", 71.0),
    ("RTX A6000", 154.8), ("RTX 6000 Ada", 364.2),
)


def bf16_peak_tflops(name):
    override = os.environ.get("BENCH_GPU_PEAK_TFLOPS")
    if override:
        return float(override), "BENCH_GPU_PEAK_TFLOPS"
    for key, peak in BF16_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peak, f"table entry '{key}'"
    return None, "unknown GPU: set BENCH_GPU_PEAK_TFLOPS"


def script_epoch(device, dry, quick):
    """resnet_cifar100.py --dummy with its defaults; the last epoch's metrics row."""
    epochs = 1 if quick else 2
    cmd = [sys.executable, os.path.join(REPO_ROOT, "resnet_cifar100.py"), "--dummy",
           "--epochs", str(epochs), "--fresh"]
    if dry:
        cmd += ["--device", "cpu", "--train-limit", "256", "--test-limit", "128"]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as out:
        start = time.perf_counter()
        proc = subprocess.run(cmd + ["--out", out], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=1800)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"resnet_cifar100.py failed (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-2000:]}")
        with open(os.path.join(out, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    last = {k: float(v) for k, v in rows[-1].items()}
    return {"epochs_run": epochs, "epoch": int(last["epoch"]),
            "epoch_seconds": last["epoch_seconds"], "train_images_per_s": last["images_per_s"],
            "wall_s": wall, "log_tail": proc.stdout.strip().splitlines()[-3:]}


def option_runs(device, dry, quick, flops):
    """images/s of the training step under each option, on a batch already in place."""
    from training import Setup, in_place_variant, timed
    from common.model import HW4ResNet

    torch.manual_seed(0)
    base = HW4ResNet(100)
    steps, warm = (2, 1) if dry else ((30, 10) if quick else (100, 20))
    options = [
        # name, batch, bf16, channels_last, compile mode, foreach SGD (not the fused default)
        ("fp32 (TF32)", 128, False, False, None, False),
        ("fp32 + channels_last", 128, False, True, None, False),
        ("bf16 autocast", 128, True, False, None, False),
        ("bf16 autocast + channels_last (script default)", 128, True, True, None, False),
        ("  with foreach SGD instead of fused", 128, True, True, None, True),
        ("  + batch 256", 256, True, True, None, False),
        ("  + batch 512", 512, True, True, None, False),
        ("  + torch.compile", 128, True, True, "default", False),
        ("  + torch.compile reduce-overhead (CUDA graphs)", 128, True, True, "reduce-overhead",
         False),
    ]
    if dry:
        options = [o for o in options if o[1] == 128 and o[4] is None] + \
                  [("  + torch.compile", 128, True, True, "default", False)]
    rows = []
    for name, batch, bf16, cl, mode, foreach in options:
        row = {"option": name, "batch": batch}
        s = train = None
        try:
            s = Setup(base, device, amp=bf16, channels_last=cl, foreach=foreach)
            if mode:
                s.model = torch.compile(s.model, mode=mode)
            x = torch.randn(batch, 3, 32, 32, device=device)
            y = torch.randint(0, 100, (batch,), device=device)
            train = in_place_variant(s, x, y, steps)
            warm_s = timed(lambda: train(warm), device)
            compile_s = warm_s if mode else None
            times = [timed(train, device) for _ in range(3)]
            ips = batch * steps / median(times)
            row.update(images_per_s=ips, ms_per_step=1e3 * median(times) / steps,
                       tflops=ips * 3 * flops / 1e12, warmup_s=compile_s)
        except Exception as exc:  # one option failing (compile on an odd setup) is a result
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log(f"    {name}: " + (f"{row['images_per_s']:.0f} images/s" if "images_per_s" in row
                               else row["error"]))
        rows.append(row)
        s = train = None  # free this option's model before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(quick):
    dry = os.environ.get("BENCH_GPU_DRYRUN") == "1"
    if not torch.cuda.is_available() and not dry:
        raise Skip("no CUDA device visible (torch.cuda.is_available() is False): GPU epoch "
                   "time, peak fraction and options not measured on this machine")
    from training import flops_per_image
    from common.model import HW4ResNet
    device = torch.device("cpu") if dry else torch.device("cuda")
    if device.type == "cuda":  # what common.run.start_run sets for the scripts
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    peak, peak_source = bf16_peak_tflops(name)
    flops = flops_per_image(HW4ResNet(100))
    log(f"[4] GPU: {name}; bf16 peak {peak} TFLOP/s ({peak_source}); forward "
        f"{flops / 1e6:.1f} MFLOP/image, training {3 * flops / 1e6:.1f} MFLOP/image")
    log("[4] resnet_cifar100.py --dummy, default settings")
    epoch = script_epoch(device, dry, quick)
    epoch["tflops"] = epoch["train_images_per_s"] * 3 * flops / 1e12
    epoch["peak_fraction"] = epoch["tflops"] / peak if peak else None
    log("[4] options, batch in place")
    rows = option_runs(device, dry, quick, flops)
    for r in rows:
        if peak and "tflops" in r:
            r["peak_fraction"] = r["tflops"] / peak
    out = {"gpu": name, "bf16_peak_tflops": peak, "peak_source": peak_source,
           "forward_flops_per_image": flops, "train_flops_per_image": 3 * flops,
           "script_epoch": epoch, "options": rows, "dry_run": dry}
    print_result(out)
    return out


def print_result(res):
    e = res["script_epoch"]
    log(table(f"GPU: {res['gpu']} (bf16 peak {res['bf16_peak_tflops']} TFLOP/s); "
              f"training {res['train_flops_per_image'] / 1e6:.0f} MFLOP/image",
              ["what", "images/s", "ms/step", "TFLOP/s", "of bf16 peak", "warm-up s / note"],
              [[f"resnet_cifar100.py --dummy, epoch {e['epoch']} "
                f"({e['epoch_seconds']:.1f} s incl. test)", e["train_images_per_s"], None,
                e["tflops"], e["peak_fraction"], None]] +
              [[r["option"] + f" (batch {r['batch']})", r.get("images_per_s"),
                r.get("ms_per_step"), r.get("tflops"), r.get("peak_fraction"),
                r.get("warmup_s") if "error" not in r else r["error"]] for r in res["options"]]))


if __name__ == "__main__":  # this benchmark alone, as `python bench/run.py --only gpu` runs it
    import harness
    alone = {"gpu": lambda args: run(args.quick)}
    raise SystemExit(harness.main(alone, doc=__doc__))
