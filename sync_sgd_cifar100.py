"""Synchronous SGD (the slides' Algorithm 1) on CIFAR-100 (or any --dataset), on any number of ranks.

    python sync_sgd_cifar100.py                         # a world of 1
    mpirun -np 4 python sync_sgd_cifar100.py            # Open MPI / MPICH / Intel MPI (Open MPI
                                                        # on < 4 cores: mpirun --oversubscribe)
    aprun -n 2 -N 1 python sync_sgd_cifar100.py         # Cray, under PBS
    torchrun --nproc-per-node 2 sync_sgd_cifar100.py    # or a Kubeflow PyTorchJob / TrainJob

1. Synchronous initialisation: rank 0 broadcasts its weights to every rank.
2. Each epoch, each rank takes its shard of a new permutation (strong scaling: --batch-size
   is the global batch, each rank computes on batch / world of it).
3. After backward, gradients are averaged over ranks with all_reduce, so every rank applies
   the same update and the replicas stay identical.
"""
import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from common import data, distributed, flags, loader, outputs, process, training
from common.checkpoint import Checkpoint
from common.launch import detect_launch
from common.model import build_model

SCRIPT = "sync_sgd_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)

# The recipe: resnet_cifar100.py's, with --batch-size the global batch (128 = 4 ranks x 32):
# 40 epochs; SGD with Nesterov momentum 0.9 and weight decay 5e-4 on conv and linear weights;
# the learning rate warms up linearly to 0.1 over the first epoch, then follows a cosine to 0,
# stepped every batch; random crop and flip; label smoothing 0.1 on the training loss only.
RECIPE = dict(epochs=40, batch_size=128, lr=0.1, momentum=0.9, weight_decay=5e-4,
              warmup_epochs=1.0, label_smoothing=0.1)


