"""What the mains' training loops share: the optimizer's parameter groups, the LR schedule, the
bookkeeping of a training pass and its metrics row (`Meter`), and evaluation.

The loops themselves -- forward, backward, what happens to the gradients, the optimizer step --
are written in each main, where a reader sees them.
"""
import math
import sys
import time

import torch
import torch.nn.functional as F

from .model import count_parameters
from .data import describe as describe_data
from .process import NonFiniteLoss, UserError

LOG_EVERY = 50  # steps between progress updates / non-finite checks (each costs a device sync)
AGREE_EVERY = 10  # steps between the ranks' agreements on whether to stop (a tiny all_reduce)


def param_groups(model, weight_decay):
    """Weight decay on convolution and linear weights only: not on BatchNorm or biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]


def lr_factor(step, args, steps_per_epoch):
    """The LR schedule, as a factor of --lr at `step` (counted in batches): a linear warm-up
    from ~0 to 1 over --warmup-epochs, then a cosine to 0 at the end of --epochs."""
    total = args.epochs * steps_per_epoch
    warmup = min(total, round(args.warmup_epochs * steps_per_epoch))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def warmup_cosine(optimizer, args, steps_per_epoch):
    """`lr_factor` as the optimizer's scheduler, to be stepped after every batch."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args, steps_per_epoch))


def to_resume(args):
    """How to go on from the checkpoint this run has written: with --fresh, the same command
    would start over."""
    return f"run the same command{' without --fresh' * bool(args.fresh)} to resume"


def epoch_seed(seed, epoch, rank):
    """Dropout and other global-RNG draws of an epoch depend on (seed, epoch, rank) only."""
    return (seed * 1_000_003 + epoch * 7919 + rank * 104_729) % 2**63


class Meter:
    """The bookkeeping of one training pass over this rank's shard, around the main's loop.

    Iterating it starts the epoch -- a new shuffle (`set_epoch`), crops, flips and dropout masks
    derived from (seed, epoch, rank) -- and yields its batches from the step a stopped epoch
    reached (`state.partial`), so an epoch stopped at step k and resumed is the epoch an
    uninterrupted run would have had.
    `update` sums loss and accuracy on the device and reads them every LOG_EVERY steps only
    (the GPU never waits for the host), raising NonFiniteLoss at the first bad step.  After a
    SIGTERM/SIGINT -- agreed by every rank when `comm` is given -- the iteration ends early and
    `stopped` is True.
    """

    def __init__(self, loader, epoch, args, proc, state, scheduler, comm=None):
        self.loader, self.epoch, self.args, self.proc, self.comm = loader, epoch, args, proc, comm
        partial = state.take_partial() or {"step": 0, "totals": [0.0, 0.0, 0.0], "seconds": 0.0}
        self.start, self.before, self.seconds_before = (partial["step"], partial["totals"],
                                                        partial["seconds"])
        self.lr = partial.get("lr", scheduler.get_last_lr()[0])  # the LR the epoch began with
        self.step, self.stopped = self.start, False
        device = proc.device
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)  # no sync per step
        self.count = 0
        self.began = self.trained = None

    def __iter__(self):
        self.loader.set_epoch(self.epoch)
        torch.manual_seed(epoch_seed(self.args.seed, self.epoch, self.proc.rank) + self.start)
        self.began = time.perf_counter()
        batches = self.loader.batches(self.start)
        self.bar = _progress(batches, f"epoch {self.epoch + 1}", self.proc, len(self.loader),
                             self.start)
        for batch in self.bar:
            yield batch
            if self.step < len(self.loader) and self._stop_requested():
                self.stopped = True
                break
        self.trained = time.perf_counter()

    def update(self, loss, output, labels):
        """Count a step's loss and accuracy (after its optimizer step)."""
        loss = loss.detach()
        self.loss_sum += loss.double() * labels.numel()
        self.correct += (output.detach().argmax(1) == labels).sum()
        self.count += labels.numel()
        self.step += 1
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(loss), self.step,
                                     self.first_bad)
        if self.step % LOG_EVERY == 0 or self.step == len(self.loader):
            bad = self.first_bad.item()
            if bad >= 0:
                raise NonFiniteLoss(f"loss became non-finite at epoch {self.epoch + 1}, step "
                                    f"{bad}; the last good checkpoint in {self.proc.out} is kept; "
                                    "lower --lr or try --no-amp")
            if hasattr(self.bar, "set_postfix"):
                self.bar.set_postfix(loss=f"{self.loss_sum.item() / self.count:.3f}",
                                     acc=f"{100.0 * self.correct.item() / self.count:.1f}%")

    def _stop_requested(self):
        """Has any rank been asked to stop?  All ranks agree, so they stop at the same step."""
        if self.comm is None or self.comm.world_size == 1:
            return self.proc.stop.signum is not None
        if self.step % AGREE_EVERY:
            return False
        flag = torch.tensor([self.proc.stop.signum or 0], device=self.proc.device)
        return self.comm.all_reduce_max(flag).item() > 0

    def totals(self):
        """(loss sum, correct, samples) of the whole epoch so far, over every rank."""
        mine = torch.tensor([self.loss_sum.item(), self.correct.item(), self.count],
                            dtype=torch.float64, device=self.proc.device)
        if self.comm is not None:
            mine = self.comm.all_reduce_sum(mine)
        return [a + b for a, b in zip(mine.tolist(), self.before)]

    def partial(self):
        """What a checkpoint keeps of a stopped pass, to resume it at this step."""
        return {"step": self.step, "totals": self.totals(), "lr": self.lr,
                "seconds": self.seconds_before + self.trained - self.began}

    def stop_message(self, path):
        return (f"stopped by {self.proc.stop.name} during epoch {self.epoch + 1}: checkpoint "
                f"written to {path}; {to_resume(self.args)}")

    def row(self, test_loss, test_acc, rows, **extra):
        """The epoch's metrics.csv row, once it is trained and evaluated; `rows` are the earlier
        epochs' (for the elapsed time)."""
        loss_sum, correct, samples = self.totals()
        now = time.perf_counter()
        seconds = self.seconds_before + now - self.began  # training and evaluation
        train_seconds = self.seconds_before + self.trained - self.began
        elapsed = (rows[-1]["elapsed_seconds"] if rows else 0.0) + seconds
        return {"epoch": self.epoch + 1, "train_loss": loss_sum / samples,
                "train_acc": 100.0 * correct / samples, "test_loss": test_loss,
                "test_acc": test_acc, "lr": self.lr, "epoch_seconds": seconds,
                "elapsed_seconds": elapsed, "images_per_s": samples / train_seconds, **extra}


