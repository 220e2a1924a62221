"""One training loop and one evaluation for every script.

Nothing here assumes a single process: the loaders shard, `fit` takes a `grad_sync` whose
`wait()` runs between backward and the optimizer step (sync SGD averages gradients there),
totals are summed over ranks through `reduce`, and only the main rank writes files.
"""
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint, data, outputs
from .distributed import failure_line, is_peer_failure
from .errors import Interrupted, NonFiniteLoss, PeerLost, UserError
from .model import count_parameters

LOG_EVERY = 50  # steps between progress updates / non-finite checks (each costs a device sync)


def make_optimizer(model, args):
    """SGD with Nesterov momentum; weight decay on conv/linear weights only (not BN, biases).

    The fused kernel makes the same update in one pass over the parameters (the async server's
    step: 7 to 1 ms, BENCHMARKS.md)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    device = next(model.parameters()).device
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum,
                           nesterov=args.momentum > 0,
                           fused=True if device.type in ("cpu", "cuda") else None)


def warmup_cosine(total_steps, warmup_steps):
    """LR factor per step: linear warm-up from ~0 to 1, then cosine to 0."""
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def make_scheduler(optimizer, args, steps_per_epoch):
    total = args.epochs * steps_per_epoch
    warmup = min(total, round(args.warmup_epochs * steps_per_epoch))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, warmup))


def autocast(run):
    return torch.autocast(device_type=run.device.type, dtype=torch.bfloat16, enabled=run.amp)


def prepare_model(model, run):
    model = model.to(run.device)
    if run.amp:
        model = model.to(memory_format=torch.channels_last)
    return model


def _progress(batches, desc, run, total, initial=0):
    """tqdm on a terminal; in batch logs (not a tty) only the per-epoch lines."""
    if not (run.is_main and sys.stderr.isatty()):
        return batches
    from tqdm import tqdm
    return tqdm(batches, desc=desc, total=total, initial=initial, leave=False, dynamic_ncols=True)


def train_one_epoch(model, loader, criterion, step, run, desc="train", start=0, stop=None):
    """One pass over this rank's shard, from batch `start`; `step()` applies the gradients.

    Returns this rank's (loss sum, correct, count, batches done).  Loss and accuracy are
    accumulated on the device and read every LOG_EVERY steps only, so the GPU never waits for
    the host.  `stop(k)`, asked after each batch k, ends the pass early when it says so.
    """
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    first_bad = torch.full((), -1, dtype=torch.int64, device=run.device)  # no sync per step
    count, done = 0, start
    batches = loader.batches(start) if hasattr(loader, "batches") else loader
    bar = _progress(batches, desc, run, total=len(loader), initial=start)
    for k, (images, labels) in enumerate(bar, start):
        with autocast(run):
            output = model(images)
            loss = criterion(output, labels)
        model.zero_grad(set_to_none=True)
        loss.backward()
        step()
        loss_sum += loss.detach().double() * labels.numel()
        correct += (output.detach().argmax(1) == labels).sum()
        count += labels.numel()
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss.detach()), k + 1, first_bad)
        done = k + 1
        if done % LOG_EVERY == 0 or done == len(loader):
            bad = first_bad.item()
            if bad >= 0:
                raise NonFiniteLoss(f"loss became non-finite at {desc}, step {bad}; the last good "
                                    f"checkpoint in {run.out} is kept; lower --lr or try --no-amp")
            if bar is not batches:
                bar.set_postfix(loss=f"{loss_sum.item() / count:.3f}",
                                acc=f"{100.0 * correct.item() / count:.1f}%")
        if stop is not None and done < len(loader) and stop(done):
            break
    return loss_sum.item(), correct.item(), count, done


@torch.no_grad()
def evaluate(model, loader, run, reduce=None):
    """Test loss (plain cross-entropy) and accuracy, counted over samples.

    With `reduce` (a sum over ranks) every rank passes its unpadded shard and each test
    sample is counted exactly once.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)
    for images, labels in loader:
        with autocast(run):
            output = model(images)
        totals[0] += F.cross_entropy(output.float(), labels, reduction="sum")
        totals[1] += (output.argmax(1) == labels).sum()
        totals[2] += labels.numel()
    if reduce is not None:
        totals = reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), 100.0 * correct / max(count, 1)


def describe(run, args, model, train_set, test_set, batch):
    """The log's opening line: what trains on what, where, and how (the precision included)."""
    sizes = data.describe
    run.log(f"{run.script}: {args.arch} on {args.dataset}, {count_parameters(model):,} parameters"
            f" | train {sizes(train_set)}, test {sizes(test_set)} | {batch} | "
            f"device {run.device}, precision {run.precision}")


