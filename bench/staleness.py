"""Async SGD update rules under exact staleness, simulated in one process on the yardstick.

    python bench/staleness.py --rule plain --workers 1 2 4 8 --epochs 6
    python bench/staleness.py --rule plain lookahead dcasgd --workers 4 --seeds 0 1 2

N workers take turns (round robin), each computing its gradient on the parameters the server
last sent *it*: every gradient is exactly N - 1 updates stale (--shuffle-order: N - 1 on
average), as in the real parameter server with N workers of equal speed, but deterministic and
without N processes on 2 cores.  Each worker keeps its own BatchNorm running statistics and
the server evaluates with the latest worker's (async_sgd_cifar100.py averages the workers'
latest).  The data, model, schedule and evaluation are the scripts' own (common/).  This is
how the async update rule was chosen (BENCHMARKS.md, "Async SGD under staleness");
bench/convergence.py then checks the choice with the real script under mpirun.

Rules (the server's treatment of a gradient computed on parameters `tau` updates old):
  plain       apply it as it comes (SGD + Nesterov momentum, one buffer: the slides' Algorithm 2)
  lookahead   plain, but reply with the parameters extrapolated `tau` updates ahead along the
              momentum (theta - tau * lr * v)
  dana        one momentum buffer per worker, the reply looked ahead along all of them (DANA,
              Hakimi et al. 2019; --spike adds spike compensation, --ahead-gradients a longer
              lookahead)
  nesterov    the rule async_sgd_cifar100.py applies: one buffer per worker, torch's Nesterov
              step theta - lr (g + mu v_i); the reply the parameters as they are (the script's
              --ahead 0), or with --extra-ahead C extrapolated C lr sum_j v_j ahead (C = (N -
              1) / N is the script's default, --ahead N - 1; lr is an update's rate, --lr / N;
              --ahead-per-worker predicts each update in flight from its worker's own buffer)
  dcasgd      delay compensation (Zheng et al. 2017, DC-ASGD-a):
              g + lambda * g * g * (theta_now - theta_sent) / sqrt(mean g^2); danadc: with DANA;
              nesterovdc: with the script's rule (async_sgd_cifar100.py --dc-lambda 2)
  ga          gap-aware (Barkai et al. 2019): g divided by how far each parameter moved since
              it was sent, in typical steps; danaga: with DANA
  stalelr     the learning rate divided by tau (Zhang et al. 2016)
  nomomentum  momentum 0 and the learning rate x 1 / (1 - 0.9), the same step size
  sync        sync SGD over the N workers: a round's gradients averaged, one update
--fresh is a control: every worker reloads the parameters after every update, so nothing is
stale and the rule's other choices are measured alone; --fresh-only PREFIX... does so for the
parameters named so only (a diagnosis: --fresh-only fc. finds the head's staleness behind the
warm-up climb).  --fresh-head is the script's remedy for it: the server recomputes the head's
gradient at its current parameters from the features and labels the worker sends.
--shuffle-order gives the workers their turns in a new random order every round: staleness 0
to 2 (N - 1) around N - 1.  The real runs keep their turns, as the fixed order does (most
gradients exactly N - 1 updates stale, nearly all within one of it: BENCHMARKS.md, "What the
gate leaves to pull").
--global-batch makes --batch-size the global batch: each worker computes on batch / N and
each update uses lr / N (async_sgd_cifar100.py's semantics).
"""
import argparse
import copy
import json
import re
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import util  # noqa: E402  (sets sys.path for the repository)
sys.path.insert(0, util.TESTS_DIR)  # the yardstick lives with the tests

import torch  # noqa: E402

from common import data, loader, training  # noqa: E402
from common.process import Process, default_amp  # noqa: E402
from common.model import build_model  # noqa: E402
from async_sgd_cifar100 import head_gradient  # noqa: E402


