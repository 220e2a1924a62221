"""Two hosts: two network namespaces joined by a veth pair, each with its own private address.

As on many Debian hosts and containers, this machine's name resolves to 127.0.0.1 (see
`getent hosts $(hostname)`): gloo left to itself would tell the other host to connect to
127.0.0.1.  Here sync SGD with a PyTorchJob's variables, torchrun on two nodes with c10d
rendezvous, and async SGD run across the two hosts; then the link is cut during an epoch, and
after it returns the same command resumes.  The namespaces (and the veth pair in them) are
created by the test and always deleted afterwards; traffic stays inside them.
"""
import csv
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from helpers import ROOT, child_env, finish

TIMEOUT = 240  # no test may hang
ADDRESSES = ("10.231.0.1", "10.231.0.2")


@dataclass
class Hosts:
    namespaces: tuple
    links: tuple  # the veth end inside each namespace

    def python(self, host, *argv):
        return ["ip", "netns", "exec", self.namespaces[host], sys.executable, *argv]

    def link(self, state):
        """Take the link down (a partition, nothing sent or refused) or bring it up again."""
        for ns, link in zip(self.namespaces, self.links):
            ip("-n", ns, "link", "set", link, state)


def ip(*args):
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2) to create network namespaces")
    tag = f"{os.getpid() % 100000}"  # several test sessions may run at once
    namespaces, links = (f"hw4a{tag}", f"hw4b{tag}"), (f"hw4a{tag}", f"hw4b{tag}")
    try:
        ip("netns", "add", namespaces[0])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here (`ip netns add`: "
                    f"{exc.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    try:
        ip("netns", "add", namespaces[1])
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(namespaces, links, ADDRESSES):
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield Hosts(namespaces, links)
    finally:  # deleting a namespace deletes the veth end in it, and so the pair
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def env(**extra):
    environ = child_env(**extra)
    environ.pop("GLOO_SOCKET_IFNAME", None)  # the scripts must find the interface themselves
    return environ


def start(cmd, **extra):
    return subprocess.Popen(cmd, cwd=ROOT, env=env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def script_args(script, cifar_dir, out, *extra):
    return [script, "--data-dir", str(cifar_dir), "--out", str(out), "--device", "cpu",
            "--train-limit", "64", "--test-limit", "32", "--batch-size", "16", "--epochs", "1",
            "--timeout", "20", *extra]


def epochs(out):
    path = os.path.join(out, "metrics.csv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


def sha1(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


def pytorchjob(hosts, args, port, placement=(0, 1)):
    """One process per rank, rank r on host placement[r], with a PyTorchJob's variables."""
    contract = dict(MASTER_ADDR=ADDRESSES[0], MASTER_PORT=str(port),
                    WORLD_SIZE=str(len(placement)))
    return [start(hosts.python(host, *args), RANK=str(rank), **contract)
            for rank, host in enumerate(placement)]


PROBE = """
from common.network import choose_gloo_interface, reachable_address
from common.run import UserError
print(reachable_address(), choose_gloo_interface("{peer}"), choose_gloo_interface("127.0.0.1"))
try:
    choose_gloo_interface("10.232.0.1")  # no route to it from this namespace
except UserError as exc:
    print(exc)
"""


def test_each_host_finds_its_address_and_interface(hosts):
    """What rank 0 advertises under mpirun across hosts, and the interface gloo is given: this
    host's name resolves to 127.0.0.1, so neither may come from it."""
    for host, peer in ((0, 1), (1, 0)):
        result = subprocess.run(hosts.python(host, "-c", PROBE.format(peer=ADDRESSES[peer])),
                                cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        found, unreachable = result.stdout.splitlines()
        assert found.split() == [ADDRESSES[host], hosts.links[host], "None"]
        assert "no route" in unreachable and "set GLOO_SOCKET_IFNAME" in unreachable


def test_sync_sgd_with_pytorchjob_variables_on_two_hosts(hosts, cifar_dir, tmp_path):
    out = tmp_path / "sync"
    results = finish(pytorchjob(hosts, script_args("sync_sgd_cifar100.py", cifar_dir, out), 29510))
    for code, stdout, stderr in results:
        assert code == 0, stdout + stderr
    log = results[0][1]
    assert f"rank 0 of world 2 | local rank 0 | master {ADDRESSES[0]}:29510" in log
    assert f"gloo interface {hosts.links[0]}" in log  # chosen, and said
    assert epochs(out) == [1]


def test_torchrun_on_two_nodes_with_c10d_rendezvous(hosts, cifar_dir, tmp_path):
    out = tmp_path / "torchrun"
    rendezvous = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES[0]}:29520",
                  "--rdzv-id", "hw4"]
    script = script_args("sync_sgd_cifar100.py", cifar_dir, out)
    # This host's name resolves to loopback: torchrun needs each node's address (--local-addr),
    # and is told which node serves the rendezvous (it cannot tell from the name).
    procs = [start(hosts.python(0, *rendezvous, "--local-addr", ADDRESSES[0],
                                "--rdzv-conf", "is_host=1", *script)),
             start(hosts.python(1, *rendezvous, "--local-addr", ADDRESSES[1], *script))]
    results = finish(procs)
    for code, stdout, stderr in results:
        assert code == 0, stdout + stderr
    assert "launcher torchrun | rank 0 of world 2" in results[0][1]
    assert f"gloo interface {hosts.links[0]}" in results[0][1]
    assert epochs(out) == [1]


def test_async_sgd_server_on_one_host_workers_on_both(hosts, cifar_dir, tmp_path):
    out = tmp_path / "async"
    args = script_args("async_sgd_cifar100.py", cifar_dir, out)
    results = finish(pytorchjob(hosts, args, 29530, placement=(0, 0, 1)))
    for code, stdout, stderr in results:
        assert code == 0, stdout + stderr
    log = results[0][1]
    # 64 samples over 2 workers, global batch 16 (8 per worker): 4 gradients each, all applied
    assert "worker 1: 4 gradients sent, 4 applied" in log
    assert "worker 2: 4 gradients sent, 4 applied" in log
    assert epochs(out) == [1]


def wait_for_epoch_1(procs, out):
    deadline = time.time() + TIMEOUT
    while not epochs(out) and all(p.poll() is None for p in procs):
        assert time.time() < deadline, "epoch 1 never ended"
        time.sleep(0.05)


def test_a_cut_link_ends_every_rank_in_time_and_the_same_command_resumes(hosts, cifar_dir,
                                                                         tmp_path):
    out = tmp_path / "partition"
    args = script_args("sync_sgd_cifar100.py", cifar_dir, out, "--train-limit", "200",
                       "--epochs", "2", "--timeout", "10")
    procs = pytorchjob(hosts, args, 29540)
    try:
        wait_for_epoch_1(procs, out)
        after_epoch_1 = sha1(out / "checkpoint.pt")  # written before metrics.csv
        hosts.link("down")
        cut = time.time()
        results = finish(procs)
        assert time.time() - cut < 10 + 20  # --timeout, and a margin
    finally:
        hosts.link("up")
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 200, stdout + stderr  # retryable
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: rank {rank} lost contact"), stderr
    assert epochs(out) == [1], "the cut must land in epoch 2"
    assert sha1(out / "checkpoint.pt") == after_epoch_1

    results = finish(pytorchjob(hosts, args, 29540))  # the link is back: the same command
    for code, stdout, stderr in results:
        assert code == 0, stdout + stderr
    assert f"resumed from {out / 'checkpoint.pt'} after epoch 1" in results[0][1]
    assert epochs(out) == [1, 2]


def test_async_sgd_a_cut_off_worker_stops_the_run_in_time_and_the_same_command_resumes(
        hosts, cifar_dir, tmp_path):
    """The server and worker 1 on one host, worker 2 on the other; the link is cut during an
    epoch.  The server names worker 2 after --timeout of its silence and tells worker 1 to
    stop then: before, it served worker 1 alone to the end of its epochs, wrote their rows
    from half the data, and released it as if the run were done.  Worker 2, cut off, stops
    after its own --timeout.  Once the link is back the same command finishes the run, each
    epoch once and every update made."""
    out = tmp_path / "async"
    # 2 workers x 96 samples in batches of 4: 24 batches each, 48 updates an epoch.  --timeout
    # 10: a worker's gradient that lands during the server's epoch end (evaluation, checkpoint,
    # curve) waits for it, a few seconds on a loaded 2-core machine
    args = script_args("async_sgd_cifar100.py", cifar_dir, out, "--train-limit", "192",
                       "--batch-size", "8", "--epochs", "12", "--timeout", "10")
    procs = pytorchjob(hosts, args, 29550, placement=(0, 0, 1))
    try:
        wait_for_epoch_1(procs, out)
        hosts.link("down")
        cut = time.time()
        results = finish(procs)
        assert time.time() - cut < 10 + 20  # --timeout, and a margin
    finally:
        hosts.link("up")
    for code, stdout, stderr in results:
        assert code == 200, stdout + stderr  # retryable
    (_, _, server), (_, _, survivor), (_, _, cut_off) = results
    assert "the parameter server lost worker 2: it sent nothing for --timeout 10 s" in server
    assert "worker 1: the parameter server lost another worker and stopped" in survivor
    assert "worker 2 lost the parameter server" in cut_off, cut_off
    assert len(epochs(out)) < 12, "the cut must land before the run's end"

    results = finish(pytorchjob(hosts, args, 29550, placement=(0, 0, 1)))  # the same command
    for code, stdout, stderr in results:
        assert code == 0, stdout + stderr
    assert epochs(out) == list(range(1, 13))
    with open(out / "metrics.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["updates"]) == 12 * 48
