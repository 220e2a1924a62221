"""The collectives the scripts use, on the device their backend takes; one that fails because
another rank died or went silent is one line and the retryable exit 200 (common/peers.py)."""
import datetime
import functools
import io
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from .checkpoint import RANK_FLAGS, load_plain, recipe_difference
from .peers import is_peer_failure, peer_lost_as
from .run import UserError


def lost_peer(run, state):
    """`peer_lost_as` for the training loop: the line names the checkpoint kept (`state`'s, as
    it is when the peer is lost).  A world of 1 has no peer to lose."""
    if run.world_size == 1:
        return nullcontext()
    return peer_lost_as(lambda why: f"rank {run.rank} lost contact with another rank ({why}); "
                                    f"the last good checkpoint (epoch {state.epoch}) is kept in "
                                    f"{run.out}; restart the job to resume")


def before_training(method):
    """A collective of the start-up (the recipe check, the checkpoint, the first weights): a
    rank that stopped before training began, or went silent, ends the others with one line."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with lost_before_training(self.rank):
            return method(self, *args, **kwargs)
    return guarded


def lost_before_training(rank):
    return peer_lost_as(lambda why: f"rank {rank} lost contact with another rank before "
                                    f"training began ({why}); that rank's own output says why; "
                                    "the same command tries again")


class Comm:
    """The collectives the scripts use; with a world of 1 each is a no-op."""

    def __init__(self, rank, world_size, backend=None, timeout=None):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timeout  # --timeout (a timedelta), for the groups made later too

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor

    def anyone_stopping(self, run, step, steps, every=10):
        """Has any rank been asked to stop (SIGTERM/SIGINT)?  The ranks agree every `every`
        steps and at the last of `steps` (a tiny all_reduce): all stop after the same step."""
        if self.world_size == 1:
            return run.stop.signum is not None
        if step % every and step < steps:
            return False
        signum = torch.tensor([run.stop.signum or 0], device=run.device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        run.stop.signum = run.stop.signum or int(signum.item()) or None
        return run.stop.signum is not None

    def device(self):
        """Where this backend's collectives take their tensors: the CPU, but for a backend
        registered for CUDA alone, as nccl is (then this rank's GPU, the current device)."""
        cpu = "cpu" in dist.Backend.backend_capability.get(self.backend, ["cpu"])
        return torch.device("cpu" if cpu else "cuda")

    def cpu_group(self, ranks=None):
        """A group of `ranks` (every rank by default) whose collectives take CPU tensors, made
        by every rank together.  Under nccl, a gloo group beside it: what the ranks share in host
        memory (TinyImageNet decoded, 1.2 GB) travels as it lies, not through GPU memory that
        training needs, nor copied there and back, for a broadcast made once a run."""
        if ranks is None and self.device().type == "cpu":
            return dist.group.WORLD
        return dist.new_group(ranks, timeout=self.timeout,
                              backend=None if self.device().type == "cpu" else "gloo")

    @before_training
    def check_same_flags(self, args):
        """Every rank runs rank 0's recipe: a wrapper that gives one rank another --seed would
        silently overlap the shards, another --batch-size break a collective."""
        if self.world_size == 1:
            return
        ours = vars(args)
        differ = recipe_difference(self.broadcast_state(ours), ours, set(ours) - RANK_FLAGS)
        anyone = torch.tensor([float(differ is not None)], device=self.device())
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        if anyone.item():
            why = (f"{differ[0]} is {differ[2]} here but {differ[1]} on rank 0" if differ else
                   "another rank was started with other flags than rank 0 (its line names the "
                   "flag)")
            raise UserError(f"rank {self.rank}: {why}; start every rank with the same flags")

    @before_training
    def broadcast_state(self, obj, src=0):
        """Rank `src`'s plain data (what a checkpoint holds) on every rank, as torch.save writes
        it (broadcast_object_list pickles each tensor with its whole storage: an async server's
        checkpoint, views into one flat vector, grew 30-fold), read with weights_only."""
        if self.world_size == 1:
            return obj
        device = self.device()
        if self.rank == src:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel() if self.rank == src else 0], device=device)
        dist.broadcast(size, src=src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=src)
        return obj if self.rank == src else load_plain(io.BytesIO(data.cpu().numpy().tobytes()))

    @before_training
    def broadcast_parameters(self, model, src=0):
        """Every rank starts from rank `src`'s weights and buffers.  A collective sends memory
        as it lies: a channels_last tensor goes through a contiguous copy, or arrives permuted."""
        if self.world_size == 1:
            return
        for tensor in list(model.parameters()) + list(model.buffers()):
            data = tensor.data if tensor.is_contiguous() else tensor.data.contiguous()
            dist.broadcast(data, src=src)
            if data is not tensor.data:
                tensor.data.copy_(data)

    @contextmanager
    def apart(self):
        """Around work the ranks do at different speeds by design (async SGD's server decodes
        10,000 images, each worker 100,000 / n): then they meet in a barrier of a gloo group that
        --timeout does not bound, made before they part.  A rank that dies meanwhile still ends
        the wait at once, as its connection closes (mpi has no timeout to lift)."""
        patient = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1)) \
            if self.world_size > 1 and self.backend != "mpi" else None
        yield
        with lost_before_training(self.rank):
            if self.world_size > 1:
                dist.barrier(group=patient)

    def average_buffers(self, model):
        """Average BatchNorm running statistics so that every rank evaluates one model."""
        for buf in model.buffers():
            if buf.is_floating_point():
                self.all_reduce(buf.data).div_(self.world_size)

    def wait_for_all_ranks(self):
        """After a successful run: every rank done with its collectives before any tears gloo
        down.  A rank gone by then has done its part: the run is complete all the same."""
        if self.world_size > 1:
            try:
                dist.barrier()
            except RuntimeError as exc:
                if not is_peer_failure(exc):
                    raise