class Rule:
    """The server's update rule: how it applies a gradient computed `tau` updates ago, and
    which parameters it replies with.  Three independent choices (see the module docstring):

    momentum   "global": one Nesterov momentum buffer (torch.optim.SGD's update, by hand);
               "dana": one buffer per worker, the reply looking ahead along all of them;
               "nesterov": one buffer per worker, torch's Nesterov step, the reply as is
    correction "none"; "dc": delay compensation; "ga": gap-aware damping
    lr         "fixed"; "stale": divided by tau
    """

    def __init__(self, server, scheduler, n_workers, args, momentum="global", correction="none",
                 lr="fixed"):
        self.params = [p for p in server.parameters()]
        self.scheduler, self.args = scheduler, args
        self.mu, self.tau = args.momentum, n_workers - 1
        self.style, self.correction, self.lr_rule = momentum, correction, lr
        self.decay = [args.weight_decay if p.ndim > 1 else 0.0 for p in self.params]
        zeros = lambda: [torch.zeros_like(p) for p in self.params]  # noqa: E731
        self.per_worker = momentum in ("dana", "nesterov")  # a momentum buffer per worker
        self.v = {w: zeros() for w in range(n_workers)} if self.per_worker else {0: zeros()}
        self.total = zeros()  # dana: the sum of every worker's buffer
        self.sent = {}
        self.smooth = zeros() if args.ahead_smooth else None  # --ahead-smooth
        # --pull P: each update also moves the parameters P / N of the way back to where the
        # worker computed its gradient (not the head's with --fresh-head: its gradient is fresh)
        names = [name for name, _ in server.named_parameters()]
        self.pulled = [not (args.fresh_head and name.startswith("fc.")) for name in names]
        self.n_workers = n_workers
        if correction == "dc":
            self.mean_square = zeros()
        if correction == "ga":
            self.step_size = None  # running mean of |parameter change| per update

    def lr(self):
        return self.scheduler.get_last_lr()[0]

    @torch.no_grad()
    def reply(self, worker):
        """The parameters worker `worker` computes its next gradient on."""
        if self.style == "dana":
            # --ahead-gradients: also the other workers' next gradients, predicted from the
            # momentum ((1 - mu) v is a gradient's running mean)
            ahead = self.mu + ((1 - self.mu) * self.tau / (self.tau + 1)
                               if self.args.ahead_gradients else 0.0)
            out = [p - self.lr() * ahead * t for p, t in zip(self.params, self.total)]
        elif self.style == "lookahead":  # --ahead (default tau) updates ahead at the velocity
            k = self.tau if self.args.ahead is None else self.args.ahead
            out = [p - k * self.lr() * vi for p, vi in zip(self.params, self.v[0])]
        elif self.style == "nesterov" and self.args.extra_ahead:
            # --extra-ahead C: further along every worker's buffer, C * (lr / N) * sum_j v_j
            # (C = (N - 1) / N: the momentum's share of the N - 1 updates in flight)
            lr = self.lr() * self.args.lr_scale * self.args.extra_ahead
            out = [p.detach().clone() for p in self.params]
            if self.args.ahead_smooth:  # along a running mean of the sum (--ahead-smooth)
                for o, u in zip(out, self.smooth):
                    o.sub_(u, alpha=lr)
            elif self.args.ahead_per_worker:
                # --ahead-per-worker: each other worker's next update predicted from its own
                # buffer, mu^2 v_j + (1 - mu^2) mean(v) (its gradient unknown: the mean's)
                mu2 = self.mu ** 2
                step = self.lr() * self.args.lr_scale
                others = mu2 + (1 - mu2) * self.args.extra_ahead  # on every buffer (sum)
                for w_buffers in self.v.values():
                    for o, vi in zip(out, w_buffers):
                        o.sub_(vi, alpha=step * others)
                for o, vi in zip(out, self.v[worker]):  # not its own: it is not in flight
                    o.add_(vi, alpha=step * mu2)
            else:
                for w_buffers in self.v.values():
                    for o, vi in zip(out, w_buffers):
                        o.sub_(vi, alpha=lr)
        else:
            out = [p.detach().clone() for p in self.params]
        self.sent[worker] = out  # what the corrections (and bench/drift.py) measure from
        return out

    @torch.no_grad()
    def apply(self, worker, grads):
        if self.style == "sync":  # sync SGD over the N workers: average a round, then step
            self.pending = grads if worker == 0 else [a + g for a, g in zip(self.pending, grads)]
            if worker < self.tau:
                return
            grads = [g / (self.tau + 1) for g in self.pending]
        lr = self.lr() * self.args.lr_scale
        if self.lr_rule == "stale" and self.tau > 0:
            lr = lr / self.tau
        if self.correction == "dc":
            lam = self.args.dc_lambda
            for g, ms, p, old in zip(grads, self.mean_square, self.params, self.sent[worker]):
                ms.mul_(0.95).addcmul_(g, g, value=0.05)
                g.add_(lam * g * g * (p - old) / (ms.sqrt() + 1e-7))
        if self.correction == "ga" and self.step_size is not None:
            for g, c, p, old in zip(grads, self.step_size, self.params, self.sent[worker]):
                gap = (p - old).abs() / (c + 1e-12)  # in typical steps
                g.div_(gap.add_(1.0) if self.args.ga_form == "plus" else gap.clamp_(min=1.0))
        before = [p.clone() for p in self.params] if self.correction == "ga" else None
        if self.args.pull and self.style != "sync":  # measured before this update moves theta
            pull = self.args.pull / self.n_workers
            gaps = [(p - old) if on else None
                    for p, old, on in zip(self.params, self.sent[worker], self.pulled)]
        v = self.v[worker if self.per_worker else 0]
        for p, g, vi, tot, wd in zip(self.params, grads, v, self.total, self.decay):
            if wd:
                g.add_(p, alpha=wd)
            if self.style == "dana" and self.args.spike and self.tau > 0:
                # spike compensation (delay of one of its own updates): what the late gradient
                # missed is applied now, the rest enters the buffer scaled by mu
                tot.sub_(vi)
                vi.mul_(self.mu).add_(g, alpha=self.mu)
                tot.add_(vi)
                p.sub_(vi, alpha=lr).sub_(g, alpha=lr)
            elif self.style == "dana":
                tot.sub_(vi)
                vi.mul_(self.mu).add_(g)
                tot.add_(vi)
                p.sub_(vi, alpha=lr)
            else:  # torch.optim.SGD(nesterov=True) ("global", "lookahead", "sync"; "nesterov":
                # one buffer per worker, as async_sgd_cifar100.py)
                vi.mul_(self.mu).add_(g)
                p.sub_(g.add(vi, alpha=self.mu), alpha=lr)
        if self.args.pull and self.style != "sync":
            for p, gap in zip(self.params, gaps):
                if gap is not None:
                    p.sub_(gap, alpha=pull)
        if before is not None:
            moved = [(p - b).abs() for p, b in zip(self.params, before)]
            if self.step_size is None:
                self.step_size = moved
            else:
                for c, m in zip(self.step_size, moved):
                    c.mul_(self.args.ga_beta).add_(m, alpha=1 - self.args.ga_beta)
        if self.args.ahead_smooth:  # the running mean of the sum of the buffers
            beta = self.args.ahead_smooth
            for i, u in enumerate(self.smooth):
                u.mul_(beta).add_(sum(self.v[w][i] for w in self.v), alpha=1 - beta)
        self.scheduler.step()


