"""Rank, world size, local rank and master address, whatever started the processes.

Launchers recognised (first match wins):

* ``torchrun`` and a Kubeflow PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
  (torchrun also sets LOCAL_RANK; a PyTorchJob runs one process per pod, local rank 0);
* an MPI launcher -- ``mpirun``/``mpiexec`` of Open MPI (OMPI_COMM_WORLD_*, also an MPIJob's
  launcher), MPICH / Intel MPI (PMI_RANK, PMI_SIZE), ``aprun`` on a Cray (ALPS_APP_PE),
  PMIx, or ``srun`` (SLURM_PROCID): rank and size come from mpi4py, and rank 0 shares its
  address and a free port through MPI (never parsed out of ifconfig);
* nothing: a world of 1.

torch.distributed then starts over TCP with the backend chosen by `resolve_backend`.
"""
import datetime
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from .errors import UserError

MPI_LAUNCHERS = (
    ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
    ("PMI_SIZE", "MPI (PMI: MPICH / Intel MPI / Cray)"),
    ("ALPS_APP_PE", "aprun (Cray ALPS)"),
    ("PMIX_RANK", "MPI (PMIx)"),
    ("SLURM_PROCID", "srun (Slurm)"),
)
DEFAULT_PORT = 29500


@dataclass
class Launch:
    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT

    def describe(self):
        return (f"distributed: launcher {self.launcher} | rank {self.rank} of world "
                f"{self.world_size} | local rank {self.local_rank} | master "
                f"{self.master_addr}:{self.master_port}")


def detect_launch(env=None):
    """What started this process, and this process's place in the world."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        name = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "environment (PyTorchJob)"
        if "MASTER_ADDR" not in env:
            raise UserError(f"{name}: RANK and WORLD_SIZE are set but MASTER_ADDR is not; "
                            "set MASTER_ADDR and MASTER_PORT to rank 0's address")
        return Launch(name, int(env["RANK"]), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_RANK", 0)), env["MASTER_ADDR"],
                      int(env.get("MASTER_PORT", DEFAULT_PORT)))
    for variable, name in MPI_LAUNCHERS:
        if variable in env:
            if variable == "SLURM_PROCID" and int(env.get("SLURM_NTASKS", "1")) == 1:
                continue  # a batch script's own shell, not an srun step of several tasks
            return _launch_from_mpi(name, env)
    return Launch("none (a world of 1)")


def _launch_from_mpi(name, env):
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise UserError(f"started by {name}, but mpi4py cannot be imported ({exc}); "
                        "pip install mpi4py (built against this MPI)") from None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank).Get_rank()
    hosts = comm.allgather(MPI.Get_processor_name())
    where = None
    if rank == 0:
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1
                                          else reachable_address())
        port = int(env.get("MASTER_PORT") or free_port())
        where = (addr, port)
    addr, port = comm.bcast(where, root=0)
    return Launch(name, rank, size, local_rank, addr, port)


def reachable_address():
    """This host's address as other hosts see it (its fully qualified name's IP)."""
    name = socket.getfqdn()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return name
    return name if addr.startswith("127.") else addr


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def is_peer_failure(exc):
    """Did a collective fail because another rank died or stopped answering?"""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(marker in text for marker in (
        "gloo", "Connection reset", "Connection closed", "Timed out", "NCCL", "timed out"))


def failure_line(exc, limit=160):
    """The end of the first line of a collective's error: where the useful part is (gloo and
    NCCL prefix it with long source locations)."""
    return str(exc).splitlines()[0][-limit:] if str(exc) else type(exc).__name__


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

    def broadcast_object(self, obj, src=0):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_parameters(self, model, src=0):
        """Synchronous initialisation: every rank starts from rank `src`'s weights and buffers."""
        if self.world_size == 1:
            return
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=src)

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
        that none tears gloo down while another is still completing one."""
        if self.world_size > 1:
            dist.barrier()

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def import_before_init():
    """torch.distributed.nn's functions take `group=group.WORLD` as a default argument, bound
    when the module is imported -- which torch._dynamo does, e.g. when an optimizer is built.
    Imported after init_process_group, they hold the default group forever: destroy_process_group
    then cannot free it, gloo's worker threads outlive main(), and one that drops its last work
    while the interpreter shuts down aborts the process ("terminate called without an active
    exception", exit -6 after a successful run).  Imported first, they bind None."""
    import torch.distributed.nn  # noqa: F401


def init_distributed(args, device, launch=None, backend=None):
    """Start torch.distributed for this launch (nothing to start for a world of 1)."""
    launch = launch or detect_launch()
    backend = backend or resolve_backend(args.backend, device)
    if launch.world_size > 1:
        import_before_init()
        dist.init_process_group(
            backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank, world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=args.timeout))
    if launch.rank == 0:
        print(f"{launch.describe()} | backend {backend}", flush=True)
    return Comm(launch, backend)


def add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl", "mpi"], default="auto",
                   help="torch.distributed backend (auto: nccl on CUDA, else gloo)")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait for the other ranks before failing")
    return g
