"""Sync SGD and async_sgd_cifar100.py's update rule on the yardstick, many seeds at once.

    python bench/batched.py --workers 4 --seeds 0-39 --variants sync default "--pull 0.4" \
        --device cuda --json F

What it is for: screening variants of the async rule over enough seeds to tell them apart.
Single runs move by 2-3 points with their seed (BENCHMARKS.md), so telling two rules 1 point
apart takes some 25 seeds each; the real scripts (bench/convergence.py) take 8 minutes of an
H200 for 21 pairs, and 12 hours of 2 CPU cores.  Here every run of a variant -- S seeds x N
workers model copies -- trains as one batched model (torch.func.vmap over stacked
parameters), so a GPU computes all S x N mini-batches of a round in one pass.  On 2 CPU cores
it is no faster than the real scripts: it is meant for a GPU.  A choice it makes is then
checked with the real scripts (bench/convergence.py), which remain the benchmark.

A round: every worker copy computes its gradient on the parameters it was last sent, on its
own mini-batch (the real scripts' batches: the same shards, order, crops and flips for a
seed); then, for all seeds at once, the server applies the round's N gradients one at a time
and replies to each worker, by the script's rule (`Server.apply` and `Server.reply`: a
Nesterov buffer per worker, the reply extrapolated --ahead updates, the fresh head, the pull).
The workers take their turns in the same order every round, so every gradient is exactly
N - 1 updates stale, as most are in the real scripts: there the workers keep their turns (4
workers on 2 CPU cores: 87% of the gradients exactly 3 updates stale, nearly all the rest 2
or 4; on an H200 staleness 3.00 on average per epoch, max 3-5; BENCHMARKS.md, "What the gate
leaves to pull").  --order shuffle draws a new order every round instead (staleness 0 to
2 (N - 1), mean N - 1), a regime the real runs do not show.  Sync: the round's N gradients
averaged, one torch Nesterov step.  Evaluation: the server's parameters with the workers'
BatchNorm statistics averaged, every epoch, as the scripts do.  Precision: fp32 (TF32
convolutions on a GPU); the scripts' bf16 autocast does not batch BatchNorm under vmap.

A variant is "sync", "default" (the script's defaults), or the script's rule flags in one
string: "--pull 0.4", "--pull-from 0", "--ahead 0", "--no-fresh-head", "--momentum 0.8".

It reports each variant's gaps to sync in final test accuracy and in final training loss,
paired by seed.  The training loss's gap is the steadier (BENCHMARKS.md, "Many seeds at
once"): it opens in epoch 2, the first at the peak rate, so --stop-after 3 (the first 3
epochs of the same schedule) screens in half the time.
"""
import argparse
import copy
import itertools
import json
import math
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import util  # noqa: E402  (sets sys.path for the repository)
from util import log, out_of_time, set_budget, table  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad_and_value, vmap  # noqa: E402

import async_sgd_cifar100 as script  # noqa: E402
from common import loader, training  # noqa: E402
from common.model import build_model  # noqa: E402
from staleness import yardstick  # noqa: E402


class VariantParser(argparse.ArgumentParser):
    def error(self, message):  # one error line, the main parser's
        raise ValueError(message)


