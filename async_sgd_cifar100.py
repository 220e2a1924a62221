"""Asynchronous SGD with a parameter server (the slides' Algorithm 2), on CIFAR-100 by default.

    mpirun -np 3 python async_sgd_cifar100.py      # 1 server + 2 workers (any launcher works)

Rank 0 is the parameter server: it holds the model and the optimizer.  Every other rank is a
worker that trains on its own shard of the data:

    loop:  compute a gradient on a mini-batch
           isend it, as one flat tensor, to the server
           irecv the server's current parameters and continue from them

The server serves whichever worker's gradient arrives first (a receive from any source, not a
fixed 1..N order) and applies each gradient as it arrives.  A gradient is *stale* by the number
of updates the server applied between sending that worker its parameters and receiving the
gradient computed from them; --staleness-lr divides the learning rate by it.  Each worker
announces when its epochs are done; when all have, the server evaluates, writes its outputs
and releases everyone.  The server evaluates the test set once per epoch-equivalent of
updates (training-set size / batch size), so the curve has a point per epoch.
"""
import math
import signal
import time

import torch
import torch.distributed as dist

from common import cli, data, distributed, engine
from common.checkpoint import unwrap
from common.errors import Interrupted, NonFiniteLoss, PeerLost, UserError
from common.model import build_model

SCRIPT = "async_sgd_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)

# A worker's message: [kind, samples, correct, loss sum | gradients | BatchNorm buffers].
GRADIENT, DONE, STOPPING = 0.0, 1.0, 2.0
HEADER = 4
# The server's reply: [status | parameters]; status 0 = go on, else the exit status to stop with.
CONTINUE = 0.0


def _cat_into(tensors, out):
    """Concatenate straight into `out` (a CPU message) when the tensors are on the CPU too: one
    pass over 14 MB instead of two."""
    if tensors[0].device == out.device:
        torch.cat(tensors, out=out)
    else:
        out.copy_(torch.cat(tensors))


class Layout:
    """Where each parameter and BatchNorm buffer sits in the flat messages."""

    def __init__(self, model):
        self.params = [p for p in model.parameters()]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.n_params = sum(p.numel() for p in self.params)
        self.n_buffers = sum(b.numel() for b in self.buffers)
        self.message_size = HEADER + self.n_params + self.n_buffers
        self.reply_size = 1 + self.n_params

    def write_params(self, out):
        _cat_into([p.detach().reshape(-1) for p in self.params], out)

    def load_params(self, flat):
        for p, chunk in zip(self.params, flat.to(self.params[0].device).split(
                [p.numel() for p in self.params])):
            p.data.copy_(chunk.view_as(p))

    def pack_gradient(self, message):
        _cat_into([p.grad.reshape(-1) for p in self.params] +
                  [b.reshape(-1) for b in self.buffers], message[HEADER:])

    def unpack_gradient(self, message):
        """Set each .grad and BN buffer from a received message (the latest worker's stats)."""
        body = message[HEADER:].to(self.params[0].device)
        grads, bufs = body.split([self.n_params, self.n_buffers])
        for p, g in zip(self.params, grads.split([p.numel() for p in self.params])):
            p.grad = g.view_as(p)
        for b, v in zip(self.buffers, bufs.split([b.numel() for b in self.buffers])):
            b.copy_(v.view_as(b))


def stop_error(status, rank):
    """The exception a worker stops with when the server's reply says stop."""
    if status >= 128:
        return Interrupted(f"worker {rank}: stopped by the parameter server (signal); its "
                           "checkpoint is written; run the same command to resume", status - 128)
    return NonFiniteLoss(f"worker {rank}: stopped by the parameter server (non-finite loss)")


# ----------------------------------------------------------------------------- worker

def work(model, loader, args, run, start_epoch):
    """Compute gradients on this worker's shard; exchange each with the server."""
    layout = Layout(model)
    message = torch.zeros(layout.message_size)
    reply = torch.zeros(layout.reply_size)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    sent = 0
    try:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)
            torch.manual_seed(engine.epoch_seed(args.seed, epoch, run.rank))
            model.train()
            for images, labels in loader:
                with engine.autocast(run):
                    output = model(images)
                    loss = criterion(output, labels)
                model.zero_grad(set_to_none=True)
                loss.backward()
                message[:HEADER] = torch.tensor([GRADIENT, labels.numel(),
                                                 (output.argmax(1) == labels).sum().item(),
                                                 loss.item() * labels.numel()])
                layout.pack_gradient(message)
                answer = dist.irecv(reply, src=0)
                dist.isend(message, dst=0).wait()
                answer.wait()
                sent += 1
                if reply[0].item() != CONTINUE:
                    raise stop_error(int(reply[0].item()), run.rank)
                layout.load_params(reply[1:])
                if run.stop.signum:  # this worker was asked to stop: tell the server
                    message[0] = STOPPING
                    dist.isend(message, dst=0).wait()
                    raise Interrupted(f"worker {run.rank}: stopped by {run.stop.name}; the "
                                      "server writes the checkpoint", run.stop.signum)
                if args.straggler_delay and run.rank == 1:
                    time.sleep(args.straggler_delay)
        message[:HEADER] = torch.tensor([DONE, sent, 0, 0])
        dist.isend(message, dst=0).wait()
    except RuntimeError as exc:
        if not distributed.is_peer_failure(exc):
            raise
        raise PeerLost(f"worker {run.rank} lost the parameter server "
                       f"({distributed.failure_line(exc)})") from None
    release = torch.zeros(1)
    try:
        dist.recv(release, src=0)  # released once the server's outputs are written
    except RuntimeError as exc:  # this worker's part is done either way
        print(f"worker {run.rank}: done, but the server did not release it "
              f"({distributed.failure_line(exc, 100)})", flush=True)
        return False
    return release.item() == 0  # 0: the run succeeded and everyone meets at a last barrier


