"""Run the benchmarks of the HW4 ResNet project; print tables and write them all as JSON.

    python bench/run.py             # everything (about 10 minutes on 2 idle CPU cores)
    python bench/run.py --quick     # fewer steps and worker counts (about 2 minutes idle)
    python bench/run.py --only step,exchange --json out.json

1. step      training step: our loop vs the batch in place vs torchvision's per-sample
             pipeline; the data path alone; fp32 / channels_last / bf16 on CPU
2. exchange  sync SGD gradient exchange: ours (one flat all_reduce after backward) vs a bucketed
             all_reduce overlapped with backward vs DDP vs one blocking all_reduce per
             parameter, 2 and 4 ranks (gloo; nccl with >= 2 GPUs)
3. ps        async SGD parameter server: updates/s and busy fraction, 1..8 workers; a slow
             worker's cost to the run's length
4. gpu       CUDA only: resnet_cifar100.py epoch time, fraction of bf16 peak, options
5. convergence  on the yardstick (data that is hard to learn): test accuracy per epoch of one
             process, sync SGD on 2, 4 and 8 ranks, async SGD with 1, 2, 4 and 8 workers
             (not part of the default run: about 80 minutes on 2 quiet cores; --quick: 25 minutes)

BENCHMARKS.md explains each and holds the results.  Timings are only as good as the machine's
quiet: the load average and how busy the CPUs were before each benchmark are recorded.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def run_step(args):
    import training
    return training.run(args.quick, workers=args.workers)


def run_exchange(args):
    import exchange
    return exchange.run(args.quick)


def run_ps(args):
    import param_server
    return param_server.run(args.quick)


def run_gpu(args):
    import gpu
    return gpu.run(args.quick)


def run_convergence(args):
    import convergence
    return convergence.run(args.quick)


BENCHMARKS = {"step": run_step, "exchange": run_exchange, "ps": run_ps, "gpu": run_gpu,
              "convergence": run_convergence}
DEFAULT = ("step", "exchange", "ps", "gpu")  # convergence takes hours: ask for it by name


if __name__ == "__main__":
    sys.exit(harness.main(BENCHMARKS, default=DEFAULT, doc=__doc__))