def _progress(batches, desc, proc, total, initial=0):
    """tqdm on a terminal; in batch logs (not a tty) only the per-epoch lines."""
    if not (proc.is_main and sys.stderr.isatty()):
        return batches
    from tqdm import tqdm
    return tqdm(batches, desc=desc, total=total, initial=initial, leave=False, dynamic_ncols=True)


@torch.no_grad()
def evaluate(model, loader, proc, comm=None):
    """Test loss (plain cross-entropy) and accuracy, counted over samples.

    With `comm` every rank passes its unpadded shard and the sums are all-reduced, so each test
    sample counts exactly once."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=proc.device)
    for images, labels in loader:
        with proc.autocast():
            output = model(images)
        totals[0] += F.cross_entropy(output.float(), labels, reduction="sum")
        totals[1] += (output.argmax(1) == labels).sum()
        totals[2] += labels.numel()
    if comm is not None:
        totals = comm.all_reduce_sum(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), 100.0 * correct / max(count, 1)


def evaluate_checkpoint(model, loader, proc, checkpoint, state, comm=None):
    """--evaluate: test the checkpoint in --out (already loaded into `model`); write nothing."""
    if not checkpoint.exists():
        raise UserError(f"--evaluate: no checkpoint at {checkpoint.path}; train first or point "
                        "--out at the run to evaluate")
    loss, acc = evaluate(model, loader, proc, comm)
    proc.log(f"checkpoint after epoch {state.epoch}: test loss {loss:.4f}")
    proc.log(f"final test accuracy: {acc:.2f}%")


def epoch_line(row, epochs):
    return (f"epoch {row['epoch']:>3}/{epochs} | train loss {row['train_loss']:.4f} "
            f"acc {row['train_acc']:6.2f}% | test loss {row['test_loss']:.4f} "
            f"acc {row['test_acc']:6.2f}% | lr {row['lr']:.4g} | "
            f"{row['epoch_seconds']:.1f} s | {row['images_per_s']:.0f} img/s")


def describe(proc, args, model, train_set, test_set, how):
    """The log's opening line: what trains on what, where, and how (the precision included)."""
    proc.log(f"{proc.script}: {args.arch} on {args.dataset}, {count_parameters(model):,} "
             f"parameters | train {describe_data(train_set)}, test {describe_data(test_set)} | "
             f"{how} | "
             f"device {proc.device}, precision {proc.precision}")