def rule_parser():
    """The async rule's flags, with the script's defaults."""
    p = VariantParser(prog="variant", add_help=False)
    p.add_argument("--pull", type=float, default=script.PULL)
    p.add_argument("--pull-from", type=int, default=script.PULL_FROM)
    p.add_argument("--ahead", type=float, default=None)  # None: N - 1
    p.add_argument("--pull-centered", action="store_true")
    p.add_argument("--fresh-head", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--momentum", type=float, default=None)  # None: the recipe's
    return p


def parse_variant(text):
    """("sync", None) or (text, the rule's options)."""
    if text == "sync":
        return text, None
    return text, rule_parser().parse_args([] if text == "default" else shlex.split(text))


class Copies:
    """S seeds x N workers copies of the HW4 ResNet as stacked tensors.

    `sent` [S * N, P] holds the parameters each copy computes on (copy c = seed c // N, worker
    c % N), `theta` [S, P] each seed's server parameters; `buffers` the copies' own BatchNorm
    statistics.  `gradients()` runs one round's forward and backward of every copy at once."""

    def __init__(self, seeds, n_workers, num_classes, device, label_smoothing):
        models = []
        for seed in seeds:  # each seed's initial weights, as the scripts draw them
            torch.manual_seed(seed)
            models.append(build_model("hw4", num_classes, 0.1))
        self.S, self.N = len(seeds), n_workers
        body = copy.deepcopy(models[0])
        body.fc = torch.nn.Identity()  # the body returns the features the head sees
        self.body = body.to("meta")
        self.names = [name for name, _ in models[0].named_parameters()]
        self.shapes = [p.shape for p in models[0].parameters()]
        self.sizes = [p.numel() for p in models[0].parameters()]
        self.P = sum(self.sizes)
        head = self.names.index("fc.weight")
        self.head = slice(sum(self.sizes[:head]), self.P)  # fc.weight then fc.bias, at the end
        assert self.names[head:] == ["fc.weight", "fc.bias"]
        self.theta = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                                  for m in models]).to(device)
        self.sent = self.theta.repeat_interleave(n_workers, 0)  # every worker starts at theta
        self.buffers = {name: torch.stack([b for m in models for b in [dict(
            m.named_buffers())[name]] * n_workers]).to(device)
            for name, _ in models[0].named_buffers()}
        self.decay = torch.cat([torch.full((n,), float(len(s) > 1)) for n, s in
                                zip(self.sizes, self.shapes)]).to(device)
        self.grads = torch.empty_like(self.sent)
        self.num_classes, self.smoothing = num_classes, label_smoothing

        def loss(params, weight, bias, buffers, x, y):
            features = functional_call(self.body, {**params, **buffers}, (x,))
            logits = F.linear(features, weight, bias)
            return F.cross_entropy(logits, y, label_smoothing=label_smoothing), features
        self.step = vmap(grad_and_value(loss, argnums=(0, 1, 2), has_aux=True),
                         randomness="different")

    def views(self, flat):
        """Parameter name -> [rows, *shape] views into a flat [rows, P] tensor."""
        rows = flat.shape[0]
        return {name: chunk.view(rows, *shape) for name, chunk, shape in
                zip(self.names, flat.split(self.sizes, 1), self.shapes)}

    def gradients(self, x, y):
        """Every copy's gradient at its `sent` parameters on its batch (into `grads`, flat),
        its BatchNorm statistics updated; returns (features [S, N, b, F], losses [S * N])."""
        params = self.views(self.sent)
        body = {k: v for k, v in params.items() if not k.startswith("fc.")}
        (g_body, g_weight, g_bias), (losses, features) = self.step(
            body, params["fc.weight"], params["fc.bias"], self.buffers, x, y)
        g = {**g_body, "fc.weight": g_weight, "fc.bias": g_bias}
        torch.cat([g[name].reshape(len(self.grads), -1) for name in self.names], 1,
                  out=self.grads)
        return features.view(self.S, self.N, *features.shape[1:]), losses

    @torch.no_grad()
    def evaluate(self, images, labels, chunk=500):
        """Each seed's server parameters, with its workers' BatchNorm statistics averaged:
        (test loss [S], test accuracy % [S])."""
        params = self.views(self.theta)
        stats = {name: (b.view(self.S, self.N, *b.shape[1:]).float().mean(1).to(b.dtype)
                        if b.is_floating_point() else b[::self.N])
                 for name, b in self.buffers.items()}
        body = {k: v for k, v in params.items() if not k.startswith("fc.")}
        self.body.eval()

        def logits(p, w, b, s, x):
            return F.linear(functional_call(self.body, {**p, **s}, (x,)), w, b)
        forward = vmap(logits, in_dims=(0, 0, 0, 0, None))
        loss = torch.zeros(self.S, device=images.device, dtype=torch.float64)
        correct = torch.zeros_like(loss)
        for start in range(0, len(labels), chunk):
            x, y = images[start:start + chunk], labels[start:start + chunk]
            out = forward(body, params["fc.weight"], params["fc.bias"], stats, x)
            loss += F.cross_entropy(out.flatten(0, 1), y.repeat(self.S),
                                    reduction="none").view(self.S, -1).sum(1)
            correct += (out.argmax(2) == y).sum(1)
        self.body.train()
        return (loss / len(labels)).tolist(), (100.0 * correct / len(labels)).tolist()


