"""What started this process: its rank, world size, local rank and master address.  Launchers
(first match wins):

* torchrun and a Kubeflow PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set;
* an MPI launcher -- mpirun/mpiexec of Open MPI (also an MPIJob's), MPICH / Intel MPI (PMI_*),
  aprun on a Cray (ALPS_APP_PE), PMIx, or srun (SLURM_PROCID): rank and size come from
  mpi4py, and rank 0 shares its address and a free port through MPI;
* a Kubeflow Trainer v2 TrainJob run with plain python: the PET_* variables, a process a node;
* nothing: a world of 1.
"""
import os
from dataclasses import dataclass

from .network import free_port, reachable_address
from .run import UserError

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
    restart: int = 0  # torchrun's restart count

    def describe(self):
        return (f"distributed: launcher {self.launcher} | rank {self.rank} of world "
                f"{self.world_size} | local rank {self.local_rank} | master "
                f"{self.master_addr}:{self.master_port}"
                + (f" | restart {self.restart}" if self.restart else ""))


def detect_launch(env=None):
    """What started this process, and this process's place in the world; launcher variables
    set by hand that are no numbers, or out of range, as one line."""
    env = os.environ if env is None else env
    try:
        launch = _detect(env)
    except ValueError as exc:  # int() of RANK=x, MASTER_PORT=abc, ...
        raise UserError(f"a launcher variable is not a whole number ({exc}); check RANK, "
                        "WORLD_SIZE, LOCAL_RANK and MASTER_PORT (PET_* for a TrainJob)") from None
    if not 0 <= launch.rank < launch.world_size or launch.local_rank < 0 \
            or not 0 < launch.master_port < 65536:
        raise UserError(f"{launch.launcher}: rank {launch.rank} of world {launch.world_size}, "
                        f"local rank {launch.local_rank}, port {launch.master_port}: out of "
                        "range; check RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT")
    return launch


def _detect(env):
    if "RANK" in env and "WORLD_SIZE" in env:
        name = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "environment (PyTorchJob)"
        if "MASTER_ADDR" not in env:
            raise UserError(f"{name}: RANK and WORLD_SIZE are set but MASTER_ADDR is not; "
                            "set MASTER_ADDR and MASTER_PORT to rank 0's address")
        return Launch(name, int(env["RANK"]), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_RANK", 0)), env["MASTER_ADDR"],
                      int(env.get("MASTER_PORT", DEFAULT_PORT)),
                      int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    for variable, name in MPI_LAUNCHERS:
        if variable in env:
            if variable == "SLURM_PROCID" and int(env.get("SLURM_NTASKS", "1")) == 1:
                continue  # a batch script's own shell, not an srun step of several tasks
            return _launch_from_mpi(name, env)
    if "PET_NNODES" in env:
        return _launch_from_trainjob(env)
    return Launch("none (a world of 1)")


def _launch_from_trainjob(env):
    """A Trainer v2 TrainJob runs `torchrun` with its PET_* variables; a command of plain
    `python` gets them too and runs one process per node: rank = node rank."""
    name = "TrainJob (PET_* variables)"
    nnodes, nproc = env["PET_NNODES"], env.get("PET_NPROC_PER_NODE", "1")
    if nproc != "1":
        raise UserError(f"{name}: PET_NPROC_PER_NODE={nproc} is not one process per node, "
                        "which is all plain python can be; run the script under torchrun "
                        "(torchrun SCRIPT ARGS: it reads the PET_* variables itself)")
    if not nnodes.isdigit() or int(nnodes) < 1:
        raise UserError(f"{name}: PET_NNODES={nnodes} is not a number of nodes; an elastic range "
                        "needs torchrun (torchrun SCRIPT ARGS)")
    if int(nnodes) > 1 and "PET_MASTER_ADDR" not in env:
        raise UserError(f"{name}: PET_NNODES={nnodes} but PET_MASTER_ADDR is not set; set it and "
                        "PET_MASTER_PORT to node 0's address")
    return Launch(name, int(env.get("PET_NODE_RANK", 0)), int(nnodes), 0,
                  env.get("PET_MASTER_ADDR", "127.0.0.1"),
                  int(env.get("PET_MASTER_PORT", DEFAULT_PORT)))


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
    if rank == 0:
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1
                                          else reachable_address())
        port = int(env.get("MASTER_PORT") or free_port())
    addr, port = comm.bcast((addr, port) if rank == 0 else None, root=0)
    return Launch(name, rank, size, local_rank, addr, port)