RULES = {  # name: (momentum, correction, lr)
    "sync": ("sync", "none", "fixed"), "lookahead": ("lookahead", "none", "fixed"),
    "plain": ("global", "none", "fixed"), "dana": ("dana", "none", "fixed"),
    "nesterov": ("nesterov", "none", "fixed"), "nesterovdc": ("nesterov", "dc", "fixed"),
    "dcasgd": ("global", "dc", "fixed"), "danadc": ("dana", "dc", "fixed"),
    "ga": ("global", "ga", "fixed"), "danaga": ("dana", "ga", "fixed"),
    "stalelr": ("global", "none", "stale"), "nomomentum": ("global", "none", "fixed"),
}


def trainer_args(args, rule):
    a = argparse.Namespace(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                           epochs=args.epochs, warmup_epochs=args.warmup_epochs)
    if rule == "nomomentum":
        a.lr, a.momentum = args.lr / (1 - args.momentum), 0.0
    return a


def set_up(train, rule, n_workers, seed, args):
    """The simulation's pieces: the server's model, the workers' copies (each loaded with the
    parameters the server first sends it), their shards' loaders, and the server's rule."""
    torch.manual_seed(seed)
    device = torch.device("cpu")
    base = build_model("hw4", len(train.classes), 0.1)
    server = base.to(device)
    workers = [copy.deepcopy(base).to(memory_format=torch.channels_last) if args.amp
               else copy.deepcopy(base) for _ in range(n_workers)]
    mean, std = loader.normalization("cifar100")
    per_worker = args.batch_size // n_workers if args.global_batch else args.batch_size
    loaders = [loader.DeviceLoader(train, per_worker, device, train=True, mean=mean, std=std,
                                 rank=i, world_size=n_workers, seed=seed, channels_last=args.amp)
               for i in range(n_workers)]
    targs = trainer_args(args, rule)
    if args.global_batch and rule != "sync":  # N updates of batch B/N make one of batch B
        targs.lr /= n_workers
    optimizer = torch.optim.SGD(training.param_groups(server, targs.weight_decay), lr=targs.lr,
                                momentum=targs.momentum)  # holds the LR the schedule sets
    steps = len(loaders[0]) * (1 if rule == "sync" else n_workers)
    scheduler = training.warmup_cosine(optimizer, targs, steps)
    momentum, correction, lr_rule = RULES[rule]
    rule_args = argparse.Namespace(**vars(args))
    rule_args.momentum = targs.momentum
    server_rule = Rule(server, scheduler, n_workers, rule_args, momentum, correction, lr_rule)
    for w in range(n_workers):
        load(workers[w], server_rule.reply(w))
    return server, workers, loaders, server_rule


