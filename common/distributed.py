"""The process group: started within --timeout (in torchrun's store under torchrun, so that a
group torchrun restarts meets again; elsewhere over TCP at the master's address, which
common/launch.py finds), or ended with one line and the retryable exit 200."""
import datetime
import os
import sys
import time
from contextlib import contextmanager

import torch.distributed as dist

from .collectives import Comm
from .network import check_torchrun_master, choose_gloo_interface
from .peers import failure_line
from .run import PeerLost, UserError

STARTUP_MARGIN = 5.0  # seconds past --timeout before a start-up that has not returned is ended


def import_before_init():
    """torch.distributed.nn binds `group=group.WORLD` as a default when imported (torch._dynamo
    imports it): imported after init_process_group it holds the group for ever, gloo's threads
    outlive main(), and the process may abort at exit.  Imported first, it binds None."""
    import torch.distributed.nn  # noqa: F401


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


@contextmanager
def process_group(args, run, launch, backend=None):
    """torch.distributed for this launch, as a Comm (nothing to start for a world of 1), torn
    down on the way out.  Rank 0 says first what it found (and the network interface it chose
    for gloo, if it had to)."""
    backend = backend or resolve_backend(args.backend, run.device)
    line = f"{launch.describe()} | backend {backend}"
    if launch.world_size > 1:
        import_before_init()
        if launch.launcher == "torchrun":
            check_torchrun_master(launch)
        # nccl too: a gloo group beside it carries what the ranks share in host memory
        interface = choose_gloo_interface(launch.master_addr) if backend != "mpi" else None
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
            line += (f" | gloo interface {interface} (the route to the master; this host's name "
                     "gives only loopback; set GLOO_SOCKET_IFNAME to choose another)")
    run.log(line)
    if launch.world_size > 1:
        start_process_group(backend, launch, args.timeout, run.stop)
    try:
        yield Comm(launch.rank, launch.world_size, backend,
                   datetime.timedelta(seconds=args.timeout))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_process_group(backend, launch, timeout, stop):
    """init_process_group, which returns once every rank has joined -- or fails, in one line
    and exit 200, after `timeout` seconds; at once on SIGTERM/SIGINT (`stop`)."""
    where = f"{launch.master_addr}:{launch.master_port}"
    late = (f"error: rank {launch.rank}: the {launch.world_size} ranks did not all join within "
            f"--timeout {timeout:g} s at {where}; check that every rank was started and reaches "
            "that address; the same command tries again")
    with stop.waiting(f"waiting for the other ranks at {where}", timeout + STARTUP_MARGIN, late,
                      PeerLost.exit_code), held_back_stderr():
        try:  # in torchrun's store, or in one that rank 0 serves at the master's address
            meet = (dict(store=torchrun_store(launch, timeout)) if launch.launcher == "torchrun"
                    else dict(init_method=f"tcp://{where}"))
            dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                    timeout=datetime.timedelta(seconds=timeout), **meet)
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
    """torchrun's store, under a prefix of its own for each start of the group: its agent
    keeps the store when it restarts the workers, with the keys the failed group left (every
    rank's gloo address), which a restarted group would connect to.  Rank 0 opens a new
    generation of keys at each start; every other rank waits for one newer than the last its
    rank joined.  (The agents of several nodes count restarts differently.)"""
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
    """Discard what torch's C++ code writes to stderr (fd 2) meanwhile: waiting for the other
    ranks, the TCPStore client logs each failed attempt with a stack trace, and the outcome is
    said in one line anyway.  Not with TORCH_CPP_LOG_LEVEL or TORCH_DISTRIBUTED_DEBUG set."""
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
