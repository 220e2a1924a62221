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
import time

import torch
import torch.distributed as dist
from torch import nn

from common import data, distributed, flags, training
from common.collectives import lost_peer
from common.launch import detect_launch
from common.loader import make_loader
from common.model import build_model
from common.outputs import RunFolder
from common.run import UserError, execute, start_run

SCRIPT = "sync_sgd_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)

# The recipe: resnet_cifar100.py's, every value a flag, with what each part is for:
RECIPE = dict(epochs=40, batch_size=128,  # the global batch (128 = 4 ranks x 32): strong scaling
              lr=0.1, momentum=0.9,  # SGD, Nesterov momentum: smooths the noisy batch gradients
              warmup_epochs=1.0,  # up to --lr over epoch 1, then a cosine to 0: no early blow-up
              weight_decay=5e-4,  # on conv and linear weights only: less memorising
              label_smoothing=0.1,  # training loss only: soft targets, no over-confident logits
              auto_augment="ta_wide")  # TrivialAugment after crop (4 px) and flip: less memorising


def average_gradients(model, world_size):
    """The slides' gradient averaging: all_reduce the gradients, then divide by the number of
    ranks.  In one message, not 86: each gradient is copied into its slice of one flat tensor
    (viewed with its parameter's strides, so a channels_last gradient is copied as it lies), and
    after the all_reduce each .grad is that averaged slice."""
    if world_size == 1:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.empty(sum(p.numel() for p in params), device=params[0].device)
    slices = [part.as_strided(p.shape, p.stride())
              for part, p in zip(flat.split([p.numel() for p in params]), params)]
    for grad, p in zip(slices, params):
        grad.copy_(p.grad)
    dist.all_reduce(flat)
    flat /= world_size
    for grad, p in zip(slices, params):
        p.grad = grad


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="cifar100", arch="hw4")
    flags.add_distributed_flags(parser)
    return parser.parse_args(argv)


def train_one_epoch(model, criterion, optimizer, scheduler, train_loader, epoch, run, comm,
                    resumed=None, straggler_delay=0.0):
    """One pass over this rank's shard: forward, backward, the average over ranks, SGD step (from
    the batch a stopped pass reached, `resumed`); its metrics over all ranks, stopped early,
    by every rank at the same step, when any is asked to stop."""
    model.train()
    metrics = training.EpochMetrics(run, epoch, len(train_loader), scheduler.get_last_lr()[0],
                                    resumed, comm)
    for images, labels in train_loader.epoch_batches(epoch, start=metrics.step):
        with run.autocast():
            output = model(images)
            loss = criterion(output, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        time.sleep(straggler_delay)  # --straggler-delay on rank 1: every rank waits for it
        average_gradients(model, comm.world_size)  # every rank holds the global batch's mean,
        optimizer.step()  # and takes the same step: the replicas stay identical
        scheduler.step()
        metrics.update(loss, output, labels)
        if comm.anyone_stopping(run, metrics.step, metrics.steps):  # a rerun resumes here
            return metrics.end(stopped=True)
    return metrics.end()


def main(argv=None):
    args = parse_args(argv)
    launch = detect_launch()
    world = launch.world_size
    if args.batch_size < world:
        raise UserError(f"--batch-size {args.batch_size} is smaller than the {world} ranks; use "
                        f"at least {world} (strong scaling: it is the global batch)")
    run = start_run(args, SCRIPT, launch.rank, world, launch.local_rank)
    folder = RunFolder(args, run, TARGET if args.dataset == "cifar100" else None)
    with distributed.process_group(args, run, launch) as comm:
        comm.check_same_flags(args)  # one recipe for every rank
        train_set, test_set = data.load_datasets(args.dataset, args, comm)  # shared decoding
        shard = dict(rank=comm.rank, world_size=world)  # this rank's shards
        train_loader = make_loader(train_set, args, run, train=True,
                                   batch_size=args.batch_size // world, **shard)
        test_loader = make_loader(test_set, args, run, train=False, **shard)
        model = run.prepare(build_model(args.arch, len(train_set.classes), args.dropout))
        comm.broadcast_parameters(model)  # 1. every rank starts from rank 0's weights
        criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                    momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
        scheduler = training.warmup_cosine(optimizer, args, len(train_loader))

        state = folder.resume(model, optimizer, scheduler, comm)  # rank 0's, on every rank
        if args.evaluate:  # (a rank lost meanwhile: one line, exit 200)
            with lost_peer(run, state):
                return training.evaluate_checkpoint(model, test_loader, run, state, comm)
        run.log(training.describe(run, args, model, train_set, test_set,
                                  f"{world} ranks x batch {args.batch_size // world} = global "
                                  f"batch {args.batch_size // world * world}"))
        folder.write_config(state)

        delay = args.straggler_delay if comm.rank == 1 else 0.0
        with lost_peer(run, state):  # a dead or silent rank: one line, exit 200
            for epoch in range(state.epoch, args.epochs):
                metrics = train_one_epoch(model, criterion, optimizer, scheduler, train_loader,
                                          epoch, run, comm, state.take_partial(), delay)
                comm.average_buffers(model)  # BatchNorm statistics: one model, the one saved
                if metrics.stopped:
                    folder.stop(state, metrics)  # checkpoint this step, exit 128 + signal
                test_loss, test_acc = training.evaluate(model, test_loader, run, comm)
                folder.end_epoch(state, metrics.row(test_loss, test_acc, state.rows))
        run.log(f"final test accuracy: {state.rows[-1]['test_acc']:.2f}%")
        comm.wait_for_all_ranks()


if __name__ == "__main__":
    execute(main)
