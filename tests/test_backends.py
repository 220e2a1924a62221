"""Collectives on the device their backend takes.  NCCL takes CUDA tensors only; a gloo group
registered as taking CUDA tensors alone refuses a CPU tensor as NCCL does ("No backend type
associated with device type cpu"), on a machine without a GPU.  Under such a world, what the
ranks share in host memory (the decoded TinyImageNet) must still travel, and a tensor on the
wrong device must stay a bug (a traceback, exit 1), not a lost peer that a launcher retries."""
import subprocess
import sys

from helpers import ROOT, by_hand, child_env

CUDA_ONLY = r"""
import argparse, sys, torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from common import data, distributed
from common.launch import detect_launch
from common.network import free_port
from common.run import Run, execute
dist.Backend.register_backend(
    "cudaonly", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
    devices=["cuda"])
"""

# Every rank of a world whose backend takes CUDA tensors only loads TinyImageNet, sharing the
# decoding, as sync SGD does under NCCL; then says whether it holds the pixels one process gets.
SHARED_DECODING = CUDA_ONLY + r"""
args = argparse.Namespace(dataset="tinyimagenet", data_dir=sys.argv[2], dummy=False,
                          download=False, workers=0, train_limit=None, test_limit=None, seed=0,
                          evaluate=False, backend="cudaonly", timeout=60)

def main():
    launch = detect_launch()
    run = Run("probe", ".", torch.device("cpu"), False, launch.rank, launch.world_size)
    with distributed.process_group(args, run, launch, backend="cudaonly") as comm:
        train, test = data.load_datasets("tinyimagenet", args, comm)
    alone = data.read_tinyimagenet(sys.argv[2], 0)
    same = torch.equal(train.images, alone[0].images) and torch.equal(test.images, alone[1].images)
    print(f"rank {launch.rank}: {'identical' if same else 'different'}", flush=True)

execute(main)
"""

# One process, a world of 1 of that backend, a CPU tensor broadcast over it: a bug in the code.
CPU_TENSOR_TO_A_CUDA_BACKEND = CUDA_ONLY + r"""
def main():
    dist.init_process_group("cudaonly", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    data.read_tinyimagenet(sys.argv[2], 0, plan=(dist.group.WORLD, data.SKIP))

execute(main)
"""


def probe(tmp_path, source):
    path = tmp_path / "probe.py"
    path.write_text(source)
    return [sys.executable, str(path), ROOT]


def test_the_shared_decoding_works_where_the_backend_takes_cuda_tensors_only(tiny_dir, tmp_path):
    """sync SGD on TinyImageNet under NCCL: the decoded shares, in host memory, go over a group
    that takes them (before: the broadcast failed, "lost contact", exit 200 on every rank)."""
    for code, out, err in by_hand(probe(tmp_path, SHARED_DECODING) + [str(tiny_dir)]):
        assert code == 0 and "identical" in out, out + err


def test_a_tensor_on_a_device_the_backend_does_not_take_is_a_bug_not_a_lost_peer(tiny_dir,
                                                                                   tmp_path):
    """Only a peer that died or went silent is the retryable exit 200: any other error of a
    collective keeps its traceback and exit 1, and a launcher does not restart it for ever."""
    proc = subprocess.run(probe(tmp_path, CPU_TENSOR_TO_A_CUDA_BACKEND) + [str(tiny_dir)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "No backend type associated with device type cpu" in proc.stderr, proc.stderr
    assert "lost contact" not in proc.stderr and "Traceback" in proc.stderr, proc.stderr