# ----------------------------------------------------------------------------- server

class Server:
    """Applies gradients as they arrive, tracks staleness, evaluates once per epoch-equivalent."""

    def __init__(self, trainer, n_workers, updates_per_epoch):
        self.trainer, self.run = trainer, trainer.run
        self.updates_per_epoch = updates_per_epoch
        self.layout = Layout(unwrap(trainer.model))
        self.workers = list(range(1, n_workers + 1))
        self.reply = {w: torch.zeros(self.layout.reply_size) for w in self.workers}
        self.pending = {}
        self.version = trainer.start_epoch * updates_per_epoch  # updates applied so far
        self.sent_version = {w: self.version for w in self.workers}
        self.applied = {w: 0 for w in self.workers}
        self._new_epoch()

    def _new_epoch(self):
        self.totals = [0.0, 0.0, 0.0]  # loss sum, correct, samples
        self.staleness = []
        self.busy = 0.0
        self.lr = self.trainer.scheduler.get_last_lr()[0]
        self.started = time.perf_counter()

    def serve(self):
        """Serve until every worker is done, stopped, or silent for --timeout seconds."""
        message = torch.zeros(self.layout.message_size)
        active, finished, failure = set(self.workers), {}, None
        while active:
            try:
                worker = dist.recv(message)  # from whichever worker sends first
            except RuntimeError as exc:
                if not distributed.is_peer_failure(exc):
                    raise
                failure = PeerLost(
                    f"the parameter server lost worker(s) {sorted(active)} before they finished: "
                    f"one died, or sent nothing for --timeout {self.trainer.args.timeout:g} s "
                    f"({distributed.failure_line(exc, 100)}); {self.saved()}")
                break
            begin = time.perf_counter()
            kind = message[0].item()
            if kind == DONE:
                finished[worker] = int(message[1].item())
                active.discard(worker)
                continue
            failure = failure or self.check(kind, message)
            if failure is not None:  # stop: this gradient is not applied
                active.discard(worker)
                if kind == GRADIENT:
                    self.send(worker, failure.exit_code)
                continue
            self.apply(worker, message)
            try:
                self.send(worker, CONTINUE)
            except RuntimeError as exc:
                if not distributed.is_peer_failure(exc):
                    raise
                failure = PeerLost(f"the parameter server lost worker {worker} "
                                   f"({distributed.failure_line(exc, 100)}); {self.saved()}")
                break
            self.busy += time.perf_counter() - begin
            if self.version % self.updates_per_epoch == 0:
                self.end_epoch()
        self.finish(finished, failure)

    def check(self, kind, message):
        """The reason to stop everyone, if there is one."""
        if kind == STOPPING or self.run.stop.signum:
            signum = self.run.stop.signum or signal.SIGTERM
            return Interrupted(f"stopped by {signal.Signals(signum).name} after {self.version} "
                               f"updates: checkpoint written to {self.trainer.path}; run the same "
                               "command to resume", signum)
        if not math.isfinite(message[3].item()):
            return NonFiniteLoss(f"loss became non-finite after {self.version} updates; the last "
                                 f"good checkpoint in {self.run.out} is kept; lower --lr")
        return None

    def apply(self, worker, message):
        trainer = self.trainer
        staleness = self.version - self.sent_version[worker]
        self.layout.unpack_gradient(message)
        if trainer.args.staleness_lr and staleness > 0:
            for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr()):
                group["lr"] = lr / staleness
        trainer.optimizer.step()
        trainer.scheduler.step()  # also restores the scheduled learning rate
        self.version += 1
        self.applied[worker] += 1
        self.staleness.append(staleness)
        samples, correct, loss_sum = message[1:HEADER].tolist()
        self.totals = [self.totals[0] + loss_sum, self.totals[1] + correct,
                       self.totals[2] + samples]

    def send(self, worker, status):
        if worker in self.pending:
            self.pending[worker].wait()  # the previous reply to it has left the buffer
        self.reply[worker][0] = status
        self.layout.write_params(self.reply[worker][1:])
        self.pending[worker] = dist.isend(self.reply[worker], dst=worker)
        self.sent_version[worker] = self.version

    def saved(self):
        return (f"it saved the model after {self.version} updates (epoch "
                f"{self.version // self.updates_per_epoch} complete) to {self.trainer.path}; "
                "run the same command to resume")

    def finish(self, finished, failure):
        for request in self.pending.values():
            try:
                request.wait()
            except RuntimeError:
                if not isinstance(failure, PeerLost):  # a reply to the lost worker may fail
                    raise
        for worker, sent in sorted(finished.items()):
            self.run.log(f"worker {worker}: {sent} gradients sent, {self.applied[worker]} applied")
        if self.staleness and failure is None:
            self.end_epoch()  # updates after the last full epoch-equivalent
        if isinstance(failure, (Interrupted, PeerLost)):
            # a checkpoint to resume from: the completed epochs' rows, the model as it is now
            self.trainer.save(self.version // self.updates_per_epoch,
                              extra={"updates": self.version})
        if not isinstance(failure, PeerLost):  # after a timeout gloo has closed every pair
            status = torch.tensor([0.0 if failure is None else failure.exit_code])
            for worker in finished:
                dist.send(status, dst=worker)  # release it
        if failure is not None:
            raise failure

    def end_epoch(self):
        trainer, run = self.trainer, self.run
        seconds = time.perf_counter() - self.started
        test_loss, test_acc = engine.evaluate(trainer.model, trainer.test_loader, run)
        epoch = math.ceil(self.version / self.updates_per_epoch)
        updates = len(self.staleness)
        row = trainer.row(epoch, self.totals, test_loss, test_acc, self.lr, seconds, seconds)
        row.update(updates=self.version, updates_per_s=updates / seconds,
                   mean_staleness=sum(self.staleness) / updates,
                   max_staleness=max(self.staleness), server_busy=self.busy / seconds)
        trainer.rows.append(row)
        trainer.log_scalars(row)
        run.log(engine.epoch_line(row, trainer.args.epochs) +
                f" | {row['updates_per_s']:.1f} updates/s | staleness mean "
                f"{row['mean_staleness']:.2f} max {row['max_staleness']}")
        trainer.save(epoch, extra={"updates": self.version})
        self._new_epoch()


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = cli.make_parser(__doc__, SCRIPT, epochs=40, batch_size=128, lr=0.05)
    cli.add_workload_args(parser, dataset="cifar100", arch="hw4")
    distributed.add_distributed_args(parser)
    g = parser.add_argument_group("async SGD")
    g.add_argument("--staleness-lr", action="store_true",
                   help="divide the learning rate of a stale gradient by its staleness")
    g.add_argument("--straggler-delay", type=float, default=0.0, metavar="SECONDS",
                   help="make worker 1 sleep this long after each step (shows staleness)")
    parser.set_defaults(backend="gloo")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    launch = distributed.detect_launch()
    if launch.world_size < 2:
        raise UserError("async SGD needs at least 2 processes (rank 0 is the parameter server, "
                        "the others are workers); start it with e.g. mpirun -np 3")
    if args.backend not in ("gloo", "mpi"):
        raise UserError(f"--backend {args.backend}: the parameter server receives from any "
                        "source, which only gloo and mpi offer; use --backend gloo")
    run = cli.setup_run(args, SCRIPT, launch.rank, launch.world_size, launch.local_rank)
    comm = distributed.init_distributed(args, run.device, launch, stop=run.stop,
                                        backend=distributed.resolve_backend(args.backend, run.device))
    n_workers = comm.world_size - 1
    train_set, test_set = data.load_datasets(args.dataset, args)
    # Workers shard the training set among themselves; the server alone evaluates.
    if comm.rank == 0:
        train_loader, test_loader = None, data.test_loader(test_set, args, run)
    else:
        train_loader, test_loader = data.train_loader(
            train_set, args, run, rank=comm.rank - 1, world_size=n_workers), None
    per_worker = math.ceil(len(train_set) / n_workers)  # DistributedSampler's shard size
    updates_per_epoch = math.ceil(per_worker / args.batch_size) * n_workers

    model = build_model(args.arch, len(train_set.classes), args.dropout)
    # The server never trains: a contiguous copy halves its work per update (BENCHMARKS.md).
    model = engine.prepare_model(model, run) if comm.rank else model.to(run.device)
    trainer = engine.Trainer(model, None, test_loader, args, run, arch=args.arch,
                             target=TARGET if args.dataset == "cifar100" else None,
                             comm=comm, steps_per_epoch=updates_per_epoch)
    try:
        trainer.resume()
        comm.broadcast_parameters(model)  # every worker starts from the server's weights
        if comm.rank == 0:
            engine.describe(run, args, model, train_set, test_set,
                            f"1 server + {n_workers} workers x batch {args.batch_size}, "
                            f"{updates_per_epoch} updates per epoch")
            trainer.write_config(updates_per_epoch=updates_per_epoch)
            Server(trainer, n_workers, updates_per_epoch).serve()
            if trainer.rows:
                run.log(f"final test accuracy: {trainer.rows[-1]['test_acc']:.2f}%")
            comm.finish()
        elif work(model, train_loader, args, run, trainer.start_epoch):
            comm.finish()
    finally:
        comm.close()


if __name__ == "__main__":
    cli.run_main(main)