def simulate(train, test, rule, n_workers, seed, args, log=print):
    """Train with `n_workers` round-robin workers under `rule`; test accuracy per epoch."""
    server, workers, loaders, server_rule = set_up(train, rule, n_workers, seed, args)
    device = torch.device("cpu")
    proc = Process("staleness", "", device, args.amp)
    mean, std = loader.normalization("cifar100")
    test_loader = loader.DeviceLoader(test, 500, device, train=False, mean=mean, std=std)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    head_input = {}  # --fresh-head: the features the head of the latest worker saw
    if args.fresh_head:
        for model in workers:
            model.fc.register_forward_pre_hook(
                lambda module, inputs: head_input.update(x=inputs[0]))
    fresh_only = [name.startswith(tuple(args.fresh_only)) for name, _ in server.named_parameters()]
    curve, losses, windows, window = [], [], [], []  # windows: --log-every's mean losses
    shuffler = torch.Generator().manual_seed(seed)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        iters = []
        for shard in loaders:
            shard.set_epoch(epoch)
            iters.append(iter(shard))
        torch.manual_seed(seed * 1000 + epoch)
        loss_sum, seen = 0.0, 0
        for step in range(len(loaders[0])):
            # round robin: staleness n_workers - 1; --shuffle-order: 0 to 2 (n_workers - 1)
            order = torch.randperm(n_workers, generator=shuffler).tolist() \
                if args.shuffle_order and rule != "sync" else range(n_workers)
            for w in order:
                images, labels = next(iters[w])
                model = workers[w]
                model.train()
                with proc.autocast():
                    loss = criterion(model(images), labels)
                model.zero_grad(set_to_none=True)
                loss.backward()
                grads = [p.grad.float().contiguous() for p in model.parameters()]
                if args.fresh_head and rule != "sync":  # the head's gradient, at the server's
                    server_fc = server.fc  # current parameters, from this worker's features
                    grads[-2:] = head_gradient(head_input["x"].float(), labels, server_fc.weight,
                                               server_fc.bias, criterion.label_smoothing)
                server_rule.apply(w, grads)
                if rule != "sync":
                    for v in (range(n_workers) if args.fresh else [w]):
                        load(workers[v], server_rule.reply(v))
                    if args.fresh_only:
                        for v in range(n_workers):
                            load(workers[v], server_rule.reply(v), only=fresh_only)
                loss_sum += loss.item() * len(labels)
                seen += len(labels)
                if args.log_every:
                    window.append(loss.item())
            if rule == "sync":  # every rank continues from the round's one update
                for w in range(n_workers):
                    load(workers[w], server_rule.reply(w))
            if args.log_every and ((step + 1) % args.log_every == 0
                                   or step + 1 == len(loaders[0])):
                windows.append(round(sum(window) / len(window), 4))
                window = []
        # evaluate the server's parameters with the latest worker's BatchNorm statistics
        for b_server, b_worker in zip(server.buffers(), workers[-1].buffers()):
            b_server.copy_(b_worker)
        test_loss, acc = training.evaluate(server, test_loader, Process("", "", device, False))
        curve.append(round(acc, 2))
        losses.append(round(loss_sum / seen, 4))
        log(f"  {rule:10s} N={n_workers} seed {seed} epoch {epoch + 1}: train loss "
            f"{loss_sum / seen:.3f} test acc {acc:.2f}% ({time.perf_counter() - start:.0f} s)")
    result = {"rule": rule, "workers": n_workers, "seed": seed, "test_acc": curve,
              "train_loss": losses}
    if args.log_every:
        result["train_loss_every"] = windows
    return result


@torch.no_grad()
def load(model, tensors, only=None):
    for i, (p, t) in enumerate(zip(model.parameters(), tensors)):
        if only is None or only[i]:
            p.copy_(t)


def yardstick(n_train, n_test, seed):
    """The yardstick (tests/yardstick.py) in memory, as ImageSets."""
    from yardstick import balanced_labels, yardstick_images, NUM_CLASSES
    sets = []
    for n, offset in ((n_train, 0), (n_test, 1)):
        labels = balanced_labels(n, NUM_CLASSES, seed * 2 + offset)
        images = yardstick_images(labels, 32, seed * 2 + offset + 1000)
        sets.append(data.ImageSet(torch.from_numpy(images), torch.from_numpy(labels),
                                  [str(i) for i in range(NUM_CLASSES)]))
    return sets


