"""Benchmark 1: the training step, and the data path alone.

* `loop`      -- our full training loop: `resnet_cifar100.train_one_epoch` over a
                 `DeviceLoader` (batched on-device random crop + flip + normalise), with the
                 `training.EpochMetrics` it keeps (the epoch's bookkeeping), the model, the
                 loss, backward, the optimizer step and the LR schedule's step, built as
                 resnet_cifar100.main builds them, with `--auto-augment none`;
* `loop, --auto-augment ta_wide` -- the same with TrivialAugment after the crop and flip (the
                 scripts' default): what it costs;
* `in place`  -- the same forward, backward, optimizer step and LR schedule step on one batch
                 already on the device;
* `reference` -- what public solutions do: torchvision's `CIFAR100` with per-sample PIL
                 transforms (RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor,
                 Normalize) through a `DataLoader` (shuffle, `num_workers` workers), feeding the
                 same step.

All three train the same HW4ResNet with batch 128 on the same device, in the scripts' default
precision there (`common.run.default_amp`: bf16 autocast + channels_last on CUDA and on CPUs
with native bf16, else fp32), and are timed side by side: every repetition runs each of them
for the same number of steps, in an order rotated from one repetition to the next, and the
tables give medians over repetitions.  Every repetition of `loop` and `reference` is a fresh
epoch iterator (our sampler's permutation, their DataLoader's worker start-up), so their
per-epoch costs are counted once per repetition -- once per few steps instead of once per
391: conservative for both.

On CPU the table also has `in place` in fp32, fp32 + channels_last, bf16 autocast and bf16
autocast + channels_last (one model copy each; the default one is `in place` itself).

The data path alone (no model): batches/s of our `DeviceLoader` against the reference
`DataLoader` with `num_workers` workers and with none.
"""
import argparse
import copy
import itertools
import tempfile
import time

import torch

from util import (SMOKE, TESTS_DIR, default_amp, log, median, precision_name,
                  spread, sync, table)

BATCH = 128
LOOP, IN_PLACE = "loop (ours)", "in place"
LOOP_TA = "loop, --auto-augment ta_wide"
PRECISIONS = (("in place, fp32", False, False), ("in place, fp32 + channels_last", False, True),
              ("in place, bf16 autocast", True, False),
              ("in place, bf16 autocast + channels_last", True, True))


class Take:
    """The first `n` batches of a loader, with the len() and epoch_batches() that
    train_one_epoch uses."""

    def __init__(self, loader, n):
        self.loader, self.n = loader, n

    def __len__(self):
        return self.n

    def epoch_batches(self, epoch, start=0):
        return itertools.islice(self.loader.epoch_batches(epoch, start), self.n - start)


def make_data(n_train, folder):
    """CIFAR-100 pickles in the official format (tests/datagen.py), read by both pipelines."""
    import sys
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    import datagen
    datagen.make_cifar100(folder, n_train=n_train, n_test=256, num_classes=100, seed=0)
    from common import data
    return data.read_cifar100(folder, True)


def reference_dataset(folder):
    """torchvision's CIFAR100 with the public solutions' per-sample transforms.

    torchvision checks the files' md5 sums against the official archive; generated data has
    other sums, so the checks are switched off (the parsing is torchvision's own).
    """
    import torchvision
    import torchvision.transforms as T
    from common.data import SPECS

    class CIFAR100Unchecked(torchvision.datasets.CIFAR100):
        meta = dict(torchvision.datasets.CIFAR100.meta, md5=None)  # _load_meta checks it too

        def _check_integrity(self):
            return True

    transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(SPECS["cifar100"].mean, SPECS["cifar100"].std)])
    return CIFAR100Unchecked(folder, train=True, download=False, transform=transform)


def reference_loader(dataset, workers, device):
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True,
                                       num_workers=workers,
                                       pin_memory=torch.device(device).type == "cuda")


def recipe_args(**overrides):
    """resnet_cifar100.py's recipe, one epoch long (of STEPS_PER_EPOCH steps: the LR schedule
    stays in its warm-up throughout)."""
    import resnet_cifar100
    args = dict(resnet_cifar100.RECIPE, epochs=1, seed=0, fresh=True, batch_size=BATCH)
    args.update(overrides)
    return argparse.Namespace(**args)


