"""The async update rules that were compared, as options of async_sgd_cifar100.py's server.

    mpirun -np 5 python bench/async_rules.py --pull 0.4 --data-dir ./data --epochs 6

Every flag but those below is async_sgd_cifar100.py's (python async_sgd_cifar100.py --help);
the run is that script's, its server's rule (`Server.update`) with these options.  Without
any of them the rule is the script's own, reply for reply (tests/test_bench.py checks it).
bench/convergence.py --async-flags "..." runs the async runs through here when they hold one.
"""
import argparse
import math
import os
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import async_sgd_cifar100  # noqa: E402
from common import flags  # noqa: E402
from common.inbox import Heartbeat, Inbox  # noqa: E402
from common.messages import CONTINUE, DONE, GRADIENT  # noqa: E402
from common.run import UserError, execute  # noqa: E402

OPTIONS = ("--ahead", "--pull", "--pull-from", "--pull-centered", "--dc-lambda", "--in-turn",
           "--fresh-head", "--no-fresh-head")


def uses_options(argv):
    """Does this command line hold one of the rule's options (which the main refuses)?"""
    return any(arg.split("=", 1)[0] in OPTIONS for arg in argv)


def option_parser():
    p = flags.Parser(description=__doc__, formatter_class=flags.HelpFormatter,
                     allow_abbrev=False)  # an abbreviation may be the main's flag
    g = p.add_argument_group("the rule's options (each a step of Server.update)")
    g.add_argument("--ahead", type=float, default=None, metavar="K",
                   help="reply with the parameters extrapolated K updates ahead along the "
                        "workers' momentum, theta - K lr mean(v_j) (default: workers - 1, the "
                        "expected staleness; 0: theta as it is)")
    g.add_argument("--pull", type=float, default=async_sgd_cifar100.PULL, metavar="P",
                   help="each update also moves the parameters P / N of the way back to the "
                        "ones its worker computed the gradient on (the head excepted while it "
                        "is fresh); 0: off")
    g.add_argument("--pull-from", type=int, default=async_sgd_cifar100.PULL_FROM, metavar="S",
                   help="pull only the gradients at least S updates stale")
    g.add_argument("--pull-centered", action="store_true",
                   help="measure the pull's gap from where the parameters were expected to be, "
                        "the reply plus K - s updates along the mean buffer for a gradient s "
                        "updates stale (default: from the reply itself)")
    g.add_argument("--dc-lambda", type=float, default=0.0, metavar="LAMBDA",
                   help="delay compensation (DC-ASGD): g + LAMBDA g*g*(theta - theta_sent) / "
                        "sqrt(mean g^2); 0: off")
    g.add_argument("--in-turn", action="store_true",
                   help="a control with nothing stale: the server replies to one worker at a "
                        "time, once no other computes, so every gradient after the first round "
                        "is computed on the current parameters (use with --ahead 0)")
    g.add_argument("--fresh-head", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute the head's (fc) gradient at the server's parameters from "
                        "the features and labels each worker sends (--no-fresh-head: apply it "
                        "as it came, stale)")
    return p


def parse_args(argv=None):
    """The main's flags and the rule's options, in one namespace (so that config.json and the
    checkpoint record them, and a resume with other options is refused)."""
    options, rest = option_parser().parse_known_args(argv)
    for flag, value in (("--dc-lambda", options.dc_lambda), ("--ahead", options.ahead),
                        ("--pull", options.pull), ("--pull-from", options.pull_from)):
        if value is not None and value < 0:
            raise UserError(f"{flag} {value:g} is negative; use 0 (off) or more")
        if value is not None and not math.isfinite(value):
            raise UserError(f"{flag} {value:g} is not a number; use 0 (off) or more")
    if options.pull > 1:  # over a round of N updates the pull would overshoot the gap
        raise UserError(f"--pull {options.pull:g} is more than 1; use a fraction from 0 (off) "
                        "to 1")
    return argparse.Namespace(**vars(async_sgd_cifar100.parse_args(rest)), **vars(options))


