"""How much a stale gradient differs from a fresh one, and how much of the difference delay
compensation's diagonal curvature estimates predict (a probe behind BENCHMARKS.md, "Async SGD
under staleness").

    python bench/drift.py --workers 2 --epochs 2

Runs the simulator's `nesterov` rule with the reply not extrapolated (bench/staleness.py:
round-robin workers, each gradient N - 1 updates stale; the script's --ahead 0, the rule the
quoted figures were taken with) on the yardstick and, every --every updates after the first
epoch, takes the batch a worker is about to send and computes its gradient twice in fp32: at
the parameters the worker was sent (theta_sent, what it sends) and at the server's current
ones (theta, what it should send), with the same dropout masks as the worker's own step.  It prints
the size of the difference d against the gradient, and for each estimate e of d -- DC-ASGD's
g * g * delta and g * g * delta / sqrt(mean g^2), and the Fisher diagonal mean(g^2) * delta,
with delta = theta - theta_sent -- the best scale lambda = <d, e> / <e, e> and the share of
d's squared norm that lambda * e explains.  The fourth estimate is the change over the same
updates of the gradients of --others other batches (the latest ones the workers trained on),
summed (lambda absorbs their count): the curvature of the loss in expectation, across
parameters, applied to delta (what a server holding data of its own could compute), without
this batch's own; and the
empirical Fisher of the --fisher latest gradients the server applied, sum_k g_k (g_k . delta),
about zero and about their mean (a cheap, low-rank stand-in for that curvature: the server
holds those gradients already).
--extra-ahead C and --fresh-head probe today's rule (C = (N - 1) / N: the script's --ahead
N - 1); with --fresh-head the head's parameters are left out of every vector, as the server
recomputes their gradient at theta.
"""
import argparse
import copy
import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import staleness  # noqa: E402  (sets sys.path for the repository)

import torch  # noqa: E402

