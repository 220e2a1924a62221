"""This host on the network: the address other hosts reach it by, the interface gloo must use
where its name resolves to loopback (Debian's /etc/hosts, many containers), a free port."""
import fcntl
import ipaddress
import os
import random
import socket
import struct
from contextlib import suppress

from .run import UserError


def reachable_address():
    """This host's address as other hosts see it: its fully qualified name's IP, unless that is
    a loopback address (Debian's /etc/hosts, containers); then the address of the interface of
    the default route, else of the first interface that is not loopback."""
    interfaces = interface_addresses()
    route = default_route_interface()
    names = ([route] if route in interfaces else []) + sorted(interfaces)
    for addr in addresses_of(socket.getfqdn()) + [interfaces[name] for name in names]:
        if not is_loopback(addr):
            return addr
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
    with suppress(OSError), open("/proc/net/route") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if len(fields) > 1 and fields[1] == "00000000":
                return fields[0]
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
    """A free TCP port for a rendezvous a moment later: below the kernel's ephemeral range,
    where any connect or bind to port 0 (gloo makes many) may take it first (EADDRINUSE); drawn
    from the system's randomness, as the scripts seed `random` alike in every job."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    draw = random.SystemRandom()
    below = [draw.randrange(20000, low) for _ in range(64)] if low > 21000 else []
    for port in below + [0]:  # 0: the kernel's choice, where none below the range is free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
                return s.getsockname()[1]
            except OSError:
                if not port:
                    raise