STEPS_PER_EPOCH = 100_000


class Setup:
    """A model with its criterion, optimizer and LR schedule, built as resnet_cifar100.main
    builds them, and the Run it trains under.  `foreach`: torch's foreach SGD kernel instead
    of the scripts' fused one."""

    def __init__(self, base_model, device, amp, channels_last=None, out=None, foreach=False):
        from common.run import Run
        from common.training import param_groups, warmup_cosine
        device = torch.device(device)
        channels_last = amp if channels_last is None else channels_last
        # rank 1: the loop draws no progress bar (is_main is False); nothing else reads it
        self.run = Run("bench", out or tempfile.gettempdir(), device, amp, rank=1)
        model = copy.deepcopy(base_model).to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model, self.channels_last = model, channels_last
        self.args = args = recipe_args()
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        kernel = dict(foreach=True) if foreach else dict(fused=True)
        self.optimizer = torch.optim.SGD(param_groups(model, args.weight_decay), lr=args.lr,
                                         momentum=args.momentum, nesterov=args.momentum > 0,
                                         **kernel)
        self.scheduler = warmup_cosine(self.optimizer, args, STEPS_PER_EPOCH)

    def prepare(self, x):
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def train_step(self, x, y):
        """One step of resnet_cifar100.train_one_epoch, without its metrics."""
        with self.run.autocast():
            out = self.model(x)
            loss = self.criterion(out, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss


def flops_per_image(model, image_size=32, device="cpu"):
    """Forward FLOPs of one image (FlopCounterMode: 2 per multiply-add of conv and linear)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = copy.deepcopy(model).to(device).eval()
    x = torch.randn(2, 3, image_size, image_size, device=device)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / 2


# ------------------------------------------------------------------------- the timed runs

def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def loop_variant(setup, loader, steps):
    """Our full loop: resnet_cifar100.train_one_epoch over `steps` batches of a fresh epoch
    (a new permutation each time)."""
    from resnet_cifar100 import train_one_epoch
    epoch = itertools.count()

    def run(n=steps):
        train_one_epoch(setup.model, setup.criterion, setup.optimizer, setup.scheduler,
                        Take(loader, n), next(epoch), setup.run)
    return run


def in_place_variant(setup, x, y, steps):
    x = setup.prepare(x)

    def run(n=steps):
        for _ in range(n):
            setup.train_step(x, y)
    return run


def reference_variant(setup, dataset, workers, steps):
    device = setup.run.device

    def run(n=steps):
        loader = reference_loader(dataset, workers, device)
        for images, labels in itertools.islice(iter(loader), n):
            images = setup.prepare(images.to(device, non_blocking=True))
            setup.train_step(images, labels.to(device, non_blocking=True))
    return run


def interleave(variants, reps, device, images_per_run):
    """Run every variant once per repetition, rotating the order; images/s per repetition."""
    names = list(variants)
    for name in names:  # warm-up: one step each (allocator, oneDNN/cuDNN primitives)
        variants[name](1)
        sync(device)
    results = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds = timed(variants[name], device)
            results[name].append(images_per_run[name] / seconds)
    return results


def bench_step(device, quick, workers, data_dir):
    """The table of benchmark 1 on `device`: images/s of each variant, and the ratios."""
    from common import data
    from common.loader import DeviceLoader
    from common.model import HW4ResNet
    device = torch.device(device)
    cpu = device.type == "cpu"
    amp = default_amp(device)  # the scripts' default precision on this device
    # many short repetitions: the ratio is a median of per-repetition ratios, and pairs taken
    # close together in time cancel the drift of a shared machine
    steps = (2 if quick else 4) if cpu else (20 if quick else 100)
    ref_steps = (3 if quick else 6) if cpu else steps  # its start-up is paid once per rep
    reps = (5 if quick else 8) if cpu else 5
    prec_steps = 2 if quick else 3
    n_train = 10_000 if quick else 50_000
    if SMOKE:
        steps, ref_steps, reps, prec_steps, n_train = 1, 1, 1, 1, 1000

    train_set = make_data(n_train, data_dir)
    ref_set = reference_dataset(data_dir)
    spec = data.SPECS["cifar100"]
    torch.manual_seed(0)
    base = HW4ResNet(spec.num_classes)
    flops = flops_per_image(base)

    main = Setup(base, device, amp)
    loader = DeviceLoader(train_set, BATCH, device, train=True, mean=spec.mean, std=spec.std,
                          seed=0, channels_last=amp)
    loader_ta = DeviceLoader(train_set, BATCH, device, train=True, mean=spec.mean, std=spec.std,
                             seed=0, channels_last=amp, auto_augment="ta_wide")
    loader.set_epoch(0)
    x, y = next(iter(loader))
    x, y = x.clone(), y.clone()
    ref_name = f"reference ({workers} workers)"
    variants = {
        LOOP: loop_variant(main, loader, steps),
        LOOP_TA: loop_variant(main, loader_ta, steps),
        IN_PLACE: in_place_variant(main, x, y, steps),
        ref_name: reference_variant(main, ref_set, workers, ref_steps),
    }
    images = {name: steps * BATCH for name in variants}
    images[ref_name] = ref_steps * BATCH
    precisions = {}
    if cpu:  # fp32, channels_last, bf16 autocast, both: one model copy each, batch in place
        for name, bf16, cl in PRECISIONS:
            precisions[name] = (bf16, cl)
            if (bf16, cl) == (amp, amp):
                continue  # the default: that is "in place" itself
            s = Setup(base, device, amp=bf16, channels_last=cl)
            variants[name] = in_place_variant(s, x.contiguous(), y, prec_steps)
            images[name] = prec_steps * BATCH
    log(f"  training step on {device} ({precision_name(amp)}): {len(variants)} variants x "
        f"{reps} repetitions ({steps} steps each; reference {ref_steps}, other precisions "
        f"{prec_steps})")
    results = interleave(variants, reps, device, images)
    for name, cfg in precisions.items():
        if cfg == (amp, amp):
            results[name] = results[IN_PLACE]

    def paired(a, b):
        return [x / y for x, y in zip(results[a], results[b])]

    ratios = paired(IN_PLACE, LOOP)
    rows = []
    for name, ips in results.items():
        lo, hi = spread(ips)
        row = {"variant": name + (" = in place" if precisions.get(name) == (amp, amp) else ""),
               "images_per_s": median(ips), "min": lo, "max": hi, "per_rep": ips,
               "gflops": median(ips) * 3 * flops / 1e9}
        if name in precisions:
            row["speedup_vs_fp32"] = median(paired(name, PRECISIONS[0][0]))
        rows.append(row)
    return {
        "device": str(device), "precision": precision_name(amp),
        "batch": BATCH, "steps_per_rep": steps, "reference_steps_per_rep": ref_steps,
        "other_precision_steps_per_rep": prec_steps, "reps": reps, "train_images": n_train,
        "reference_workers": workers, "forward_flops_per_image": flops,
        "rows": rows,
        "ratio_in_place_over_loop": median(ratios), "ratio_per_rep": ratios,
        "ratio_best_of": max(results[IN_PLACE]) / max(results[LOOP]),
        "ratio_in_place_over_reference": median(paired(IN_PLACE, ref_name)),
        "ratio_loop_over_loop_ta": median(paired(LOOP, LOOP_TA)),
        "goal_ratio_at_most": 1.05, "goal_met": median(ratios) <= 1.05,
    }


def bench_data_path(device, quick, workers, data_dir, train_set=None):
    """Batches/s of the loaders alone: ours on `device` vs torchvision's DataLoader."""
    from common import data
    from common.loader import DeviceLoader
    device = torch.device(device)
    spec = data.SPECS["cifar100"]
    if train_set is None:
        train_set = data.read_cifar100(data_dir, True)
    ref_set = reference_dataset(data_dir)
    n_ours, n_ref = (40, 20) if quick else (78, 60)
    reps = 3 if quick else 5
    if SMOKE:
        n_ours, n_ref, reps = 4, 4, 1
    loader = DeviceLoader(train_set, BATCH, device, train=True, mean=spec.mean, std=spec.std,
                          seed=0, channels_last=default_amp(device))

    def ours(n):
        loader.set_epoch(ours.epoch)
        ours.epoch += 1
        start = time.perf_counter()
        for x, _ in itertools.islice(iter(loader), n):
            pass
        sync(device)
        return time.perf_counter() - start, None
    ours.epoch = 0

    def reference(w):
        def run(n):
            dl = reference_loader(ref_set, w, "cpu")
            start = time.perf_counter()
            it = iter(dl)
            next(it)
            first = time.perf_counter() - start
            start = time.perf_counter()
            for _ in itertools.islice(it, n - 1):
                pass
            seconds = time.perf_counter() - start
            del it
            return seconds * n / (n - 1), first
        return run

    variants = {"ours (DeviceLoader, batched on %s)" % device.type: (ours, n_ours),
                f"reference, {workers} workers": (reference(workers), n_ref),
                "reference, 0 workers": (reference(0), max(8, n_ref // 2))}
    for fn, _ in variants.values():
        fn(3)
    res = {name: {"bps": [], "first": []} for name in variants}
    names = list(variants)
    for r in range(reps):
        for name in names[r % 3:] + names[:r % 3]:
            fn, n = variants[name]
            seconds, first = fn(n)
            res[name]["bps"].append(n / seconds)
            if first is not None:
                res[name]["first"].append(first)
    rows = []
    for name, v in res.items():
        lo, hi = spread(v["bps"])
        rows.append({"loader": name, "batches_per_s": median(v["bps"]), "min": lo, "max": hi,
                     "images_per_s": median(v["bps"]) * BATCH,
                     "first_batch_s": median(v["first"]) if v["first"] else None})
    ours_bps = rows[0]["batches_per_s"]
    return {"device": str(device), "batch": BATCH, "reps": reps, "rows": rows,
            "speedup_over_reference": ours_bps / rows[1]["batches_per_s"],
            "speedup_over_reference_0_workers": ours_bps / rows[2]["batches_per_s"]}


def run(quick, devices=None, workers=2):
    """Benchmark 1 on CPU and, where present, CUDA."""
    devices = devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if "cuda" in devices:  # what common.run.start_run sets for the scripts
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-cifar-") as folder:
        for device in devices:
            log(f"[1] training step on {device}")
            out[f"step_{device}"] = bench_step(device, quick, workers, folder)
            print_step(out[f"step_{device}"])
            log(f"[1] data path alone on {device}")
            out[f"data_{device}"] = bench_data_path(device, quick, workers, folder)
            print_data(out[f"data_{device}"])
    return out


def print_step(res):
    rows = [[r["variant"], r["images_per_s"], r["min"], r["max"], r["gflops"],
             r.get("speedup_vs_fp32")] for r in res["rows"]]
    log(table(f"Training step, HW4ResNet, batch {res['batch']}, {res['device']}, "
              f"{res['precision']} (the scripts' default here) unless named; median of "
              f"{res['reps']} interleaved reps",
              ["variant", "images/s", "min", "max", "GFLOP/s", "x fp32"], rows))
    log(f"in place / loop = {res['ratio_in_place_over_loop']:.3f} (median of per-rep ratios; "
        f"best-of {res['ratio_best_of']:.3f}; goal <= 1.05: "
        f"{'met' if res['goal_met'] else 'NOT met'}); in place / reference = "
        f"{res['ratio_in_place_over_reference']:.3f}; loop / loop with TrivialAugment = "
        f"{res['ratio_loop_over_loop_ta']:.3f} (goal <= 1.10); forward "
        f"{res['forward_flops_per_image'] / 1e6:.1f} MFLOP/image")


def print_data(res):
    rows = [[r["loader"], r["batches_per_s"], r["min"], r["max"], r["images_per_s"],
             r["first_batch_s"]] for r in res["rows"]]
    log(table(f"Data path alone (no model), batch {res['batch']}, median of {res['reps']} reps",
              ["loader", "batches/s", "min", "max", "images/s", "first batch s"], rows))
    log(f"ours / reference = {res['speedup_over_reference']:.1f}x "
        f"({res['speedup_over_reference_0_workers']:.1f}x over 0 workers)")


if __name__ == "__main__":  # this benchmark alone, as `python bench/run.py --only step` runs it
    import harness
    alone = {"step": lambda args: run(args.quick, workers=args.workers)}
    raise SystemExit(harness.main(alone, doc=__doc__))