from common.process import Process  # noqa: E402


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def fp32_gradient(probe, model, params, images, labels, criterion):
    """The gradient of this batch's loss at `params`, in fp32, with `model`'s BatchNorm state."""
    probe.load_state_dict(model.state_dict())
    staleness.load(probe, params)
    probe.train()
    probe.zero_grad()
    criterion(probe(images.float().contiguous()), labels).backward()
    return flat(p.grad for p in probe.parameters())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=25, help="probe every this many updates")
    p.add_argument("--lr", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=6400, help="yardstick training images")
    p.add_argument("--extra-ahead", type=float, default=0.0, metavar="C",
                   help="the reply extrapolated C lr sum_j v_j (the simulator's flag)")
    p.add_argument("--fresh-head", action="store_true",
                   help="the head's gradient recomputed at theta (the simulator's flag)")
    p.add_argument("--others", type=int, default=4,
                   help="other batches whose gradients' change estimates the expected curvature")
    p.add_argument("--fisher", type=int, default=16,
                   help="the latest gradients the server received, whose outer products "
                        "(the empirical Fisher, low-rank) estimate the curvature cheaply")
    a = p.parse_args(argv)
    if a.others < 1 or a.fisher < 1:  # (a slice [-0:] would keep every batch and gradient)
        p.error("--others and --fisher count batches and gradients: use 1 or more")
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    n = a.workers
    # the simulator's defaults: 6 epochs of global batch 64, the reply as it was unless
    # --extra-ahead (the rule the figures first quoted were taken with)
    args = staleness.parse_args(["--lr", str(a.lr), "--epochs", "6", "--batch-size", "64",
                                 "--global-batch", "--extra-ahead", str(a.extra_ahead)]
                                + ["--fresh-head"] * a.fresh_head)
    train, _ = staleness.yardstick(a.train, 2000, 0)
    server, workers, loaders, rule = staleness.set_up(train, "nesterov", n, a.seed, args)
    probe = copy.deepcopy(server)  # the fp32 model both gradients are taken on
    proc = Process("drift", "", torch.device("cpu"), args.amp)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    mean_square = torch.zeros(sum(q.numel() for q in rule.params))
    # with --fresh-head the head's entries are left out (its gradient is taken at theta)
    keep = torch.cat([torch.full((q.numel(),), not (a.fresh_head and name.startswith("fc.")))
                      for name, q in server.named_parameters()])
    recent = []  # the latest batches trained on, for the expected-curvature estimate
    received = []  # the latest gradients applied, for the empirical Fisher
    head_input = {}  # --fresh-head: the features the head of the latest worker saw
    if a.fresh_head:
        for model in workers:
            model.fc.register_forward_pre_hook(
                lambda module, inputs: head_input.update(x=inputs[0]))
    print("update  epoch  lr/N     |d|/|g|   lambda, share explained:  g^2 delta  "
          f"g^2 delta/rms  mean(g^2) delta  {a.others} other batches' change  "
          f"Fisher of {a.fisher}: uncentred, centred")
    update = 0
    for epoch in range(a.epochs):
        iters = []
        for shard in loaders:
            shard.set_epoch(epoch)
            iters.append(iter(shard))
        for _ in range(len(loaders[0])):
            for w in range(n):
                images, labels = next(iters[w])
                model = workers[w]
                model.train()
                if epoch > 0 and update % a.every == 0:
                    rng = torch.get_rng_state()  # both probes and the step: the same dropout
                    sent = rule.sent[w]
                    stale = fp32_gradient(probe, model, sent, images, labels, criterion)
                    torch.set_rng_state(rng)
                    fresh = fp32_gradient(probe, model, rule.params, images, labels, criterion)
                    torch.set_rng_state(rng)
                    others = torch.zeros_like(fresh)
                    for o_images, o_labels in recent:
                        others += fp32_gradient(probe, model, rule.params, o_images, o_labels,
                                                criterion)
                        torch.set_rng_state(rng)
                        others -= fp32_gradient(probe, model, sent, o_images, o_labels,
                                                criterion)
                        torch.set_rng_state(rng)
                    d = (fresh - stale)[keep]
                    delta = (flat(rule.params) - flat(sent))[keep]
                    g2, ms = (stale * stale)[keep], mean_square[keep]
                    past = torch.stack(received)  # K x P: the latest gradients applied
                    fisher = past.T @ (past @ delta)  # sum_k g_k (g_k . delta)
                    past -= past.mean(0)  # the same about their mean
                    centred = past.T @ (past @ delta)
                    cells = []
                    for e in (g2 * delta, g2 * delta / (ms.sqrt() + 1e-7), ms * delta,
                              others[keep], fisher, centred):
                        lam = (d @ e) / (e @ e).clamp_min(1e-30)
                        share = 1 - (d - lam * e).norm() ** 2 / d.norm() ** 2
                        cells.append(f"{lam.item():9.3g} {100 * share.item():5.1f}%")
                    ratio = (d.norm() / stale[keep].norm()).item()
                    print(f"{update:6d}  {epoch + 1:5d}  {rule.lr():.4f}  {ratio:7.2f}   "
                          f"{'   '.join(cells)}", flush=True)
                recent = (recent + [(images, labels)])[-a.others:]
                with proc.autocast():
                    loss = criterion(model(images), labels)
                model.zero_grad(set_to_none=True)
                loss.backward()
                grads = [q.grad.float().contiguous() for q in model.parameters()]
                g = flat(grads)
                received = (received + [g[keep]])[-a.fisher:]  # (a masked copy)
                mean_square.mul_(0.95).addcmul_(g, g, value=0.05)
                if a.fresh_head:  # the head's gradient at the server's parameters
                    grads[-2:] = staleness.head_gradient(
                        head_input["x"].float(), labels, server.fc.weight, server.fc.bias,
                        criterion.label_smoothing)
                rule.apply(w, grads)
                staleness.load(model, rule.reply(w))
                update += 1


if __name__ == "__main__":
    main()