def head_gradients(features, labels, weight, bias, smoothing):
    """The head's gradient for every seed at once, at the given head parameters:
    features [S, b, F], labels [S, b], weight [S, K, F], bias [S, K] -> flat [S, K * F + K]
    (async_sgd_cifar100.head_gradient, batched)."""
    logits = torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))
    k = logits.shape[-1]
    target = F.one_hot(labels, k).to(logits.dtype) * (1 - smoothing) + smoothing / k
    delta = (logits.softmax(-1) - target) / labels.shape[1]  # d mean loss / d logits
    return torch.cat([torch.bmm(delta.transpose(1, 2), features).flatten(1), delta.sum(1)], 1)


class AsyncServer:
    """async_sgd_cifar100.Server's apply and reply, for S seeds at once (one worker's turn)."""

    def __init__(self, copies, rule, args, updates_per_epoch):
        self.c, self.args, self.updates_per_epoch = copies, args, updates_per_epoch
        S, N, P = copies.S, copies.N, copies.P
        self.mu = args.momentum if rule.momentum is None else rule.momentum
        self.ahead = N - 1 if rule.ahead is None else rule.ahead
        self.pull = rule.pull / N if N > 1 else 0.0
        self.pull_from, self.fresh_head = rule.pull_from, rule.fresh_head
        self.pull_centered = rule.pull_centered
        self.v = torch.zeros(S, N, P, device=copies.theta.device)
        self.v_total = torch.zeros(S, P, device=copies.theta.device)
        self.gap = torch.empty(S, P, device=copies.theta.device)
        self.version, self.sent_version = 0, [0] * N

    def lr(self):
        return self.args.lr / self.c.N * training.lr_factor(self.version, self.args,
                                                            self.updates_per_epoch)

    @torch.no_grad()
    def turn(self, w, features, labels):
        """Worker w's gradient, for every seed: apply it, then reply to worker w."""
        c, theta = self.c, self.c.theta
        g = c.grads.view(c.S, c.N, c.P)[:, w]
        sent = c.sent.view(c.S, c.N, c.P)[:, w]
        if self.fresh_head:  # the head's gradient at the current parameters
            weight = theta[:, c.head][:, :-c.num_classes].view(c.S, c.num_classes, -1)
            g[:, c.head] = head_gradients(features[:, w].float(), labels[:, w], weight,
                                          theta[:, c.P - c.num_classes:], c.smoothing)
        staleness = self.version - self.sent_version[w]
        pull = self.pull if staleness >= self.pull_from else 0.0
        if pull:
            torch.sub(theta, sent, out=self.gap)
            if self.pull_centered:
                self.gap.sub_(self.v_total, alpha=(self.ahead - staleness) * self.lr() / c.N)
            if self.fresh_head:
                self.gap[:, c.head] = 0.0
        g.addcmul_(c.decay, theta, value=self.args.weight_decay)
        v = self.v[:, w]
        self.v_total.sub_(v)
        v.mul_(self.mu).add_(g)
        self.v_total.add_(v)
        theta.sub_(g.add_(v, alpha=self.mu), alpha=self.lr())
        if pull:
            theta.sub_(self.gap, alpha=pull)
        self.version += 1
        sent.copy_(theta).add_(self.v_total, alpha=-self.ahead * self.lr() / c.N)
        self.sent_version[w] = self.version
        return staleness


