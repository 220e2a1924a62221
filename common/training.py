"""What the mains' training loops share: the weight-decay groups, the learning-rate schedule, the
metrics of a training pass, and evaluation.  The loops themselves -- forward, backward, what
happens to the gradients, the optimizer step -- are written in each main."""
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .run import NonFiniteLoss

LOG_EVERY = 50  # steps between progress updates / non-finite checks (each costs a device sync)
LINE_EVERY = 60.0  # seconds between progress lines where there is no terminal (a log file)


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


class EpochMetrics:
    """Loss and accuracy of one training pass over this rank's shard and its time, from the step
    a stopped pass reached (`resumed`, what `partial()` gave its checkpoint), over every rank
    with `comm`.  Summed on the device, read only every LOG_EVERY steps or for a progress line
    (the GPU seldom waits), raising NonFiniteLoss at the first bad step.  Progress shows as a
    bar on a terminal; in a log file (mpirun, PBS, nohup) as a line a minute."""

    def __init__(self, run, epoch, steps, lr, resumed=None, comm=None):
        resumed = resumed or {"step": 0, "totals": [0.0, 0.0, 0.0], "seconds": 0.0, "lr": lr}
        self.run, self.epoch, self.steps, self.comm = run, epoch, steps, comm
        self.step, self.before, self.lr = resumed["step"], resumed["totals"], resumed["lr"]
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
        self.correct = torch.zeros((), dtype=torch.int64, device=run.device)
        self.first_bad = torch.full((), steps + 1, dtype=torch.int64, device=run.device)  # none
        self.count, self.stopped, self.bar = 0, False, None
        if run.is_main and sys.stderr.isatty():  # a progress bar on a terminal, not in logs
            from tqdm import tqdm
            self.bar = tqdm(desc=f"epoch {epoch + 1}", total=steps, initial=self.step,
                            leave=False, dynamic_ncols=True)
        self.began = time.perf_counter() - resumed["seconds"]
        self.trained, self.opened = None, time.perf_counter()  # this process's part began
        self.last_line = self.opened

    def update(self, loss, output, labels):
        """Count a step's loss and accuracy (after its optimizer step)."""
        loss = loss.detach()
        self.loss_sum += loss.double() * labels.numel()
        self.correct += (output.detach().argmax(1) == labels).sum()
        self.count += labels.numel()
        self.step += 1
        self.first_bad = torch.where(torch.isfinite(loss), self.first_bad,
                                     self.first_bad.clamp(max=self.step))
        if self.bar is not None:
            self.bar.update()
        if self.step % LOG_EVERY == 0 or self.step == self.steps:
            if self.comm is not None:  # every rank stops, not only the one that saw it
                self.comm.all_reduce(self.first_bad, dist.ReduceOp.MIN)
            if self.first_bad.item() <= self.steps:
                raise NonFiniteLoss(f"loss became non-finite at epoch {self.epoch + 1}, step "
                                    f"{self.first_bad.item()}; the last good checkpoint in "
                                    f"{self.run.out} is kept; lower --lr or try --no-amp")
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{self.loss_sum.item() / self.count:.3f}",
                                     acc=f"{100.0 * self.correct.item() / self.count:.1f}%")
        # The clock at every step (a step can take seconds), the device read only when a line
        # is due: rank 0's loss and accuracy.
        if self.bar is None and time.perf_counter() - self.last_line >= LINE_EVERY:
            self.last_line = time.perf_counter()
            self.run.log(progress_line(self.epoch * self.steps + self.step, self.steps,
                                       (self.loss_sum.item(), self.correct.item(), self.count),
                                       self.opened, self.run.world_size))

    def end(self, stopped=False):
        """The pass is over: all its batches, or (`stopped`) up to a SIGTERM/SIGINT."""
        self.trained, self.stopped = time.perf_counter(), stopped
        if self.bar is not None:
            self.bar.close()
        return self

    def totals(self):
        """(loss sum, correct, samples) of the whole pass so far, over every rank."""
        mine = torch.tensor([self.loss_sum.item(), self.correct.item(), self.count],
                            dtype=torch.float64, device=self.run.device)
        if self.comm is not None:
            mine = self.comm.all_reduce(mine)
        return [a + b for a, b in zip(mine.tolist(), self.before)]

    def partial(self):
        """What a checkpoint keeps of a stopped pass, to resume it at this step."""
        return {"step": self.step, "totals": self.totals(), "lr": self.lr,
                "seconds": self.trained - self.began}

    def row(self, test_loss, test_acc, rows):
        """The pass's metrics.csv row, once it is evaluated; `rows` are the earlier epochs'."""
        return epoch_row(self.epoch + 1, self.totals(), test_loss, test_acc, self.lr,
                         time.perf_counter() - self.began, self.trained - self.began, rows)


def progress_line(done, per_epoch, totals, since, world_size=1):
    """Where a long epoch is, for a log file (no terminal shows the bar): `done` steps in all,
    `totals` (loss sum, correct, samples) those of this epoch's taken since `since` by one of
    `world_size` ranks alike."""
    epoch = -(-done // per_epoch)  # the epoch of step `done` (its last step included)
    loss_sum, correct, samples = totals
    return (f"epoch {epoch} step {done - (epoch - 1) * per_epoch}/{per_epoch}: train loss "
            f"{loss_sum / samples:.4f}, train acc {100.0 * correct / samples:.2f}%, "
            f"{samples * world_size / (time.perf_counter() - since):.0f} images/s")


def epoch_row(epoch, totals, test_loss, test_acc, lr, seconds, train_seconds, rows, **extra):
    """A metrics.csv row: `totals` are the pass's (loss sum, correct, samples); `seconds` its
    training and evaluation, `train_seconds` its training alone (for images/s)."""
    loss_sum, correct, samples = totals
    elapsed = (rows[-1]["elapsed_seconds"] if rows else 0.0) + seconds
    return {"epoch": epoch, "train_loss": loss_sum / samples,
            "train_acc": 100.0 * correct / samples, "test_loss": test_loss,
            "test_acc": test_acc, "lr": lr, "epoch_seconds": seconds,
            "elapsed_seconds": elapsed, "images_per_s": samples / train_seconds, **extra}


@torch.no_grad()
def evaluate(model, loader, run, comm=None):
    """Test loss (plain cross-entropy) and accuracy, counted over samples.  With `comm` every
    rank passes its unpadded shard and the sums are all-reduced: each sample counts once."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)
    for images, labels in loader:
        with run.autocast():
            output = model(images)
        totals[0] += F.cross_entropy(output.float(), labels, reduction="sum")
        totals[1] += (output.argmax(1) == labels).sum()
        totals[2] += labels.numel()
    if comm is not None:
        totals = comm.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), 100.0 * correct / max(count, 1)


def evaluate_checkpoint(model, loader, run, state, comm=None):
    """--evaluate: test the checkpoint `RunFolder.resume` loaded into `model`; write nothing."""
    loss, acc = evaluate(model, loader, run, comm)
    run.log(f"checkpoint after epoch {state.epoch}: test loss {loss:.4f}")
    run.log(f"final test accuracy: {acc:.2f}%")


def describe(run, args, model, train_set, test_set, how):
    """The log's opening line: what trains on what, where, and how (the precision included)."""
    from .data import describe as describe_data
    parameters = sum(p.numel() for p in model.parameters())
    return (f"{run.script}: {args.arch} on {args.dataset}, {parameters:,} parameters | train "
            f"{describe_data(train_set)}, test {describe_data(test_set)} | {how} | device "
            f"{run.device}, precision {run.precision}")