def make_parser():
    """The simulator's options (bench/drift.py takes its defaults from here too)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rule", nargs="+", default=["plain"], choices=sorted(RULES))
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--ahead", type=float, default=None,
                   help="rule lookahead: the updates to extrapolate the reply over (default: "
                        "workers - 1)")
    p.add_argument("--lr-scale", type=float, default=1.0,
                   help="every update's learning rate times this (a learning-rate sweep)")
    p.add_argument("--dc-lambda", type=float, default=2.0)
    p.add_argument("--spike", action="store_true",
                   help="dana: spike compensation of a gradient one own-update late")
    p.add_argument("--ahead-gradients", action="store_true",
                   help="dana: look ahead over the other workers' expected gradients too")
    p.add_argument("--extra-ahead", type=float, default=0.0, metavar="C",
                   help="nesterov: reply C * (lr / N) * sum of the buffers further ahead")
    p.add_argument("--ahead-per-worker", action="store_true",
                   help="with --extra-ahead: predict each in-flight update from its worker's "
                        "own buffer (mu^2 v_j + (1 - mu^2) mean v) instead of the mean buffer")
    p.add_argument("--ahead-smooth", type=float, default=0.0, metavar="BETA",
                   help="--extra-ahead along a running mean (decay BETA per update) of the sum "
                        "of the buffers instead of the sum itself")
    p.add_argument("--pull", type=float, default=0.0, metavar="P",
                   help="each update also moves the parameters P / N of the way back to the "
                        "ones the worker computed its gradient on (not the head's with "
                        "--fresh-head); 0: off")
    p.add_argument("--ga-form", choices=["max", "plus"], default="max",
                   help="gap-aware divisor: max(1, gap) or 1 + gap (gap in typical steps)")
    p.add_argument("--ga-beta", type=float, default=0.99,
                   help="gap-aware: decay of the running mean step size")
    p.add_argument("--global-batch", action="store_true",
                   help="--batch-size is the global batch: each worker computes on batch / N "
                        "samples and each update's LR is --lr / N (sync: N ranks of batch / N)")
    p.add_argument("--fresh", action="store_true",
                   help="control: every worker reloads after every update (staleness 0, the "
                        "same batches, learning rates and momentum buffers)")
    p.add_argument("--fresh-head", action="store_true",
                   help="the head's (fc's) gradient recomputed at the server's current "
                        "parameters from the worker's features and labels, as "
                        "async_sgd_cifar100.py does by default (--fresh-head); the body's "
                        "gradient stays stale")
    p.add_argument("--fresh-only", nargs="+", default=[], metavar="PREFIX",
                   help="diagnosis: every worker reloads the parameters whose names start "
                        "with one of these (e.g. fc.) after every update; the others stay stale")
    p.add_argument("--shuffle-order", action="store_true",
                   help="the workers take their turns in a new random order every round, so "
                        "staleness varies from 0 to 2 (N - 1) around N - 1 (real runs keep "
                        "their turns, as the default order does)")
    p.add_argument("--log-every", type=int, default=0, metavar="ROUNDS",
                   help="also record the mean training loss of every ROUNDS rounds (N updates "
                        "each; sync: N gradients, one update) as train_loss_every; each epoch's "
                        "last window is shorter where ROUNDS does not divide it")
    p.add_argument("--train", type=int, default=5000)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast + channels_last (default: as the scripts on this CPU, "
                        "on where it has native bf16; emulated bf16 is ~10x slower than fp32)")
    p.add_argument("--json", help="append each result as a JSON line here")
    return p


def parse_args(argv=None):
    args = make_parser().parse_args(argv)
    if args.amp is None:  # the scripts' default precision on this CPU
        args.amp = default_amp(torch.device("cpu"))
    return args


def main(argv=None):
    args = parse_args(argv)
    # The rules step the LR schedule themselves (the optimizer only holds the LR).
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    train, test = yardstick(args.train, args.test, 0)
    for seed in args.seeds:
        for rule in args.rule:
            for n in args.workers:
                res = simulate(train, test, rule, n, seed, args)
                # every option of the run, so a new one is recorded without listing it here
                # ("batch": the name the results so far have it under)
                res.update({k: v for k, v in vars(args).items()
                            if k not in ("rule", "workers", "seeds", "json")},
                           batch=args.batch_size)
                print(json.dumps(res), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