class SyncServer:
    """sync_sgd_cifar100.py's step for S seeds at once: the N gradients averaged, weight decay,
    torch's Nesterov step; every rank continues from the one new theta."""

    def __init__(self, copies, args, updates_per_epoch):
        self.c, self.args, self.updates_per_epoch = copies, args, updates_per_epoch
        self.v = torch.zeros_like(copies.theta)
        self.version = 0

    @torch.no_grad()
    def round(self):
        c, theta = self.c, self.c.theta
        g = c.grads.view(c.S, c.N, c.P).mean(1)
        g.addcmul_(c.decay, theta, value=self.args.weight_decay)
        self.v.mul_(self.args.momentum).add_(g)
        lr = self.args.lr * training.lr_factor(self.version, self.args, self.updates_per_epoch)
        theta.sub_(g.add_(self.v, alpha=self.args.momentum), alpha=lr)
        c.sent.view(c.S, c.N, c.P).copy_(theta.unsqueeze(1))
        self.version += 1


def train(variant, rule, seeds, args, train_set, test_set, device):
    """One variant over `seeds`: test accuracy per epoch and seed, and the staleness seen."""
    N, b = args.workers, args.batch_size // args.workers
    copies = Copies(seeds, N, len(train_set.classes), device, args.label_smoothing)
    mean, std = loader.normalization("cifar100")
    loaders = [loader.DeviceLoader(train_set, b, device, train=True, mean=mean, std=std,
                                   rank=w, world_size=N, seed=seed)
               for seed in seeds for w in range(N)]
    rounds = len(loaders[0])
    server = (SyncServer(copies, args, rounds) if rule is None
              else AsyncServer(copies, rule, args, rounds * N))
    test_x = loader.DeviceLoader(test_set, len(test_set), device, train=False, mean=mean,
                                 std=std)
    test_images, test_labels = next(iter(test_x))
    order_gen = torch.Generator().manual_seed(args.order_seed)
    result = {"variant": variant, "seeds": list(seeds), "test_acc": [], "test_loss": [],
              "train_loss": [], "staleness": []}
    torch.manual_seed(args.order_seed)  # dropout masks
    for epoch in range(args.stop_after or args.epochs):
        start = time.perf_counter()
        for shard in loaders:
            shard.set_epoch(epoch)
        batches = [iter(shard) for shard in loaders]
        loss_sum, stale = torch.zeros(len(seeds), device=device), []
        for _ in range(rounds):
            xs, ys = zip(*(next(it) for it in batches))
            x, y = torch.stack(xs), torch.stack(ys)
            features, losses = copies.gradients(x, y)
            loss_sum += losses.detach().view(len(seeds), N).sum(1)
            if rule is None:
                server.round()
                continue
            order = (torch.randperm(N, generator=order_gen).tolist() if args.order == "shuffle"
                     else range(N))
            labels = y.view(len(seeds), N, -1)
            for w in order:
                stale.append(server.turn(w, features, labels))
        test_loss, test_acc = copies.evaluate(test_images, test_labels)
        result["test_acc"].append([round(a, 2) for a in test_acc])
        result["test_loss"].append([round(v, 4) for v in test_loss])
        result["train_loss"].append([round(v, 4) for v in (loss_sum / (rounds * N)).tolist()])
        if stale:
            result["staleness"].append([round(sum(stale) / len(stale), 2), max(stale)])
        log(f"  {variant:16s} epoch {epoch + 1}: test acc {statistics.mean(test_acc):.2f} "
            f"(mean of {len(seeds)} seeds), train loss "
            f"{statistics.mean(result['train_loss'][-1]):.3f} "
            f"({time.perf_counter() - start:.0f} s)")
    return result


def seed_range(text):
    """'3' -> [3]; '100-139' -> [100, ..., 139] (--seeds takes several of either)."""
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def mean_and_error(values, digits):
    """'mean', '± standard error' of a list (no error for one value)."""
    error = (f"{statistics.stdev(values) / math.sqrt(len(values)):.{digits}f}"
             if len(values) > 1 else "-")
    return f"{statistics.mean(values):.{digits}f}", error


