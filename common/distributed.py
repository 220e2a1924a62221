"""Rank, world size, local rank and master address, whatever started the processes.

Launchers recognised (first match wins):

* ``torchrun`` and a Kubeflow PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
  (torchrun also sets LOCAL_RANK; a PyTorchJob runs one process per pod, local rank 0);
* an MPI launcher -- ``mpirun``/``mpiexec`` of Open MPI (OMPI_COMM_WORLD_*, also an MPIJob's
  launcher), MPICH / Intel MPI (PMI_RANK, PMI_SIZE), ``aprun`` on a Cray (ALPS_APP_PE),
  PMIx, or ``srun`` (SLURM_PROCID): rank and size come from mpi4py, and rank 0 shares its
  address and a free port through MPI (never parsed out of ifconfig);
* a Kubeflow Trainer v2 TrainJob whose command is plain ``python`` (not torchrun): the PET_*
  variables torchrun would read, one process per node;
* nothing: a world of 1.

torch.distributed then starts with the backend chosen by `resolve_backend`: under torchrun
through its own store (``env://``, so that a restarted group meets again), else over TCP at
the master's address.  Start-up waits at most --timeout for the other ranks.
"""
import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch.distributed as dist

from .errors import PeerLost, UserError

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
    """What started this process, and this process's place in the world."""
    env = os.environ if env is None else env
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
    where = None
    if rank == 0:
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1
                                          else reachable_address())
        port = int(env.get("MASTER_PORT") or free_port())
        where = (addr, port)
    addr, port = comm.bcast(where, root=0)
    return Launch(name, rank, size, local_rank, addr, port)


def reachable_address():
    """This host's address as other hosts see it: its fully qualified name's IP, unless that is
    a loopback address (Debian's /etc/hosts, containers); then the address of the interface of
    the default route, else of the first interface that is not loopback."""
    usable = [a for a in addresses_of(socket.getfqdn()) if not is_loopback(a)]
    if usable:
        return usable[0]
    interfaces = interface_addresses()
    route = default_route_interface()
    for name in ([route] if route in interfaces else []) + sorted(interfaces):
        if not is_loopback(interfaces[name]):
            return interfaces[name]
    raise UserError(f"this host's name {socket.getfqdn()} resolves to a loopback address and no "
                    "other interface has an IPv4 address; set MASTER_ADDR to an address of rank "
                    "0's host that the other hosts reach")


def is_loopback(addr):
    return ipaddress.ip_address(addr.split("%")[0]).is_loopback  # "%": an IPv6 scope


def addresses_of(host):
    """The addresses `host` (a name or an address) resolves to; [] if it does not."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]


def interface_addresses():
    """{interface name: its IPv4 address} (Linux's SIOCGIFADDR; {} where that is missing)."""
    found = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def default_route_interface():
    """The interface of the IPv4 default route (Linux's /proc/net/route), or None."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 1 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def _can_bind(addr):
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def route_source(addr):
    """The local address the kernel sends from to reach `addr`: connecting a UDP socket picks
    the route and sends nothing."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def choose_gloo_interface(master_addr):
    """The interface gloo must use, or None where gloo's own choice works.

    Gloo binds to the address this host's name resolves to, if it can, else to loopback.  Where
    the name resolves to 127.0.x.1 (Debian's /etc/hosts, many containers), or to no address of
    this host, while the master is another host, rank 0 would tell the others to connect to
    127.0.0.1, and start-up hangs.  Then the interface that routes to the master is the one."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    hostname = socket.gethostname()
    if any(not is_loopback(a) and _can_bind(a) for a in addresses_of(hostname)):
        return None
    master = addresses_of(master_addr)
    if master and all(is_loopback(a) for a in master):
        return None  # every rank is on this host
    hint = ("set GLOO_SOCKET_IFNAME to the network interface that reaches the master "
            "(ip -o addr lists them)")
    if not master:
        raise UserError(f"master address {master_addr} does not resolve here, and this host's "
                        f"name {hostname} gives gloo no address but loopback, so it cannot pick "
                        f"its network interface; {hint}")
    try:
        source = route_source(master[0])
    except OSError as exc:
        raise UserError(f"no route from this host to the master {master_addr} ({exc.strerror}); "
                        f"{hint}") from None
    for name, addr in interface_addresses().items():
        if addr == source:
            return name
    raise UserError(f"this host's name {hostname} gives gloo no address but loopback, and no "
                    f"interface has the address {source} that routes to the master {master_addr}; "
                    f"{hint}")


def check_torchrun_master(launch, env=None):
    """torchrun on several nodes advertises rank 0's node by its host name, unless started with
    --local-addr; where that name resolves to loopback, the other nodes would connect to
    themselves."""
    env = os.environ if env is None else env
    nodes = int(env.get("GROUP_WORLD_SIZE", 1))
    master = addresses_of(launch.master_addr)
    if nodes > 1 and master and all(is_loopback(a) for a in master):
        raise UserError(f"torchrun: MASTER_ADDR {launch.master_addr} (rank 0's node by name) "
                        f"resolves to loopback here, but the job spans {nodes} nodes; start "
                        "torchrun on every node with --local-addr set to that node's address "
                        "(and --rdzv-conf is_host=1 on the node of --rdzv-endpoint)")


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


STARTUP_MARGIN = 5.0  # seconds past --timeout before a start-up that has not returned is ended


def init_distributed(args, device, launch=None, backend=None, stop=None):
    """Start torch.distributed for this launch (nothing to start for a world of 1).

    Rank 0 says first what it found (and the network interface it chose for gloo, if it had
    to).  Start-up ends within --timeout (plus a margin) if the ranks have not all joined, and
    at once on SIGTERM/SIGINT when `stop` (the run's StopRequest) is given."""
    launch = launch or detect_launch()
    backend = backend or resolve_backend(args.backend, device)
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
        start_process_group(backend, launch, args.timeout, stop)
    return Comm(launch, backend)


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


def add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl", "mpi"], default="auto",
                   help="torch.distributed backend (auto: nccl on CUDA, else gloo)")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait for the other ranks before failing")
    return g
