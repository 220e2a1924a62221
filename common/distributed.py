"""torch.distributed for the scripts: start the process group (within --timeout, through
torchrun's store when torchrun restarts it), the collectives the scripts use, the async
server's receives (`Inbox`), and telling a lost peer from a bug.

The backend is chosen by `resolve_backend`: nccl on CUDA, gloo on CPU.  Under torchrun the
group meets in torchrun's own store (so that a restarted group meets again), elsewhere over
TCP at the master's address (common/launch.py finds it).  Start-up waits at most --timeout
for the other ranks, then every rank exits with one line and a retryable status.

Over 250 lines because each collective the scripts use must tell a lost peer from a bug, from
the start-up wait to the last barrier, and that is one concern held in one place.
"""
import datetime
import functools
import io
import os
import queue
import re
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from .checkpoint import load_plain
from .flags import RANK_FLAGS, recipe_difference
from .launch import check_torchrun_master, choose_gloo_interface
from .process import PeerLost, UserError


def is_peer_failure(exc):
    """Did a collective fail because another rank died or stopped answering?"""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(marker in text for marker in (
        "gloo", "Connection reset", "Connection closed", "Timed out", "NCCL", "timed out",
        "pair closure"))


class Inbox:
    """The receiving end of a rank that serves several peers (the async parameter server):
    each message as it arrives, whichever peer sent it, and which peer is lost, the moment its
    connection breaks or once it has sent nothing for `timeout` seconds since it was expected.

    With gloo, a thread per peer waits in a receive from that peer alone and hands each
    message over in the order they arrive.  (A receive from any source cannot say which peer
    is gone: the server went on serving the other workers while a killed, hung or cut-off
    worker's shard went untrained, until they had finished and --timeout had passed.)  A
    thread receives once its peer's next message is `expect`ed (after the reply to its last),
    into a buffer of its own.  The timeout is kept here, not by gloo, which closes every pair
    of the group when one receive times out: the others can still be told to stop.  The mpi
    backend runs one operation at a time, so there it is one receive from any source.

    `on_arrival(peer, message)` is called the moment a message lands (from the receiving
    thread), for what must not wait until the caller's loop is free to read it."""

    def __init__(self, peers, size, timeout, on_arrival):
        self.arrived, self.timeout, self.on_arrival = queue.Queue(), timeout, on_arrival
        self.threaded = dist.get_backend() == "gloo"
        self.messages = {p: torch.zeros(size) for p in peers}
        self.allowed = {p: threading.Semaphore(0) for p in peers}  # receive its next now
        self.due = {}  # the time by which each expected peer's next message must come
        for p in peers:
            self.expect(p)
            if self.threaded:
                threading.Thread(target=self.receive, args=(p,), daemon=True).start()

    def receive(self, peer):
        while True:
            self.allowed[peer].acquire()
            try:
                # no gloo timeout: after one receive times out, gloo closes every pair
                dist.irecv(self.messages[peer], src=peer).wait(datetime.timedelta(days=365))
            except RuntimeError as exc:  # it died (gloo's error says so)
                self.arrived.put((peer, exc))
                return
            self.on_arrival(peer, self.messages[peer])
            self.arrived.put((peer, None))

    def expect(self, peer):
        """Receive `peer`'s next message (its buffer is free again) within the timeout."""
        self.due[peer] = time.monotonic() + self.timeout
        self.allowed[peer].release()

    def next(self):
        """(peer, its message, None), or (peer, None, why it is lost): the error its receive
        failed with, or a TimeoutError.  Without threads the peer may be None."""
        if not self.threaded:  # one receive from any source, with the group's timeout
            message = next(iter(self.messages.values()))
            try:
                peer = dist.recv(message)
            except RuntimeError as exc:
                return None, None, exc
            self.on_arrival(peer, message)
            return peer, message, None
        while True:
            late = min(self.due, key=self.due.get)
            try:
                peer, error = self.arrived.get(timeout=max(self.due[late] - time.monotonic(), 0))
            except queue.Empty:
                if time.monotonic() < self.due[late]:
                    continue
                del self.due[late]
                return late, None, TimeoutError(f"it sent nothing for --timeout "
                                                f"{self.timeout:g} s")
            del self.due[peer]
            return peer, None if error else self.messages[peer], error