def report(results):
    """Each variant's final test accuracy and training loss (mean ± s.e. over seeds), and
    their gaps to sync paired by seed.  The training loss is the steadier of the two: over
    the H200's 21 pairs its gap to sync had 1.4 standard deviations per mean, the test
    accuracy's 2.4 (BENCHMARKS.md, "Many seeds at once")."""
    sync = next((r for r in results if r["variant"] == "sync"), None)
    rows = []
    for r in results:
        row = [r["variant"], len(r["seeds"])]
        paired = sync is not None and r is not sync and sync["seeds"] == r["seeds"]
        for key, digits in (("test_acc", 2), ("train_loss", 3)):
            final = r[key][-1]
            row += mean_and_error(final, digits)
            row += (mean_and_error([a - b for a, b in zip(final, sync[key][-1])], digits)
                    if paired else ["", ""])
        rows.append(row)
    return table("Final test accuracy (%) and training loss, mean over seeds; the gaps to sync "
                 "paired by seed",
                 ["variant", "seeds", "test acc", "± s.e.", "gap to sync", "± s.e.",
                  "train loss", "± s.e.", "gap to sync", "± s.e."], rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--variants", nargs="+", default=["sync", "default"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seeds", nargs="+", type=seed_range, default=[[0, 1, 2, 3]],
                   help="seeds and ranges of seeds, e.g. 0 1 5 or 100-139")
    p.add_argument("--epochs", type=int, default=6, help="the schedule's length")
    p.add_argument("--stop-after", type=int, default=0, metavar="E",
                   help="train only the schedule's first E epochs (a quicker screen on the "
                        "training loss, which has the gap from epoch 2 on: BENCHMARKS.md)")
    p.add_argument("--batch-size", type=int, default=64, help="the global batch")
    p.add_argument("--lr", type=float, default=0.15)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--train", type=int, default=6400)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--order", choices=["fixed", "shuffle"], default="fixed",
                   help="the workers' turns: the same every round, as in the real runs "
                        "(default), or a new random order every round")
    p.add_argument("--order-seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="append each variant's result as a JSON line here")
    p.add_argument("--budget", type=float, default=0, metavar="SECONDS",
                   help="start no variant that the last one's time says would end after this "
                        "many seconds (a device call's limit)")
    args = p.parse_args(argv)
    args.seeds = list(itertools.chain.from_iterable(args.seeds))
    variants = []
    for text in args.variants:
        try:
            variants.append(parse_variant(text))
        except ValueError as exc:
            p.error(f"--variants {text!r}: {exc}; a variant is 'sync', 'default' or the "
                    "script's rule flags in one string, e.g. '--pull 0.4'")
    args.variants = variants
    if args.batch_size % args.workers:
        p.error(f"--batch-size {args.batch_size} is not a multiple of --workers {args.workers}")
    if not 0 <= args.stop_after <= args.epochs:
        p.error(f"--stop-after {args.stop_after}: choose 1 to --epochs {args.epochs} (0: all)")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    train_set, test_set = yardstick(args.train, args.test, 0)
    for s in (train_set, test_set):
        s.images, s.labels = s.images.to(device), s.labels.to(device)  # shared by every copy
    trained = f" (the first {args.stop_after} trained)" if args.stop_after else ""
    log(f"{len(args.seeds)} seeds x {args.workers} workers, {args.epochs} epochs{trained}, "
        f"{args.train} / {args.test} yardstick images, global batch {args.batch_size}, lr "
        f"{args.lr}, {device}")
    set_budget(args.budget)
    results, last = [], 0.0
    for text, rule in args.variants:
        if out_of_time(last):  # the last variant's time: about this one's
            log(f"skipped {text!r}: it would end after the {args.budget:g} s budget")
            continue
        start = time.perf_counter()
        result = train(text, rule, args.seeds, args, train_set, test_set, device)
        result.update(seconds=round(time.perf_counter() - start, 1), workers=args.workers,
                      order=args.order, recipe=dict(epochs=args.epochs,
                                                    stop_after=args.stop_after,
                                                    batch=args.batch_size, lr=args.lr,
                                                    train=args.train, test=args.test),
                      device=torch.cuda.get_device_name(device) if device.type == "cuda"
                      else "cpu")
        results.append(result)
        last = result["seconds"]
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    log(report(results))


if __name__ == "__main__":
    main()
