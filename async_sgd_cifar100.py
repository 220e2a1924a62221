"""Asynchronous SGD with a parameter server (the slides' Algorithm 2), on CIFAR-100 by default.

    mpirun -np 3 python async_sgd_cifar100.py      # 1 server + 2 workers (any launcher works;
                                                   # Open MPI on < 3 cores: --oversubscribe)

Rank 0 is the parameter server; every other rank is a worker training on its own shard:

    worker:  compute a gradient on a mini-batch, at the parameters it holds;  `worker`
             send it to the server; receive the server's parameters; continue from them
    server:  receive a gradient from whichever worker sends first;            `Server.serve`
             apply it at once (the update rule); send that worker parameters  `Server.update`

--batch-size is the global batch, as in sync SGD: each of N workers computes on batch / N
samples, and N updates, each with the learning rate / N, make one step of sync SGD.  A gradient
arrives about N - 1 updates *stale*.  The slides' rule (one momentum buffer, each gradient
applied as it comes) diverges on this network with gradients one update stale; the server does
what `Server.update` says (docs/async-sgd.md: why, and what each step gained).  It evaluates and
checkpoints once per epoch-equivalent of updates; when every worker has trained its epochs, it
writes its outputs and releases them.  The messages: common/messages.py.
"""
import dataclasses
import math
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import data, distributed, flags, training
from common.launch import detect_launch
from common.loader import make_loader
from common.inbox import Heartbeat, Inbox, lost_worker, release, wait_for_sends
from common.messages import (CONTINUE, DONE, GRADIENT, HEADER, STOPPING, Messages,
                             losing_the_server, stop_error, wait_for_release)
from common.model import build_model
from common.outputs import RunFolder
from common.run import Interrupted, NonFiniteLoss, PeerLost, UserError, execute, resume_hint
from common.run import start_run

SCRIPT = "async_sgd_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)

# The recipe: sync SGD's (sync_sgd_cifar100.py says what each part is for), every value a flag,
# split over the workers as above; Nesterov momentum 0.9 with one buffer per worker (below).
RECIPE = dict(epochs=40, batch_size=128, lr=0.1, momentum=0.9, weight_decay=5e-4,
              warmup_epochs=1.0, label_smoothing=0.1, auto_augment="ta_wide")
PULL, PULL_FROM = 0.2, 2  # the rule's pull: P / N of the way back, from 2 updates stale


# ----------------------------------------------------------------------------------- worker

def worker(model, train_loader, args, run, position):
    """Algorithm 2's worker on its shard, from batch `position` (where a resumed run was) on."""
    messages = Messages(model, train_loader.batch_size)
    message, reply = torch.zeros(messages.size), torch.zeros(messages.reply_size)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    head_input = {}  # the features the head (fc) sees, sent with the gradient
    model.fc.register_forward_pre_hook(lambda module, inputs: head_input.update(x=inputs[0]))
    sent = 0
    model.train()
    first_epoch, first_step = divmod(position, len(train_loader))
    for epoch in range(first_epoch, args.epochs):  # its shard, in a new order each epoch
        for images, labels in train_loader.epoch_batches(
                epoch, start=first_step if epoch == first_epoch else 0):
            with run.autocast():
                output = model(images)
                loss = criterion(output, labels)
            model.zero_grad(set_to_none=True)
            loss.backward()
            messages.pack(message, loss, output, labels, head_input["x"])
            answer = dist.irecv(reply, src=0)  # the server's reply ...
            dist.isend(message, dst=0).wait()  # ... to this gradient
            answer.wait()
            sent += 1
            if reply[0].item() != CONTINUE:  # the server says stop, with this exit status
                raise stop_error(int(reply[0].item()), run.rank, resume_hint(args))
            messages.load_parameters(reply[1:])  # continue from the server's parameters
            if run.stop.signum:  # this worker was asked to stop: tell the server
                message[0] = STOPPING
                dist.isend(message, dst=0).wait()
                raise Interrupted(f"worker {run.rank}: stopped by {run.stop.name}; the server "
                                  "writes the checkpoint", run.stop.signum)
            time.sleep(args.straggler_delay if run.rank == 1 else 0)  # --straggler-delay
    message[:HEADER] = torch.tensor([DONE, sent, 0, 0])  # its epochs are trained
    dist.isend(message, dst=0).wait()


