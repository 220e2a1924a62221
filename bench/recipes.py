"""Recipes side by side on the same photos: the public solutions' and ours, with the field's
regularisers, trained by resnet_cifar100.py itself (its network, loader, evaluation,
checkpoints and resume), on a CIFAR-100-shaped folder (bench/tiny_to_cifar.py).

    python bench/recipes.py --recipe P1 --data-dir D --out runs/P1          # a peer's recipe
    python bench/recipes.py --recipe ours -- --auto-augment none --data-dir D --out runs/no-ta

A recipe's optimizer and schedule are put in place of the script's; its other choices are the
script's own flags.  After `--` come flags for resnet_cifar100.py (they win over the recipe's).
The regularisers to try beside the script's own --auto-augment are this benchmark's flags,
named as torchvision's classification reference names them: --random-erase P (after the crop
and flip, before TrivialAugment), --mixup-alpha A, --cutmix-alpha A (bench/augment.py); they
are drawn per batch as the script draws its crops, flips and masks.
Each epoch the run also writes a line to --out/extra.jsonl; every --extra-every epochs and at
the last, with the test accuracy with flip averaging (the image and its mirror, softmax
averaged), and that of exponential moving averages of the weights (EMA,
`torch.optim.swa_utils`, decays per step below), without and with flips: what they would add,
from the same run.  Like the script, a run stopped resumes; its EMAs resume
from --out/ema.pt, as the last epoch's end left them.

The peers (read from their repositories; the same network, each with its dropout after conv1):
P1 Adam 1e-3, constant, batch 128, crop + flip, dropout 0.5 (the common one);
P2 SGD 0.01 momentum 0.9, weight decay 5e-4, x0.1 at epochs 20 and 60, batch 100, crop + flip
+ rotation up to 15 degrees, dropout 0.5; P3 Adam 1e-3, weight decay 5e-4, x0.1 every 20 epochs,
batch 128, dropout 0.5; P4 Adam 5e-4, constant, batch 128, dropout 0.15.  None has label
smoothing, warm-up or a cosine.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import resnet_cifar100  # noqa: E402
import augment  # noqa: E402
from common import checkpoint, loader, training  # noqa: E402
from common.run import execute  # noqa: E402

PLAIN = ["--label-smoothing", "0", "--warmup-epochs", "0", "--auto-augment", "none"]
PEER = PLAIN + ["--momentum", "0"]  # the Adam recipes: no SGD momentum
RECIPES = {  # (flags for resnet_cifar100.py, optimizer, schedule: None = cosine, milestones)
    "ours": ([], "sgd", None),
    "P1": (PEER + ["--lr", "1e-3", "--weight-decay", "0", "--dropout", "0.5"], "adam", ()),
    "P2": (PLAIN + ["--momentum", "0.9", "--lr", "0.01", "--weight-decay", "5e-4",
                    "--batch-size", "100", "--dropout", "0.5"], "sgd-plain", (20, 60)),
    "P3": (PEER + ["--lr", "1e-3", "--weight-decay", "5e-4", "--dropout", "0.5"], "adam",
           (20, 40, 60)),
    "P4": (PEER + ["--lr", "5e-4", "--weight-decay", "0", "--dropout", "0.15"], "adam", ()),
}
ROTATION = {"P2": 15.0}  # degrees, at most
EMA_DECAYS = (0.999, 0.9998)


REAL_SGD = torch.optim.SGD


def optimizer_of(kind, found):
    """The recipe's optimizer in place of the script's SGD (its weight decay on every
    parameter, as the peers' torch.optim.Adam(model.parameters(), ...) has it), followed by
    the EMAs of the weights, made at its first step (after a resume has loaded them)."""
    def make(groups, lr, momentum, nesterov, fused, **_):
        params = [p for g in groups for p in g["params"]]
        decay = max(g["weight_decay"] for g in groups)
        if kind == "sgd":
            opt = REAL_SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
        elif kind == "sgd-plain":
            opt = REAL_SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
        else:
            opt = torch.optim.Adam(params, lr=lr, weight_decay=decay)
        opt.register_step_post_hook(lambda *_: follow(found))
        return opt
    return make


def follow(found):
    model, emas = found["model"], found.setdefault("emas", {})
    if not emas:
        saved = checkpoint.load_plain(found["ema_file"]) \
            if os.path.exists(found["ema_file"]) else {}  # as the last epoch left them
        for decay in EMA_DECAYS:
            emas[decay] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
                                        use_buffers=True)
            if str(decay) in saved:
                emas[decay].load_state_dict(saved[str(decay)])
    for ema in emas.values():
        ema.update_parameters(model)


def step_schedule(milestones):
    def make(optimizer, args, steps_per_epoch):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1 ** sum(
            step >= m * steps_per_epoch for m in milestones))
    return make


def augmented(a, rotation, fill):
    """The script's crop and flip of a uint8 batch, then what `a` asks for: per image, a
    rotation by up to `rotation` degrees either way (torchvision's RandomRotation: nearest
    pixel, zeros outside); per image, random erasing (to `fill`, the mean colour)."""
    crop_flip = loader.random_crop_flip

    def augment_batch(x, pad, gen):
        x = crop_flip(x, pad, gen)
        if rotation:
            x = augment.rotate(x, rotation, gen)
        return augment.random_erase(x, a.random_erase, gen, fill) if a.random_erase else x
    return augment_batch


def mixed(mix):
    """The script's batches with MixUp or CutMix: drawn after the script seeds the batch's
    generator (for its dropout masks), so a resumed epoch mixes its batches as before."""
    epoch_batches = loader.ShardedLoader.epoch_batches

    def mixed_batches(self, epoch, start=0):
        for images, labels in epoch_batches(self, epoch, start):
            yield mix(images, labels)
    return mixed_batches


def counting_mixed_targets():
    """EpochMetrics counting a mixed target as its larger part's class."""
    update = training.EpochMetrics.update

    def update_any(self, loss, output, labels):
        return update(self, loss, output, labels.argmax(1) if labels.ndim > 1 else labels)
    return update_any


@torch.no_grad()
def accuracy(model, test_loader, run, flip):
    model.eval()
    correct = count = 0
    for images, labels in test_loader:
        with run.autocast():
            p = F.softmax(model(images).float(), 1)
            if flip:
                p = p + F.softmax(model(images.flip(3)).float(), 1)
        correct += (p.argmax(1) == labels).sum().item()
        count += labels.numel()
    return 100.0 * correct / count


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", choices=RECIPES, required=True)
    p.add_argument("--random-erase", type=float, default=0.0, metavar="P")
    p.add_argument("--mixup-alpha", type=float, default=0.0)
    p.add_argument("--cutmix-alpha", type=float, default=0.0)
    p.add_argument("--extra-every", type=int, default=5, metavar="N",
                   help="flip and EMA accuracies every N epochs and at the last (each costs "
                        "six more passes over the test set)")
    p.add_argument("script_flags", nargs="*", help="after --: resnet_cifar100.py's flags")
    a = p.parse_args()
    flags, kind, milestones = RECIPES[a.recipe]
    argv = flags + a.script_flags
    args = resnet_cifar100.parse_args(argv)
    found = {"ema_file": os.path.join(args.out, "ema.pt")}
    torch.optim.SGD = optimizer_of(kind, found)  # what resnet_cifar100.main builds
    if milestones is not None:
        training.warmup_cosine = step_schedule(milestones)
    mean = torch.tensor(loader.normalization(args.dataset)[0])
    loader.random_crop_flip = augmented(a, ROTATION.get(a.recipe), (mean * 255).round())
    mix = augment.mixing(a.mixup_alpha, a.cutmix_alpha, 100)
    if mix:
        loader.ShardedLoader.epoch_batches = mixed(mix)
        training.EpochMetrics.update = counting_mixed_targets()
    build = resnet_cifar100.build_model
    resnet_cifar100.build_model = lambda *args_, **kw: found.setdefault("model",
                                                                         build(*args_, **kw))
    out, evaluate = args.out, training.evaluate
    for name in ("extra.jsonl", "ema.pt"):
        if args.fresh and os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))

    train = resnet_cifar100.train_one_epoch

    def train_noting_the_epoch(*args_, **kw):
        found["epoch"] = args_[5] + 1  # (model, criterion, optimizer, scheduler, loader, epoch)
        return train(*args_, **kw)
    resnet_cifar100.train_one_epoch = train_noting_the_epoch

    def evaluate_all(model, test_loader, run, comm=None):
        loss, acc = evaluate(model, test_loader, run, comm)
        epoch = found.get("epoch")  # None under --evaluate
        extra = {"epoch": epoch, "test_acc": acc}
        if epoch is None or epoch % a.extra_every == 0 or epoch == args.epochs:
            extra["flip"] = accuracy(model, test_loader, run, True)
            for decay, ema in found.get("emas", {}).items():
                extra[f"ema {decay}"] = accuracy(ema, test_loader, run, False)
                extra[f"ema {decay} flip"] = accuracy(ema, test_loader, run, True)
        with open(os.path.join(out, "extra.jsonl"), "a") as f:
            f.write(json.dumps(extra) + "\n")
        if found.get("emas"):  # for a resume: each epoch's end, whole or not at all
            states = {str(d): e.state_dict() for d, e in found["emas"].items()}
            checkpoint.atomic_write(found["ema_file"], lambda tmp: torch.save(states, tmp))
        run.log(" | ".join(f"{k} {v:.2f}" for k, v in extra.items() if k != "epoch"))
        return loss, acc
    training.evaluate = evaluate_all
    execute(lambda: resnet_cifar100.main(argv))


if __name__ == "__main__":
    main()