class Heartbeat:
    """Tells the peers that wait for this rank's last word (async workers done with their part,
    waiting for the server to release them) that it lives: a beat every quarter of `timeout`,
    from a thread of its own.  Such a peer may wait far longer than `timeout` for the others'
    work, yet knows within `timeout` when this rank dies, hangs or is cut off."""

    ALIVE = -2.0  # not a status the last word can have (0 or an exit status)

    def __init__(self, timeout):
        self.period, self.peers, self.lock = timeout / 4, set(), threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.beat, daemon=True)
        self.thread.start()

    def add(self, peer):
        with self.lock:
            self.peers.add(peer)

    def beat(self):
        alive = torch.tensor([self.ALIVE])
        while not self.stopped.wait(self.period):
            with self.lock:
                peers = sorted(self.peers)
            for peer in peers:
                try:
                    dist.isend(alive, dst=peer).wait()
                except RuntimeError:  # gone: its release will find it so, and say it
                    with self.lock:
                        self.peers.discard(peer)

    def stop(self):
        """No more beats: the last word can follow."""
        self.stopped.set()
        self.thread.join()


def failure_line(exc, limit=160):
    """What a collective's error says, in a few words: its first line without the source
    location gloo puts first or its advice to check the remote logs (the line that quotes it
    says what happened to whom); if still long, its end, where the useful part is."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically caused")[0]
    return text[-limit:]


def resolve_backend(name, device):
    """nccl on CUDA, gloo on CPU; mpi only where this torch was built with it."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "mpi" and not dist.is_mpi_available():
        raise UserError("--backend mpi: this torch was built without MPI support "
                        "(pip's is); use --backend gloo or nccl -- ranks still come from MPI")
    if name == "nccl" and device.type != "cuda":
        raise UserError("--backend nccl needs CUDA tensors; use --backend gloo with --device cpu")
    return name