# ----------------------------------------------------------------------------------- server

@dataclasses.dataclass
class EpochStats:
    """The server's bookkeeping of an epoch-equivalent of updates (kept in a checkpoint)."""
    lr: float  # at its start
    totals: list = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss, correct, n
    staleness: list = dataclasses.field(default_factory=list)  # of each update
    busy: float = 0.0  # seconds the server spent on updates
    pulled: int = 0  # updates whose gradient was pulled back
    seconds: float = 0.0  # up to its last update (a resumed epoch's so far)


class Server:
    """Algorithm 2's parameter server: holds the parameters, applies each gradient as it
    arrives (`update`), evaluates and checkpoints once per epoch-equivalent of updates."""

    def __init__(self, model, n_workers, args, run, test_loader, state, per_epoch, positions,
                 folder):
        self.model, self.args, self.run, self.test_loader = model, args, run, test_loader
        self.state, self.folder, self.n, self.per_epoch = state, folder, n_workers, per_epoch
        self.workers = list(range(1, n_workers + 1))
        self.messages = Messages(model, args.batch_size // n_workers)
        self.theta = self.messages.flat_parameters()  # each update: a few passes over one vector
        self.decay = torch.cat([torch.full((p.numel(),), args.weight_decay if p.ndim > 1 else 0.0,
                                           device=self.theta.device) for p in self.messages.params])
        saved = state.extra.get("momentum") or []  # one buffer per worker, resumed if it fits
        self.momentum = {w: saved[w - 1].to(self.theta.device) if len(saved) == n_workers
                         else torch.zeros_like(self.theta) for w in self.workers}
        self.momentum_sum = torch.stack(list(self.momentum.values())).sum(0)
        self.gap = torch.empty_like(self.theta)
        # `sent`: the parameters each worker computes on (on a CPU, its reply's; on a GPU, a copy)
        self.replies = {w: torch.cat([torch.zeros(1), self.theta.cpu()]) for w in self.workers}
        on_cpu = self.theta.device.type == "cpu"  # (every worker starts from theta)
        self.sent = {w: self.replies[w][1:] if on_cpu else self.theta.clone() for w in self.workers}
        self.position = dict(zip(self.workers, positions))  # where each is in its batches
        self.resumed_at = dict(self.position)
        self.version = sum(self.position.values())  # the updates done
        self.sent_version = {w: self.version for w in self.workers}
        self.pending, self.gone = {}, set()  # replies in flight; workers lost (None: unknown)
        self.statistics = {}  # each worker's latest BatchNorm running statistics
        done = self.version % per_epoch
        if done:  # a run stopped inside an epoch goes on with that epoch's bookkeeping
            run.log(f"epoch {self.version // per_epoch + 1} resumes after {done} of its "
                    f"{per_epoch} updates")
        self.new_epoch(state.extra.get("epoch_so_far") if done else None)

    def lr(self, version):
        """The learning rate of update `version`: the schedule's, shared by N updates."""
        return self.args.lr / self.n * training.lr_factor(version, self.args, self.per_epoch)

    @torch.no_grad()
    def update(self, worker, gradient, features, labels):
        """The rule: `worker`'s gradient, computed at `self.sent[worker]` (theta N - 1 updates
        ago, on average), applied to theta; then into `self.sent[worker]` what to send it next."""
        theta, v, mu, lr, n = self.theta, self.momentum[worker], self.args.momentum, \
            self.lr(self.version), self.n
        # 1. The head (fc) is never stale: its gradient, recomputed at the current parameters
        #    from the features and labels the worker sent (stale head steps made the training
        #    loss climb above ln(100) in the warm-up).
        with torch.enable_grad():
            weight, bias = (p.detach().requires_grad_() for p in self.messages.head_parameters)
            loss = F.cross_entropy(F.linear(features, weight, bias), labels,
                                   label_smoothing=self.args.label_smoothing)
            for part, fresh in zip(self.messages.head, torch.autograd.grad(loss, (weight, bias))):
                gradient[part].copy_(fresh.reshape(-1))
        # 2. A gradient 2 or more updates stale will be pulled back: the gap between theta and
        #    where it was computed, measured before this step (not the head's: it is fresh).
        pull = PULL / n if n > 1 and self.version - self.sent_version[worker] >= PULL_FROM else 0
        if pull:
            torch.sub(theta, self.sent[worker], out=self.gap)
            for part in self.messages.head:
                self.gap[part] = 0.0
        # 3. Weight decay on conv and linear weights, as part of the gradient.
        gradient.addcmul_(self.decay, theta)
        # 4. One momentum buffer per worker (DANA, Hakimi et al. 2019): a stale gradient moves
        #    only its own worker's buffer, v_i <- mu v_i + g, not the momentum all follow.
        self.momentum_sum.sub_(v)
        v.mul_(mu).add_(gradient)
        self.momentum_sum.add_(v)
        # 5. torch's Nesterov step with that buffer, theta <- theta - lr (g + mu v_i): with one
        #    worker, torch.optim.SGD(nesterov=True) step for step.
        theta.sub_(gradient.add_(v, alpha=mu), alpha=lr)
        # 6. The pull, P / N of the gap: damps the other workers' moves that the reply's
        #    forecast (7) did not foresee.
        if pull:
            theta.sub_(self.gap, alpha=pull)
        # 7. While it computes, N - 1 other updates move theta on, mostly along their momentum:
        #    it is sent theta - (N - 1) lr mean_j(v_j), where its next gradient will be applied.
        torch.add(theta, self.momentum_sum, alpha=-(n - 1) * self.lr(self.version + 1) / n,
                  out=self.sent[worker])
        return bool(pull)

    def apply(self, worker, message):
        """`update` with `worker`'s message, and the bookkeeping of the epoch."""
        samples, correct, loss_sum = message[1:HEADER].tolist()
        gradient, buffers, features, labels = self.messages.unpack(
            message.to(self.theta.device))
        if worker in self.pending:  # it computed this gradient on our last reply: that has
            self.pending.pop(worker).wait()  # left `sent[worker]`, which `update` overwrites
        self.epoch.staleness.append(self.version - self.sent_version[worker])
        self.epoch.pulled += self.update(worker, gradient, features, labels)
        self.statistics[worker] = buffers.clone()
        self.version += 1
        self.position[worker] += 1
        self.epoch.totals = [a + b for a, b in zip(self.epoch.totals, (loss_sum, correct, samples))]

    def reply(self, worker, status, active):
        """Send `worker` its status and the parameters `update` left for it (one message); if
        it is gone, it leaves `active` and the PeerLost to stop with is returned."""
        message = self.replies[worker]  # (its last one has arrived: it has sent since)
        message[0] = status
        if self.sent[worker].data_ptr() != message[1:].data_ptr():  # on a GPU
            message[1:].copy_(self.sent[worker])
        try:
            self.pending[worker] = dist.isend(message, dst=worker)
        except RuntimeError as exc:
            return self.worker_lost(worker, exc, active)
        self.sent_version[worker] = self.version
        return None

    def serve(self):
        """Until every worker is done or stopped, or one is lost: receive a gradient from
        whichever worker sends first, apply it, reply with parameters."""
        self.heartbeat = Heartbeat(self.args.timeout)  # to the workers done, until released
        inbox = Inbox(self.workers, self.messages.size, self.args.timeout, self.heartbeat)
        active, finished, failure = set(self.workers), {}, None
        while active:
            worker, message, error = inbox.next()  # from whichever worker sends first
            if error is not None:  # it died, or sent nothing for --timeout: everyone stops
                lost = self.worker_lost(worker, error, active)  # (a second loss leaves too)
                failure = failure or lost  # the first is the reason
                continue
            kind = message[0].item()
            if kind == DONE:  # its epochs are trained: it waits for its release
                finished[worker] = int(message[1].item())
                active.discard(worker)
                continue
            failure = failure or self.reason_to_stop(kind, message)
            if failure is not None:  # stop: this gradient is not applied, its worker told so
                active.discard(worker)
                if kind == GRADIENT:  # it waits for a reply
                    self.reply(worker, failure.exit_code, active)
                continue
            begin = time.perf_counter()
            self.apply(worker, message)
            failure = self.reply(worker, CONTINUE, active)  # parameters for its next gradient
            if failure is None:
                inbox.expect(worker)
            self.last_update = time.perf_counter()
            self.epoch.busy += self.last_update - begin
            if self.version % self.per_epoch == 0:  # evaluate; checkpoint.pt, metrics.csv, ...
                failure = self.end_epoch() or failure  # (NaN weights: everyone stops, exit 3)
            elif self.last_update - self.last_line >= training.LINE_EVERY:  # for a log file
                self.last_line = self.last_update
                self.run.log(training.progress_line(self.version, self.per_epoch,
                                                    self.epoch.totals, self.started))
        self.finish(finished, failure)

    def worker_lost(self, worker, error, active):
        """The PeerLost to stop with; `worker` leaves `active` (None, unknown: all, untold)."""
        why = lost_worker(worker, error, active, self.args.timeout)
        active.difference_update(self.workers if worker is None else [worker])
        self.gone.add(worker)
        return PeerLost(f"the parameter server lost {why}; it saved the model after "
                        f"{self.version} updates (epoch {self.version // self.per_epoch} complete)"
                        f" to {self.folder.checkpoint}; {resume_hint(self.args)}")

    def reason_to_stop(self, kind, message):
        """The exception to stop everyone with: a signal here or at a worker, a bad loss."""
        if kind == STOPPING or self.run.stop.signum:
            signum = self.run.stop.signum or signal.SIGTERM
            return Interrupted(f"stopped by {signal.Signals(signum).name} after {self.version} "
                               f"updates: checkpoint written to {self.folder.checkpoint}; "
                               f"{resume_hint(self.args)}", signum)
        if not math.isfinite(message[3].item()):
            return NonFiniteLoss(f"loss became non-finite after {self.version} updates; the last "
                                 f"good checkpoint in {self.run.out} is kept; lower --lr")
        return None

    def new_epoch(self, so_far=None):
        """Start an epoch's bookkeeping, or go on with a resumed one's (`so_far`)."""
        self.epoch = EpochStats(**so_far) if so_far else EpochStats(self.lr(self.version))
        self.started = self.last_update = self.last_line = time.perf_counter() - self.epoch.seconds

    def average_statistics(self):
        """The model's BatchNorm statistics: the mean of the workers' latest (as sync SGD's)."""
        if self.statistics:
            self.messages.load_buffers(torch.stack(list(self.statistics.values())).mean(0))

    def keep_in_checkpoint(self):
        """The updates done, each worker's place, the momentum buffers, the epoch so far."""
        self.state.extra = {
            "updates": self.version, "positions": [self.position[w] for w in self.workers],
            "batches_per_worker": self.per_epoch // self.n,
            "momentum": [self.momentum[w].cpu() for w in self.workers],
            "epoch_so_far": dataclasses.asdict(dataclasses.replace(
                self.epoch, seconds=self.last_update - self.started))}

    def end_epoch(self):
        seconds, epoch = time.perf_counter() - self.started, self.epoch
        self.average_statistics()
        test_loss, test_acc = training.evaluate(self.model, self.test_loader, self.run)
        updates = len(epoch.staleness)
        row = training.epoch_row(
            math.ceil(self.version / self.per_epoch), epoch.totals, test_loss, test_acc, epoch.lr,
            seconds, seconds, self.state.rows, updates=self.version,
            updates_per_s=updates / seconds, mean_staleness=sum(epoch.staleness) / updates,
            max_staleness=max(epoch.staleness), server_busy=epoch.busy / seconds,
            pulled=epoch.pulled / updates)
        self.new_epoch()  # before the checkpoint: nothing of the next epoch is done yet
        return self.saved(self.folder.end_epoch, self.state, row,
                          f" | {row['updates_per_s']:.1f} updates/s | staleness mean "
                          f"{row['mean_staleness']:.2f} max {row['max_staleness']} | "
                          f"{100 * row['pulled']:.0f}% pulled")

    def saved(self, save, *args):
        """`save(*args)`, statistics averaged and bookkeeping kept: None, or NaN weights' error."""
        self.average_statistics()
        self.keep_in_checkpoint()
        try:
            return save(*args)  # None
        except NonFiniteLoss as exc:
            return exc

    def finish(self, finished, failure):
        """The last replies sent; the last (partial) epoch written, or the checkpoint a stopped
        run resumes from; each worker done released, with the exit status; `failure` raised."""
        if None not in self.gone:  # else they may never complete
            wait_for_sends(self.pending, self.gone, failure)
        for worker, sent in sorted(finished.items()):
            applied = self.position[worker] - self.resumed_at[worker]
            self.run.log(f"worker {worker}: {sent} gradients sent, {applied} applied")
        if self.epoch.staleness and failure is None:
            failure = self.end_epoch()  # updates after the last full epoch-equivalent
        if isinstance(failure, (Interrupted, PeerLost)):
            # the completed epochs' rows, the model as it is now (unless NaN: then exit 3)
            failure = self.saved(self.folder.save, self.state) or failure
        self.heartbeat.stop()
        if None not in self.gone:
            release(finished, 0 if failure is None else failure.exit_code, self.run.log)
        if failure is not None:
            raise failure


def resume_positions(state, n_workers, updates_per_epoch):
    """Where each worker resumes in its stream of batches: after those the server had applied
    when it wrote the checkpoint, so that an epoch stopped inside trains each batch once.  Saved
    for another number of batches (another --data-dir; resume refuses another world size) or
    not at all: the start of the interrupted epoch, its updates kept in the parameters."""
    batches, saved = updates_per_epoch // n_workers, state.extra.get("positions")
    if saved and state.extra.get("batches_per_worker") == batches:
        return [int(p) for p in saved]
    return [state.epoch * batches] * n_workers


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="cifar100", arch="hw4")
    flags.add_distributed_flags(parser, backends=("gloo", "mpi"))  # moving CPU tensors
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    launch = detect_launch()
    n_workers = launch.world_size - 1
    if n_workers < 1:
        raise UserError("async SGD needs at least 2 processes (rank 0 is the parameter server, "
                        "the others are workers); start it with e.g. mpirun -np 3")
    if args.batch_size < n_workers:
        raise UserError(f"--batch-size {args.batch_size} is smaller than the {n_workers} "
                        f"workers; use at least {n_workers} (it is the global batch)")
    batch = args.batch_size // n_workers
    run = start_run(args, SCRIPT, launch.rank, launch.world_size, launch.local_rank)
    folder = RunFolder(args, run, TARGET if args.dataset == "cifar100" else None)
    with distributed.process_group(args, run, launch) as comm:
        comm.check_same_flags(args)  # one recipe for every rank
        with comm.apart():  # decoding, a worker's loader (TrivialAugment's import): not silence
            train_set, test_set = data.load_datasets(args.dataset, args, comm,
                                                     parameter_server=True)
            shard = dict(train=True, batch_size=batch, rank=comm.rank - 1, world_size=n_workers)
            train_loader = make_loader(train_set, args, run, **shard) if comm.rank else None
        per_worker = math.ceil(len(train_set) / n_workers)  # DistributedSampler's shard size
        updates_per_epoch = math.ceil(per_worker / batch) * n_workers
        model = build_model(args.arch, len(train_set.classes), args.dropout)
        # The server never trains: a contiguous copy halves its work per update (BENCHMARKS.md).
        model = run.prepare(model) if comm.rank else model.to(run.device)
        state = folder.resume(model, comm=comm)  # the server's momentum is in state.extra
        positions = resume_positions(state, n_workers, updates_per_epoch)
        comm.broadcast_parameters(model)  # every worker starts from the server's weights
        if comm.rank == 0 and args.evaluate:  # the server alone evaluates
            training.evaluate_checkpoint(model, make_loader(test_set, args, run, train=False),
                                         run, state)
        elif comm.rank == 0:
            run.log(training.describe(run, args, model, train_set, test_set,
                                      f"1 server + {n_workers} worker{'s' * (n_workers > 1)} x "
                                      f"batch {batch} = global batch {batch * n_workers}, "
                                      f"{updates_per_epoch} updates per epoch"))
            folder.write_config(state, updates_per_epoch=updates_per_epoch)
            Server(model, n_workers, args, run, make_loader(test_set, args, run, train=False),
                   state, updates_per_epoch, positions, folder).serve()
            run.log(f"final test accuracy: {state.rows[-1]['test_acc']:.2f}%")
        elif not args.evaluate:  # the workers, each on its shard of the training set
            with losing_the_server(run.rank):  # one line, exit 200
                worker(model, train_loader, args, run, positions[comm.rank - 1])
            wait_for_release(run.rank, resume_hint(args))
        comm.wait_for_all_ranks()


if __name__ == "__main__":
    execute(main)