def epoch_line(row, epochs):
    return (f"epoch {row['epoch']:>3}/{epochs} | train loss {row['train_loss']:.4f} "
            f"acc {row['train_acc']:6.2f}% | test loss {row['test_loss']:.4f} "
            f"acc {row['test_acc']:6.2f}% | lr {row['lr']:.4g} | "
            f"{row['epoch_seconds']:.1f} s | {row['images_per_s']:.0f} img/s")


def epoch_seed(seed, epoch, rank):
    """Dropout and other global-RNG draws of an epoch depend on (seed, epoch, rank) only."""
    return (seed * 1_000_003 + epoch * 7919 + rank * 104_729) % 2**63


class Trainer:
    """Trains `model` for `args.epochs`, evaluating, logging and checkpointing every epoch.

    A checkpoint in `run.out` is resumed (unless `--fresh`): model, optimizer, LR schedule,
    epoch and the metrics so far.  The shuffling, augmentation and dropout streams of an epoch
    are derived from (seed, epoch, rank), so a run killed during epoch k and started again
    redoes epoch k exactly as an uninterrupted run would.  SIGTERM / SIGINT finish the current
    step and write a mid-epoch checkpoint; the next run continues from that step.
    """

    def __init__(self, model, train_loader, test_loader, args, run, *, arch, target=None,
                 grad_sync=None, comm=None, steps_per_epoch=None):
        self.model, self.train_loader, self.test_loader = model, train_loader, test_loader
        self.args, self.run, self.arch, self.target = args, run, arch, target
        self.grad_sync, self.comm = grad_sync, comm
        self.optimizer = make_optimizer(model, args)
        self.scheduler = make_scheduler(self.optimizer, args,
                                        steps_per_epoch or len(train_loader))
        self.criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        self.rows, self.start_epoch, self.extra = [], 0, {}
        self.partial = None  # progress inside an interrupted epoch
        self.tensorboard = None  # --tensorboard's writer, made when the first row is recorded
        self.path = os.path.join(run.out, "checkpoint.pt")

    # -- state -------------------------------------------------------------------------
    def will_resume(self):
        return os.path.exists(self.path) and not self.args.fresh

    def resume(self):
        """Load `checkpoint.pt` from the out dir if there is one (main rank reads, all get it)."""
        state, error = None, None
        if self.run.is_main and self.will_resume():
            try:
                state = checkpoint.load(self.path, script=self.run.script, arch=self.arch)
            except UserError as exc:  # tell the other ranks too, rather than leave them waiting
                error = str(exc)
        if self.comm is not None:
            state, error = self.comm.broadcast_object((state, error))
        if error:
            raise UserError(error)
        if state is None:
            return False
        checkpoint.unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rows, self.start_epoch = state["rows"], state["epoch"]
        self.extra = state.get("extra") or {}
        self.partial = self.extra.get("partial")
        where = f"epoch {self.start_epoch}" + (
            f" and step {self.partial['step']} of epoch {self.start_epoch + 1}" if self.partial else "")
        self.run.log(f"resumed from {self.path} after {where}")
        return True

    def save(self, epoch, extra=None):
        if not self.run.is_main:
            return
        checkpoint.save(self.path, script=self.run.script, arch=self.arch, model=self.model,
                        optimizer=self.optimizer, scheduler=self.scheduler, epoch=epoch,
                        rows=self.rows, args=vars(self.args), extra=extra)
        outputs.write_metrics(self.run.out, self.rows)
        if self.rows:
            outputs.plot_curve(self.run.out, self.rows, self.run.script, self.target)

    def log_scalars(self, row):
        """--tensorboard: an epoch's row as scalars (main rank), before its checkpoint is saved."""
        if not (self.run.is_main and getattr(self.args, "tensorboard", False)):
            return
        if self.tensorboard is None:
            self.tensorboard = outputs.TensorBoardLog(self.run.out, first_epoch=row["epoch"])
        self.tensorboard.add_row(row)

    def write_config(self, **extra):
        if self.run.is_main:
            outputs.write_config(self.run.out, self.args, self.run.device, script=self.run.script,
                                 arch=self.arch, world_size=self.run.world_size,
                                 precision=self.run.precision,
                                 resumed_after_epoch=self.start_epoch, **extra)

    # -- loop --------------------------------------------------------------------------
    def step(self):
        if self.grad_sync is not None:
            self.grad_sync.wait()
        self.optimizer.step()
        self.scheduler.step()

    def reduce(self, totals):
        return self.comm.all_reduce_sum(totals) if self.comm is not None else totals

    def should_stop(self, step):
        """Has any rank been asked to stop?  All ranks agree, so they stop at the same step."""
        if self.comm is None or self.comm.world_size == 1:
            return self.run.stop.signum is not None
        if step % 10:  # an agreement costs a tiny all_reduce: every 10 steps is prompt enough
            return False
        flag = torch.tensor([self.run.stop.signum or 0], device=self.run.device)
        return self.comm.all_reduce_max(flag).item() > 0

    def train_epoch(self, epoch):
        """Train one epoch (or its remainder) and evaluate; None if stopped by a signal."""
        partial = self.partial or {"step": 0, "totals": [0.0, 0.0, 0.0], "seconds": 0.0}
        self.partial = None
        self.train_loader.set_epoch(epoch)
        torch.manual_seed(epoch_seed(self.args.seed, epoch, self.run.rank) + partial["step"])
        lr = partial.get("lr", self.optimizer.param_groups[0]["lr"])
        start = time.perf_counter()
        loss_sum, correct, count, done = train_one_epoch(
            self.model, self.train_loader, self.criterion, self.step, self.run,
            desc=f"epoch {epoch + 1}", start=partial["step"], stop=self.should_stop)
        train_seconds = partial["seconds"] + time.perf_counter() - start
        totals = self.reduce(torch.tensor([loss_sum, correct, count], dtype=torch.float64,
                                          device=self.run.device)).tolist()
        totals = [a + b for a, b in zip(totals, partial["totals"])]
        if done < len(self.train_loader):
            self.save(epoch, extra={"partial": {"step": done, "totals": totals, "lr": lr,
                                                "seconds": train_seconds}})
            return None
        if self.comm is not None:
            self.comm.average_buffers(self.model)
        test_loss, test_acc = evaluate(self.model, self.test_loader, self.run, self.reduce)
        seconds = partial["seconds"] + time.perf_counter() - start  # training + evaluation
        return self.row(epoch + 1, totals, test_loss, test_acc, lr, seconds, train_seconds)

    def row(self, epoch, totals, test_loss, test_acc, lr, seconds, train_seconds):
        """A metrics.csv row; `totals` = (loss sum, correct, samples) of the training."""
        loss_sum, correct, samples = totals
        elapsed = (self.rows[-1]["elapsed_seconds"] if self.rows else 0.0) + seconds
        return {"epoch": epoch, "train_loss": loss_sum / samples,
                "train_acc": 100.0 * correct / samples, "test_loss": test_loss,
                "test_acc": test_acc, "lr": lr, "epoch_seconds": seconds,
                "elapsed_seconds": elapsed, "images_per_s": samples / train_seconds}

    def fit(self):
        self.resume()
        self.write_config()
        if self.start_epoch >= self.args.epochs and self.rows:
            self.run.log(f"{self.path} already holds {self.start_epoch} epochs "
                         f"(--epochs {self.args.epochs}); nothing to train")
        try:
            for epoch in range(self.start_epoch, self.args.epochs):
                row = self.train_epoch(epoch)
                if row is None:
                    raise Interrupted(
                        f"stopped by {self.run.stop.name} during epoch {epoch + 1}: "
                        f"checkpoint written to {self.path}; run the same command to resume",
                        self.run.stop.signum)
                self.rows.append(row)
                self.log_scalars(row)
                self.run.log(epoch_line(row, self.args.epochs))
                self.save(epoch + 1)
        except RuntimeError as exc:
            if self.comm is None or self.comm.world_size == 1 or not is_peer_failure(exc):
                raise
            kept = f"epoch {len(self.rows)}" if self.rows else "none yet"
            raise PeerLost(f"rank {self.run.rank} lost contact with another rank "
                           f"({failure_line(exc)}); the last good checkpoint "
                           f"({kept}) is kept in {self.run.out}; restart the job to resume") from None
        if self.rows:
            self.run.log(f"final test accuracy: {self.rows[-1]['test_acc']:.2f}%")
        return self.rows

    def evaluate_checkpoint(self):
        """`--evaluate`: test the checkpoint in the out dir; write nothing."""
        if not self.resume():
            raise UserError(f"--evaluate: no checkpoint at {self.path}; train first or "
                            "point --out at the run to evaluate")
        loss, acc = evaluate(self.model, self.test_loader, self.run, self.reduce)
        self.run.log(f"checkpoint after epoch {self.start_epoch}: test loss {loss:.4f}")
        self.run.log(f"final test accuracy: {acc:.2f}%")
        return acc