def average_gradients(model, world_size):
    """The slides' gradient averaging: after backward, one blocking all_reduce per parameter,
    then a division by the number of ranks (86 round trips for this network)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


class BucketedAllReduce:
    """The same average, overlapped with backward: the fast path (as fast as DDP, BENCHMARKS.md).

    Parameters are grouped, in reverse order of registration (about the order backward produces
    their gradients), into flat buckets of about `bucket_mb` megabytes.  A hook copies each
    gradient into its bucket as soon as autograd has accumulated it; a full bucket is divided by
    the world size and all-reduced asynchronously while backward goes on.  Buckets are launched
    strictly in order, so every rank issues the same sequence of collectives.  `wait()`
    completes the reductions and points each `.grad` at its averaged slice.  Each slice is
    viewed with its parameter's strides (as DDP does), so channels_last weights get
    channels_last gradients and no copy transposes.
    """

    def __init__(self, model, world_size, bucket_mb=25.0):
        self.world_size = world_size
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets, sizes = [[]], [0]
        for p in reversed(params):
            if self.buckets[-1] and (sizes[-1] + p.numel()) * 4 > bucket_mb * 2**20:
                self.buckets.append([])
                sizes.append(0)
            self.buckets[-1].append(p)
            sizes[-1] += p.numel()
        self.flat = [torch.zeros(n, dtype=torch.float32, device=params[0].device) for n in sizes]
        self.slices = []  # per bucket: (param, offset) pairs
        for b, bucket in enumerate(self.buckets):
            offset, placed = 0, []
            for p in bucket:
                placed.append((p, offset))
                p.register_post_accumulate_grad_hook(functools.partial(self._ready, b, offset))
                offset += p.numel()
            self.slices.append(placed)
        self._reset()

    def _reset(self):
        self.arrived = [0] * len(self.buckets)
        self.handles = [None] * len(self.buckets)
        self.next = 0

    def _slice(self, b, offset, param):
        """Bucket b's slice for `param`, laid out with the parameter's own strides."""
        return self.flat[b][offset:offset + param.numel()].as_strided(param.shape, param.stride())

    def _ready(self, b, offset, param):
        self._slice(b, offset, param).copy_(param.grad)
        self.arrived[b] += 1
        while self.next < len(self.buckets) and \
                self.arrived[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)

    def _launch(self, b):
        self.flat[b].div_(self.world_size)
        self.handles[b] = dist.all_reduce(self.flat[b], async_op=True)
        self.next = b + 1

    def wait(self):
        for b in range(self.next, len(self.buckets)):  # buckets with unused parameters
            for p, offset in self.slices[b]:
                if p.grad is None:
                    self.flat[b][offset:offset + p.numel()].zero_()
            self._launch(b)
        for b, handle in enumerate(self.handles):
            handle.wait()
            for p, offset in self.slices[b]:
                p.grad = self._slice(b, offset, p)
        self._reset()


def no_average():
    """A world of 1 has nothing to average; DDP averaged during backward."""


def slowed(average, seconds):
    """`average`, after a sleep (--straggler-delay): this rank is late at every step, and with
    the all_reduce every other rank waits for it."""
    def late_average():
        time.sleep(seconds)
        average()
    return late_average


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="cifar100", arch="hw4")
    flags.add_distributed_flags(parser)
    g = parser.add_argument_group("sync SGD")
    g.add_argument("--exchange", choices=["buckets", "per-parameter", "ddp"], default="buckets",
                   help="how gradients are averaged: BucketedAllReduce (overlapped with "
                        "backward), the slides' average_gradients, or torch's "
                        "DistributedDataParallel (for comparison)")
    g.add_argument("--bucket-mb", type=flags.positive_float, default=25.0,
                   help="size of all_reduce buckets (DDP's default size; see BENCHMARKS.md)")
    g.add_argument("--sync-bn", action="store_true",
                   help="BatchNorm statistics over the global batch (SyncBatchNorm)")
    g.add_argument("--straggler-delay", type=flags.non_negative_float, default=0.0,
                   metavar="SECONDS",
                   help="make rank 1 sleep this long at each step (a slow rank: every rank "
                        "waits for it)")
    return parser.parse_args(argv)


def train_one_epoch(model, meter, criterion, optimizer, scheduler, proc, average):
    """One pass over this rank's shard: forward, backward, the average over ranks, SGD step."""
    model.train()
    for images, labels in meter:  # this rank's batches, from where a stopped run left off
        with proc.autocast():
            output = model(images)
            loss = criterion(output, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # (with buckets, the all_reduce of each starts here, during backward)
        average()  # every rank now holds the mean gradient of the global batch ...
        optimizer.step()  # ... and takes the same step: the replicas stay identical
        scheduler.step()
        meter.update(loss, output, labels)


def main(argv=None):
    args = parse_args(argv)
    launch = detect_launch()
    world = launch.world_size
    if args.batch_size < world:
        raise process.UserError(f"--batch-size {args.batch_size} is smaller than the {world} "
                                f"ranks; use at least {world} (strong scaling: it is the "
                                "global batch)")
    per_rank = args.batch_size // world
    proc = process.start(args, SCRIPT, launch.rank, world, launch.local_rank)
    folder = outputs.RunFolder(args, proc, TARGET if args.dataset == "cifar100" else None)
    comm = distributed.start(args, proc, launch)
    try:
        comm.check_same_flags(args)  # one recipe for every rank
        train_set, test_set = data.load_datasets(args.dataset, args)
        train_loader, test_loader = loader.make_loaders(  # this rank's shards
            train_set, test_set, args, proc, batch_size=per_rank, rank=comm.rank, world_size=world)

        model = proc.prepare(build_model(args.arch, len(train_set.classes), args.dropout))
        comm.broadcast_parameters(model)  # 1. every rank starts from rank 0's weights
        if args.sync_bn and world > 1:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        average = no_average
        if world > 1 and args.exchange == "ddp":
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[proc.device.index] if proc.device.type == "cuda" else None)
        elif world > 1 and args.exchange == "per-parameter":
            average = functools.partial(average_gradients, model, world)
        elif world > 1:
            average = BucketedAllReduce(model, world, args.bucket_mb).wait
        if args.straggler_delay and comm.rank == 1:
            average = slowed(average, args.straggler_delay)
        criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                    momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
        scheduler = training.warmup_cosine(optimizer, args, len(train_loader))

        checkpoint = Checkpoint(args, proc, model, optimizer, scheduler, comm)
        state = checkpoint.resume()  # every rank gets rank 0's checkpoint, if there is one
        if args.evaluate:
            return training.evaluate_checkpoint(model, test_loader, proc, checkpoint, state, comm)
        training.describe(proc, args, model, train_set, test_set,
                          f"{world} ranks x batch {per_rank} = global batch {per_rank * world}, "
                          f"gradients averaged by {args.exchange}")
        folder.write_config(resumed_after_epoch=state.epoch)

        with distributed.lost_peer(proc, state):  # a dead or silent rank: one line, exit 200
            for epoch in range(state.epoch, args.epochs):
                meter = training.Meter(train_loader, epoch, args, proc, state, scheduler, comm)
                train_one_epoch(model, meter, criterion, optimizer, scheduler, proc, average)
                if meter.stopped:  # SIGTERM / SIGINT on any rank: all stop at the same step
                    checkpoint.save(state, partial=meter.partial())
                    raise process.Interrupted(meter.stop_message(checkpoint.path),
                                              proc.stop.signum)
                comm.average_buffers(model)  # BatchNorm statistics: one model, the one saved
                test_loss, test_acc = training.evaluate(model, test_loader, proc, comm)
                state.add(meter.row(test_loss, test_acc, state.rows))
                proc.log(training.epoch_line(state.rows[-1], args.epochs))
                checkpoint.save(state)  # resumable from here
                folder.write(state.rows)  # metrics.csv, curve.png (and tb/): as the checkpoint holds
        proc.log(f"final test accuracy: {state.rows[-1]['test_acc']:.2f}%")
        comm.finish()
    finally:
        comm.close()


if __name__ == "__main__":
    process.execute(main)