def start_up_collective(method):
    """A collective of the start-up (the recipe check, the checkpoint, the first weights),
    where a rank that stopped before training began (bad input there, a crash) or went silent
    ends the others with one line and the retryable exit, not gloo's traceback."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            if not is_peer_failure(exc):
                raise
            raise PeerLost(f"rank {self.rank} lost contact with another rank before training "
                           f"began ({failure_line(exc)}); that rank's own output says why; "
                           "the same command tries again") from None
    return guarded


class Comm:
    """The collectives the scripts use; with a world of 1 each is a no-op."""

    def __init__(self, launch, backend=None):
        self.launch, self.backend = launch, backend
        self.rank, self.world_size = launch.rank, launch.world_size
        self.local_rank = launch.local_rank

    def all_reduce_sum(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_max(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def device(self):
        """Where this backend's collectives take their tensors: nccl takes CUDA tensors only."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")

    @start_up_collective
    def check_same_flags(self, args):
        """Every rank runs rank 0's recipe: a wrapper that gives one rank another --seed would
        silently overlap the shards, another --batch-size break a collective.  One line on
        every rank otherwise (the differing rank's names the flag)."""
        if self.world_size == 1:
            return
        ours = vars(args)
        differ = recipe_difference(self.broadcast_state(ours), ours, set(ours) - RANK_FLAGS)
        anyone = torch.tensor([float(differ is not None)], device=self.device())
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        if differ:
            raise UserError(f"rank {self.rank}: {differ[0]} is {differ[2]} here but {differ[1]} "
                            "on rank 0; start every rank with the same flags")
        if anyone.item():
            raise UserError(f"rank {self.rank}: another rank was started with other flags than "
                            "rank 0 (its line names the flag); start every rank with the same "
                            "flags")

    @start_up_collective
    def broadcast_state(self, obj, src=0):
        """Rank `src`'s plain data (what a checkpoint holds) on every rank, as torch.save writes
        it, read with weights_only.  Not broadcast_object_list: it pickles each tensor with its
        whole storage, so an async server's checkpoint (views into one flat vector) grew from
        43 MB to 1.25 GB, and workers still unpickling it missed rank 0's next collective."""
        if self.world_size == 1:
            return obj
        device = self.device()
        data = pack_state(obj).to(device) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0], device=device)
        dist.broadcast(size, src=src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=src)
        return obj if self.rank == src else unpack_state(data.cpu())

    @start_up_collective
    def broadcast_parameters(self, model, src=0):
        """Synchronous initialisation: every rank starts from rank `src`'s weights and buffers.
        A collective sends memory as it lies: a channels_last tensor (an async worker's with
        --amp, its server's is not) goes through a contiguous copy, or arrives permuted."""
        if self.world_size == 1:
            return
        for tensor in list(model.parameters()) + list(model.buffers()):
            laid_out = tensor.is_contiguous()
            data = tensor.data if laid_out else tensor.data.contiguous()
            dist.broadcast(data, src=src)
            if not laid_out:
                tensor.data.copy_(data)

    def average_buffers(self, model):
        """Average BatchNorm running statistics so that every rank evaluates one model."""
        if self.world_size == 1:
            return
        for buf in model.buffers():
            if buf.is_floating_point():
                dist.all_reduce(buf.data)
                buf.data /= self.world_size

    def finish(self):
        """After a successful run: wait until every rank is done with its collectives, so
        that none tears gloo down while another is still completing one.  A rank gone by
        then has done its part: the run is complete all the same."""
        if self.world_size > 1:
            try:
                dist.barrier()
            except RuntimeError as exc:
                if not is_peer_failure(exc):
                    raise

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def pack_state(obj):
    """`obj` as torch.save writes it (each storage once, however many views share it)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def unpack_state(data):
    """What `pack_state` packed, read as a checkpoint is: plain data, never code."""
    return load_plain(io.BytesIO(data.numpy().tobytes()))


def import_before_init():
    """torch.distributed.nn's functions take `group=group.WORLD` as a default argument, bound
    when the module is imported -- which torch._dynamo does, e.g. when an optimizer is built.
    Imported after init_process_group, they hold the default group forever: destroy_process_group
    then cannot free it, gloo's worker threads outlive main(), and one that drops its last work
    while the interpreter shuts down aborts the process ("terminate called without an active
    exception", exit -6 after a successful run).  Imported first, they bind None."""
    import torch.distributed.nn  # noqa: F401


STARTUP_MARGIN = 5.0  # seconds past --timeout before a start-up that has not returned is ended


def start(args, proc, launch, backend=None):
    """Start torch.distributed for this launch (nothing to start for a world of 1).

    Rank 0 says first what it found (and the network interface it chose for gloo, if it had
    to).  Start-up ends within --timeout (plus a margin) if the ranks have not all joined, and
    at once on SIGTERM/SIGINT."""
    backend = backend or resolve_backend(args.backend, proc.device)
    line = f"{launch.describe()} | backend {backend}"
    if launch.world_size > 1:
        import_before_init()
        if launch.launcher == "torchrun":
            check_torchrun_master(launch)
        interface = choose_gloo_interface(launch.master_addr) if backend == "gloo" else None
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
            line += (f" | gloo interface {interface} (the route to the master; this host's name "
                     "gives only loopback; set GLOO_SOCKET_IFNAME to choose another)")
    if launch.rank == 0:
        print(line, flush=True)
    if launch.world_size > 1:
        start_process_group(backend, launch, args.timeout, proc.stop)
    return Comm(launch, backend)


@contextmanager
def lost_peer(proc, state):
    """Turn a collective that failed because another rank died or went silent for --timeout
    into one line and a retryable exit (PeerLost), naming the checkpoint kept (`state`)."""
    try:
        yield
    except RuntimeError as exc:
        if proc.world_size == 1 or not is_peer_failure(exc):
            raise
        raise PeerLost(f"rank {proc.rank} lost contact with another rank ({failure_line(exc)}); "
                       f"the last good checkpoint (epoch {state.epoch}) is kept in {proc.out}; "
                       "restart the job to resume") from None


def start_process_group(backend, launch, timeout, stop=None):
    """init_process_group, which returns once every rank has joined -- or fails, in one line
    with a retryable status, after `timeout` seconds.

    Under torchrun the group meets in torchrun's own store (`torchrun_store`), so that a group
    torchrun restarts after losing a rank starts again; elsewhere rank 0 serves the store at
    MASTER_ADDR:MASTER_PORT (``tcp://``)."""
    where = f"{launch.master_addr}:{launch.master_port}"
    late = (f"error: rank {launch.rank}: the {launch.world_size} ranks did not all join within "
            f"--timeout {timeout:g} s at {where}; check that every rank was started and reaches "
            "that address; the same command tries again")
    guard = nullcontext() if stop is None else stop.waiting(
        f"waiting for the other ranks at {where}", limit=timeout + STARTUP_MARGIN,
        expired=late, expired_code=PeerLost.exit_code)
    with guard, held_back_stderr():
        try:
            limit = datetime.timedelta(seconds=timeout)
            if launch.launcher == "torchrun":
                dist.init_process_group(backend, store=torchrun_store(launch, timeout),
                                        rank=launch.rank, world_size=launch.world_size,
                                        timeout=limit)
            else:
                dist.init_process_group(backend, init_method=f"tcp://{where}", rank=launch.rank,
                                        world_size=launch.world_size, timeout=limit)
        except (RuntimeError, OSError) as exc:  # DistError, TimeoutError, refused connections
            if "EADDRINUSE" in str(exc) and os.environ.get("MASTER_PORT"):  # not one we drew
                raise UserError(f"rank {launch.rank}: MASTER_PORT {launch.master_port} is in use "
                                f"on this host (another program or run listens there); set "
                                "MASTER_PORT to a free port") from None
            raise PeerLost(f"rank {launch.rank}: could not start the process group of "
                           f"{launch.world_size} ranks at {where} within --timeout {timeout:g} s "
                           f"({failure_line(exc, 120)}); check that every rank was started and "
                           "reaches that address; the same command tries again") from None


def torchrun_store(launch, timeout):
    """torchrun's store, under a prefix of its own for each start of the group.

    torchrun's agent serves a store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE)
    and keeps it when it restarts the workers, with the keys the failed group left there: every
    rank's gloo address.  A restarted group that read them would connect to dead ranks (the
    "connectFullMesh ... Connection refused" of a plain ``env://`` or ``tcp://`` start-up).  So
    rank 0 opens a new generation of keys each time it starts, and every other rank waits for
    a generation newer than the last one its rank joined.  (torchrun's restart count would do
    on one node, but the agents of several nodes count restarts differently.)"""
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=launch.rank == 0 and not agent_serves,
                          timeout=datetime.timedelta(seconds=timeout))
    if launch.rank == 0:
        generation = store.add("hw4/generation", 1)
    else:
        joined = f"hw4/joined/{launch.rank}"
        last = store.add(joined, 0)
        deadline = time.monotonic() + timeout
        while (generation := store.add("hw4/generation", 0)) <= last:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not start a new group within {timeout:g} s")
            time.sleep(0.1)
        store.add(joined, generation - last)
    return dist.PrefixStore(f"hw4/{generation}", store)


@contextmanager
def held_back_stderr():
    """Discard what is written to stderr (file descriptor 2, where torch's C++ code logs)
    meanwhile: while it waits for the other ranks, the TCPStore client logs every failed
    attempt with a C++ stack trace, and the outcome is said in one line anyway.  With
    TORCH_CPP_LOG_LEVEL or TORCH_DISTRIBUTED_DEBUG set, nothing is held back."""
    if os.environ.get("TORCH_CPP_LOG_LEVEL") or os.environ.get("TORCH_DISTRIBUTED_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