class VariantServer(async_sgd_cifar100.Server):
    """The main's server, its rule with the options in `args` (from `parse_args`)."""

    def __init__(self, model, n_workers, args, *rest):
        super().__init__(model, n_workers, args, *rest)
        self.ahead = n_workers - 1 if args.ahead is None else args.ahead
        if args.dc_lambda:  # its curvature estimate, the running mean of g * g (resumed)
            saved = self.state.extra.get("mean_square")
            self.mean_square = torch.zeros_like(self.theta) if saved is None \
                else saved.to(self.theta.device)
            self.scratch = torch.empty_like(self.theta), torch.empty_like(self.theta)

    @torch.no_grad()
    def update(self, worker, gradient, features, labels):
        """async_sgd_cifar100.Server.update, step for step, each step with its option."""
        a, theta, v, lr, n = self.args, self.theta, self.momentum[worker], \
            self.lr(self.version), self.n
        stale = self.version - self.sent_version[worker]
        # 1. The head's gradient at the current parameters (--no-fresh-head: as it came).
        if a.fresh_head:
            with torch.enable_grad():
                weight, bias = (p.detach().requires_grad_() for p in self.messages.head_parameters)
                loss = F.cross_entropy(F.linear(features, weight, bias), labels,
                                       label_smoothing=a.label_smoothing)
                for part, fresh in zip(self.messages.head,
                                       torch.autograd.grad(loss, (weight, bias))):
                    gradient[part].copy_(fresh.reshape(-1))
        # --dc-lambda: the gradient moved to the current parameters along a diagonal curvature
        if a.dc_lambda:
            self.mean_square.mul_(0.95).addcmul_(gradient, gradient, value=0.05)
            moved, root = self.scratch
            torch.sub(theta, self.sent[worker], out=moved)  # since its worker's reply
            torch.sqrt(self.mean_square, out=root).add_(1e-7)
            gradient.addcdiv_(moved.mul_(gradient).mul_(gradient), root, value=a.dc_lambda)
        # 2. The pull's gap (--pull P, --pull-from S); --pull-centered: beyond the forecast,
        #    which led theta by K updates along the mean buffer, of which `stale` have come.
        pull = a.pull / n if n > 1 and stale >= a.pull_from else 0
        if pull:
            torch.sub(theta, self.sent[worker], out=self.gap)
            if a.pull_centered:
                self.gap.sub_(self.momentum_sum, alpha=(self.ahead - stale) * lr / n)
            for part in self.messages.head if a.fresh_head else ():
                self.gap[part] = 0.0
        # 3.-6. Weight decay, the worker's own buffer, the Nesterov step, the pull.
        gradient.addcmul_(self.decay, theta)
        self.momentum_sum.sub_(v)
        v.mul_(a.momentum).add_(gradient)
        self.momentum_sum.add_(v)
        theta.sub_(gradient.add_(v, alpha=a.momentum), alpha=lr)
        if pull:
            theta.sub_(self.gap, alpha=pull)
        # 7. The reply, --ahead K updates ahead (--in-turn forecasts it again as it is sent).
        self.forecast(worker, self.version + 1)
        return bool(pull)

    def forecast(self, worker, version):
        """The parameters to send `worker`, into `sent[worker]`: theta - K lr mean_j(v_j), at
        the learning rate of update `version`, the next."""
        torch.add(self.theta, self.momentum_sum, alpha=-self.ahead * self.lr(version) / self.n,
                  out=self.sent[worker])

    def keep_in_checkpoint(self):
        super().keep_in_checkpoint()
        if self.args.dc_lambda:
            self.state.extra["mean_square"] = self.mean_square.cpu()

    def serve(self):
        """--in-turn: the main's loop, but each reply is held until no worker computes; then
        the first in line is sent theta as it is then.  Without it: the main's loop."""
        if not self.args.in_turn:
            return super().serve()
        self.heartbeat = Heartbeat(self.args.timeout)
        inbox = Inbox(self.workers, self.messages.size, self.args.timeout, self.heartbeat)
        active, finished, failure, waiting = set(self.workers), {}, None, []
        while active:
            if waiting and len(waiting) == len(active):  # no worker computes: the next in turn
                worker = waiting.pop(0)
                if failure is not None:  # stopping: told so (if gone, the first reason stands)
                    active.discard(worker)
                    self.reply(worker, failure.exit_code, active)
                    continue
                self.forecast(worker, self.version)
                failure = self.reply(worker, CONTINUE, active)
                if failure is None:
                    inbox.expect(worker)
                continue
            worker, message, error = inbox.next()
            if error is not None:
                failure = failure or self.worker_lost(worker, error, active)
                continue
            kind = message[0].item()
            if kind == DONE:
                finished[worker] = int(message[1].item())
                active.discard(worker)
                continue
            failure = failure or self.reason_to_stop(kind, message)
            if failure is not None:
                active.discard(worker)
                if kind == GRADIENT:
                    self.reply(worker, failure.exit_code, active)
                continue
            begin = time.perf_counter()
            self.apply(worker, message)
            waiting.append(worker)  # its reply waits its turn
            self.last_update = time.perf_counter()
            self.epoch.busy += self.last_update - begin
            if self.version % self.per_epoch == 0:
                self.end_epoch()
        self.finish(finished, failure)


def main(argv=None):
    args = parse_args(argv)
    with mock.patch.object(async_sgd_cifar100, "parse_args", lambda argv=None: args), \
            mock.patch.object(async_sgd_cifar100, "Server", VariantServer):
        return async_sgd_cifar100.main()


if __name__ == "__main__":
    execute(main)
