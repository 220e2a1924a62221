"""Asynchronous SGD with a parameter server (the slides' Algorithm 2), on CIFAR-100 by default.

    mpirun -np 3 python async_sgd_cifar100.py      # 1 server + 2 workers (any launcher works;
                                                   # Open MPI on < 3 cores: --oversubscribe)

Rank 0 is the parameter server; every other rank is a worker training on its own shard:

    worker:  compute a gradient on a mini-batch, at the parameters it holds
             isend it to the server; irecv the server's parameters; continue from them
    server:  receive a gradient from whichever worker sends first (not a fixed 1..N order)
             apply it at once (the update rule, `Server.apply`); isend that worker parameters

--batch-size is the global batch, as in sync SGD: each of N workers computes on batch / N
samples, and N updates, each with the learning rate / N, add up to one step of sync SGD.
A gradient is *stale* by the number of updates the server applied between sending that worker
its parameters and receiving the gradient computed from them: about N - 1, one sync step.

The slides' rule (one momentum buffer, each gradient applied as it comes) diverges on this
network with gradients one update stale. The server's rule, `Server.apply` and `Server.reply`
(the README's "Async SGD" says why each step is there and what it gained):

1. One Nesterov momentum buffer per worker (DANA, Hakimi et al. 2019): worker i's gradient g
   moves its own buffer, v_i <- mu v_i + g, and the parameters by torch's Nesterov step,
   theta <- theta - lr (g + mu v_i), lr being --lr / N on the schedule. With one worker this
   is torch.optim.SGD(nesterov=True), step for step (tests/test_learning.py).
2. The reply looks ahead over the updates in flight (--ahead K, N - 1 by default): while a
   worker computes, the other workers' updates move theta on, mostly along their momentum, so
   the server replies theta - K lr mean_j(v_j), and each gradient is computed about where it
   will be applied.
3. The head (fc) is never stale (--fresh-head; stale head steps made the training loss climb
   above ln(100) in the warm-up): each worker sends the features its head saw and their
   labels with the gradient, and the server recomputes the head's gradient at its current
   parameters (one small layer's passes).
4. A gradient two or more updates stale (--pull-from 2) is pulled back: after its step, the
   parameters move P / N of the way back to the reply its worker computed on (--pull P, 0.2).
5. The model is evaluated and saved once per epoch-equivalent of updates (training samples /
   (global batch / N), one pass over the data), with the BatchNorm statistics averaged over
   the workers' latest.

Each worker announces when its epochs are done; when all have, the server writes its outputs
and releases them. So a worker that stays slower sets the run's length, as in sync SGD.
--share-work ends the run after its epochs' worth of updates instead, whichever workers made
them: a faster worker makes more of them. --dc-lambda (delay compensation, DC-ASGD),
--pull-centered and --in-turn (a control with nothing stale) serve the benchmarks
(BENCHMARKS.md, "Async SGD under staleness").
"""
import argparse
import itertools
import math
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import data, distributed, flags, loader, outputs, process, training
from common.checkpoint import Checkpoint
from common.launch import detect_launch
from common.model import build_model
from common.process import Interrupted, NonFiniteLoss, PeerLost, UserError

SCRIPT = "async_sgd_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)

# The recipe: sync SGD's, with --batch-size the global batch (each of N workers computes on
# batch / N samples, each update uses --lr / N): 40 epochs; momentum 0.9 (per worker, above),
# weight decay 5e-4 on conv and linear weights; the learning rate warms up linearly to 0.1
# over the first epoch, then follows a cosine to 0, per update; random crop and flip; label
# smoothing 0.1 on the training loss only.
RECIPE = dict(epochs=40, batch_size=128, lr=0.1, momentum=0.9, weight_decay=5e-4,
              warmup_epochs=1.0, label_smoothing=0.1)

# The messages, one flat float32 tensor each (one isend / irecv moves each):
#   worker -> server  [kind, samples, correct, loss sum | gradient | BatchNorm buffers
#                      | the head's input features and labels (--fresh-head)]
#   server -> worker  [status | parameters]     status: CONTINUE; FINISHED (--share-work: the
#                                               run's updates are made); or an exit status
#   and at the end, server -> worker [status]   releases a worker that has sent DONE
GRADIENT, DONE, STOPPING = 0.0, 1.0, 2.0
HEADER = 4
CONTINUE, FINISHED = 0.0, -1.0
DC_LAMBDA = 0.0  # delay compensation: off (BENCHMARKS.md, "Async SGD under staleness")
PULL = 0.2  # --pull: BENCHMARKS.md, "Only the gradients two or more updates stale pulled"
PULL_FROM = 2  # --pull-from: only gradients 2 or more updates stale are pulled


class Layout:
    """Where each parameter, BatchNorm buffer and head input sits in the flat messages."""

    def __init__(self, model, head_batch=0):
        self.params = list(model.parameters())
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.sizes = [p.numel() for p in self.params]
        self.n_params = sum(self.sizes)
        self.n_buffers = sum(b.numel() for b in self.buffers)
        # --fresh-head: where the head's (fc's) weight and bias sit in the gradient, and room
        # for its inputs, a batch of up to head_batch features and their labels
        self.batch, self.n_head = head_batch, 0
        if head_batch:
            starts = dict(zip(map(id, self.params), [0, *torch.tensor(self.sizes).cumsum(0)]))
            self.head_weight = int(starts[id(model.fc.weight)])
            self.head_bias = int(starts[id(model.fc.bias)])
            self.n_features = model.fc.in_features
            self.n_head = head_batch * (self.n_features + 1)
        self.message_size = HEADER + self.n_params + self.n_buffers + self.n_head
        self.reply_size = 1 + self.n_params

    def pack_gradient(self, message, features=None, labels=None):
        """This model's gradient and BatchNorm statistics into a message (in one pass), and
        with --fresh-head the head's input features and their labels."""
        tensors = [p.grad.reshape(-1) for p in self.params] + [b.reshape(-1) for b in self.buffers]
        _cat_into(tensors, message[HEADER:HEADER + self.n_params + self.n_buffers])
        if self.n_head:
            n = labels.numel()
            head = message[HEADER + self.n_params + self.n_buffers:]
            head[:n * self.n_features].copy_(features.detach().reshape(-1))
            head[self.batch * self.n_features:][:n].copy_(labels)

    def unpack(self, message, samples):
        """A message's gradient and BatchNorm statistics, and with --fresh-head its first
        `samples` head features and labels (views into the message where they can be)."""
        gradient, buffers, head = message[HEADER:].split(
            [self.n_params, self.n_buffers, self.n_head])
        if not self.n_head:
            return gradient, buffers, None, None
        features = head[:samples * self.n_features].view(samples, self.n_features)
        labels = head[self.batch * self.n_features:][:samples].long()
        return gradient, buffers, features, labels

    def load_parameters(self, flat):
        for p, chunk in zip(self.params, flat.to(self.params[0].device).split(self.sizes)):
            p.data.copy_(chunk.view_as(p))


def _cat_into(tensors, out):
    """Concatenate straight into `out` (a CPU message) when the tensors are on the CPU too."""
    if tensors[0].device == out.device:
        torch.cat(tensors, out=out)
    else:
        out.copy_(torch.cat(tensors))


# ----------------------------------------------------------------------------------- worker

def work(model, train_loader, args, proc, position, computes=True):
    """Compute gradients on this worker's shard; exchange each with the server.  `position`:
    how many of this worker's batches the server had applied, over all epochs, when a resumed
    run's checkpoint was written (0 for a new run): it starts after them.  `computes`: False
    for a worker with no update left to make (a --share-work run resumed near its end)."""
    layout = Layout(model, train_loader.batch_size if args.fresh_head else 0)
    message, reply = torch.zeros(layout.message_size), torch.zeros(layout.reply_size)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    head_input = {}  # --fresh-head: the features the head (fc) sees, sent with the gradient
    if args.fresh_head:
        model.fc.register_forward_pre_hook(lambda module, inputs: head_input.update(x=inputs[0]))
    sent = 0
    model.train()
    for images, labels in shard_batches(train_loader, args, proc, position, computes):
        with proc.autocast():
            output = model(images)
            loss = criterion(output, labels)
        model.zero_grad(set_to_none=True)
        loss.backward()
        message[:HEADER] = torch.tensor([GRADIENT, labels.numel(),
                                         (output.argmax(1) == labels).sum().item(),
                                         loss.item() * labels.numel()])
        layout.pack_gradient(message, head_input.get("x"), labels)
        answer = dist.irecv(reply, src=0)  # the server's reply ...
        dist.isend(message, dst=0).wait()  # ... to this gradient
        answer.wait()
        sent += 1
        if reply[0].item() == FINISHED:  # --share-work: the run's updates are all made
            break
        if reply[0].item() != CONTINUE:  # the server says stop, with this exit status
            raise stop_error(int(reply[0].item()), proc.rank, args)
        layout.load_parameters(reply[1:])  # continue from the server's parameters
        if proc.stop.signum:  # this worker was asked to stop: tell the server
            message[0] = STOPPING
            dist.isend(message, dst=0).wait()
            raise Interrupted(f"worker {proc.rank}: stopped by {proc.stop.name}; the "
                              "server writes the checkpoint", proc.stop.signum)
        if args.straggler_delay and proc.rank == 1:
            time.sleep(args.straggler_delay)
    message[:HEADER] = torch.tensor([DONE, sent, 0, 0])
    dist.isend(message, dst=0).wait()


def shard_batches(train_loader, args, proc, position, computes=True):
    """This worker's batches after the first `position`: its shard, in a new order every epoch,
    for --epochs epochs; with --share-work on past them, for as long as the server wants
    gradients (a faster worker makes more of the run's updates).  Nothing if not `computes`."""
    if not computes:
        return
    first_epoch, first_step = divmod(position, len(train_loader))
    epochs = itertools.count(first_epoch) if args.share_work else range(first_epoch, args.epochs)
    for epoch in epochs:
        start = first_step if epoch == first_epoch else 0
        train_loader.set_epoch(epoch)  # a new shuffle (and crops and flips) every epoch
        # dropout masks (seeded as sync SGD's resumed epoch seeds them)
        torch.manual_seed(training.epoch_seed(args.seed, epoch, proc.rank) + start)
        yield from train_loader.batches(start)


def first_round(positions, total):
    """With --share-work, the workers that compute a gradient as the run (re)starts, from
    their `positions`: workers 1, 2, ... as many as the run has updates left of its `total`
    (all of them unless a resumed run is near its end), so that it makes no more."""
    left = total - sum(positions)
    return {w for w in range(1, len(positions) + 1) if w - 1 < left}


def head_gradient(features, labels, weight, bias, label_smoothing):
    """The gradient of the training loss with respect to the head's weight and bias alone,
    at these values of them: the head's forward pass (logits = features weight^T + bias, the
    label-smoothed cross-entropy averaged over the batch) again, and autograd."""
    weight, bias = weight.detach().requires_grad_(), bias.detach().requires_grad_()
    with torch.enable_grad():
        loss = F.cross_entropy(F.linear(features, weight, bias), labels,
                               label_smoothing=label_smoothing)
        return torch.autograd.grad(loss, (weight, bias))


def resume_positions(state, n_workers, updates_per_epoch, args):
    """Where each worker resumes in its stream of batches (epochs x batches per worker +
    step): after the batches whose gradients the server had applied when it wrote the
    checkpoint, so that a run stopped inside an epoch trains each batch of it once.  A
    checkpoint without them (or from a run with another number of workers or batches, or from
    a --share-work run whose fast worker went past the --epochs of its shard that a run without
    it stops at) resumes at the start of the interrupted epoch, the updates made inside it kept
    in the parameters."""
    batches = updates_per_epoch // n_workers
    saved = state.extra.get("positions")
    if (saved is not None and len(saved) == n_workers
            and state.extra.get("batches_per_worker") == batches
            and sum(saved) == state.extra.get("updates")
            and (args.share_work or max(saved) <= args.epochs * batches)):
        return [int(p) for p in saved]
    return [state.epoch * batches] * n_workers


def stop_error(status, rank, args):
    """The exception a worker stops with when the server's reply says stop."""
    if status == PeerLost.exit_code:
        return PeerLost(f"worker {rank}: the parameter server lost another worker and stopped; "
                        f"{training.to_resume(args)}")
    if status >= 128:
        return Interrupted(f"worker {rank}: stopped by the parameter server (signal); its "
                           f"checkpoint is written; {training.to_resume(args)}", status - 128)
    return NonFiniteLoss(f"worker {rank}: stopped by the parameter server (non-finite loss)")


def released(proc, args):
    """After DONE, wait for the server's word that the outputs are written, for as long as the
    other workers train (the server's heartbeat says it lives meanwhile); a stop if it says the
    run stopped (a worker lost, a signal), or dies or goes silent for --timeout before it says:
    the run is not complete, and a launcher that restarts failed ranks must restart this one
    too, for the group to meet again."""
    status = torch.zeros(1)
    try:
        dist.recv(status, src=0)  # within --timeout: the heartbeat comes every quarter of it
        while status.item() == distributed.Heartbeat.ALIVE:
            dist.recv(status, src=0)
    except RuntimeError as exc:
        if not distributed.is_peer_failure(exc):
            raise
        raise PeerLost(f"worker {proc.rank}: done, but the parameter server died or went silent "
                       f"before it said the run was complete ({distributed.failure_line(exc, 100)}"
                       f"); {training.to_resume(args)}") from None
    if status.item() != 0:
        raise stop_error(int(status.item()), proc.rank, args)


# ----------------------------------------------------------------------------------- server

class Server:
    """Holds the parameters, applies each gradient as it arrives, evaluates every epoch."""

    def __init__(self, model, n_workers, args, proc, test_loader, state, updates_per_epoch,
                 checkpoint, folder):
        self.model, self.args, self.proc, self.test_loader = model, args, proc, test_loader
        self.state, self.checkpoint, self.folder = state, checkpoint, folder
        self.n_workers, self.updates_per_epoch = n_workers, updates_per_epoch
        self.layout = Layout(model, args.batch_size // n_workers if args.fresh_head else 0)
        # The parameters as one flat tensor, the model's parameters views into it: each
        # update is a few passes over one vector.
        self.theta = torch.cat([p.detach().reshape(-1) for p in self.layout.params])
        for p, view in zip(self.layout.params, self.theta.split(self.layout.sizes)):
            p.data = view.view_as(p)
        self.decay = torch.cat([torch.full((p.numel(),), args.weight_decay if p.ndim > 1 else 0.0,
                                           device=self.theta.device) for p in self.layout.params])
        self.mu = args.momentum
        momentum = state.extra.get("momentum") or []  # one buffer per worker, resumed if it fits
        if len(momentum) != n_workers:
            momentum = [torch.zeros_like(self.theta) for _ in range(n_workers)]
        self.v = {w + 1: m.to(self.theta.device) for w, m in enumerate(momentum)}
        # The reply's extrapolation (--ahead K): the sum of the buffers, kept as they change
        self.ahead = n_workers - 1 if args.ahead is None else args.ahead
        self.v_total = (torch.stack(list(self.v.values())).sum(0)
                        if self.ahead or args.pull_centered else None)
        # each worker's place in its stream of batches; the updates done are their sum
        self.position = dict(zip(self.v, resume_positions(state, n_workers, updates_per_epoch,
                                                           args)))
        self.version = sum(self.position.values())
        self.workers = list(self.v)
        self.batches = updates_per_epoch // n_workers  # each worker's per epoch
        # --share-work: the run makes its --epochs x updates_per_epoch updates, whichever
        # workers make them; `computing`: the workers computing a gradient it will apply
        self.total = args.epochs * updates_per_epoch
        self.computing = first_round(list(self.position.values()), self.total)
        done = self.version % updates_per_epoch  # inside the epoch a stopped run resumes
        if done:
            proc.log(f"epoch {self.version // updates_per_epoch + 1} resumes after {done} of its "
                     f"{updates_per_epoch} updates: the workers after batches "
                     + ", ".join(str(p % self.batches) for p in self.position.values())
                     + f" of their {self.batches}")
        self.replies = {w: torch.zeros(self.layout.reply_size) for w in self.workers}
        # on a GPU the extrapolated reply is computed there: `out=` takes no other device's tensor
        self.reply_scratch = (torch.empty_like(self.theta)
                              if self.ahead and self.theta.device.type != "cpu" else None)
        # --pull P: each update also moves the parameters P / N of the way back to where its
        # gradient was computed (with one worker they are the same: nothing to pull)
        self.pull = args.pull / n_workers if n_workers > 1 else 0.0
        if self.pull:
            self.gap = torch.empty_like(self.theta)  # preallocated, as delay compensation's
            # not the head with --fresh-head: its gradient is computed at the current parameters
            self.unpulled = [slice(start, start + tensor.numel()) for start, tensor in
                             ((self.layout.head_weight, model.fc.weight),
                              (self.layout.head_bias, model.fc.bias))] if args.fresh_head else []
        self.sent = {}  # --pull, --dc-lambda: the parameters each worker computes on
        if args.dc_lambda or self.pull:
            for w in self.workers:  # every worker starts from theta
                self.replies[w][1:].copy_(self.theta)
                # its reply buffer is that copy; on a GPU, keep one on the device
                self.sent[w] = self.replies[w][1:] if self.theta.device.type == "cpu" \
                    else self.theta.clone()
        if args.dc_lambda:
            # its curvature estimate: the running mean of g * g (resumed if saved)
            mean_square = state.extra.get("mean_square")
            self.mean_square = (mean_square.to(self.theta.device) if mean_square is not None
                                else torch.zeros_like(self.theta))
            self.scratch = (torch.empty_like(self.theta), torch.empty_like(self.theta))
        self.pending, self.sent_version = {}, {w: self.version for w in self.workers}
        self.gone = set()  # the workers lost: a reply to one may never complete
        self.broken = False  # no worker can be told anything more
        self.applied = {w: 0 for w in self.workers}
        self.statistics = {}  # each worker's latest BatchNorm running statistics
        # a run stopped inside an epoch goes on with that epoch's bookkeeping
        self.new_epoch(state.extra.get("epoch_so_far") if done else None)

    def lr(self):
        """This update's learning rate: the schedule's, divided among the N updates that make
        up one global batch."""
        return self.args.lr / self.n_workers * training.lr_factor(self.version, self.args,
                                                                  self.updates_per_epoch)

    def apply(self, worker, message):
        """The update rule: worker i's gradient (its head part recomputed at the current
        parameters; with --dc-lambda, compensated for the updates since its worker was sent
        parameters) moves its own momentum buffer, and the parameters by torch's Nesterov step
        (weight decay on conv and linear weights is part of the gradient); then --pull moves
        the parameters P / N of the way back to where the gradient was computed."""
        samples, correct, loss_sum = message[1:HEADER].tolist()
        gradient, buffers, features, labels = self.layout.unpack(
            message.to(self.theta.device), int(samples))
        if self.args.fresh_head:  # the head's gradient at the current parameters
            self.fresh_head_gradient(gradient, features, labels)
        if self.args.dc_lambda:  # delay compensation, --dc-lambda (its --help)
            self.mean_square.mul_(0.95).addcmul_(gradient, gradient, value=0.05)
            moved, root = self.scratch  # preallocated: no 14 MB allocations per update
            torch.sub(self.theta, self.sent[worker], out=moved)  # since it was sent
            torch.sqrt(self.mean_square, out=root).add_(1e-7)
            gradient.addcdiv_(moved.mul_(gradient).mul_(gradient), root,
                              value=self.args.dc_lambda)
        staleness = self.version - self.sent_version[worker]
        pull = self.pull if staleness >= self.args.pull_from else 0.0  # --pull-from S
        if pull:  # how far the parameters moved since this worker's were sent
            self.pulled += 1
            torch.sub(self.theta, self.sent[worker], out=self.gap)
            if self.args.pull_centered:  # beyond where the reply's forecast put them by now:
                # the reply led theta by K updates along the mean buffer, s have come since
                self.gap.sub_(self.v_total,
                              alpha=(self.ahead - staleness) * self.lr() / self.n_workers)
            for head in self.unpulled:
                self.gap[head] = 0.0
        gradient.addcmul_(self.decay, self.theta)  # g + weight decay * theta
        v = self.v[worker]
        if self.ahead:
            self.v_total.sub_(v)
        v.mul_(self.mu).add_(gradient)  # v_i <- mu v_i + g
        if self.ahead:
            self.v_total.add_(v)
        self.theta.sub_(gradient.add_(v, alpha=self.mu), alpha=self.lr())  # - lr (g + mu v_i)
        if pull:  # back towards where the gradient was computed, P / N of the way
            self.theta.sub_(self.gap, alpha=pull)
        self.statistics[worker] = buffers.clone()  # its latest BatchNorm statistics
        self.staleness.append(staleness)
        self.version += 1
        self.applied[worker] += 1
        self.position[worker] += 1
        self.totals = [self.totals[0] + loss_sum, self.totals[1] + correct,
                       self.totals[2] + samples]

    @torch.no_grad()
    def fresh_head_gradient(self, gradient, features, labels):
        """Replace the head's stale gradient by its gradient at the current parameters, from
        the features and labels the worker sent (--fresh-head)."""
        fc, layout = self.model.fc, self.layout
        weight, bias = head_gradient(features, labels, fc.weight, fc.bias,
                                     self.args.label_smoothing)
        gradient[layout.head_weight:layout.head_weight + weight.numel()].copy_(weight.reshape(-1))
        gradient[layout.head_bias:layout.head_bias + bias.numel()].copy_(bias)

    def go_on(self, worker):
        """The status to reply to `worker` with after its gradient: CONTINUE; with --share-work,
        FINISHED once the updates applied and those being computed make the run's total, so
        that every gradient computed is applied and the run makes exactly its updates."""
        if self.args.share_work:
            if self.version + len(self.computing) >= self.total:
                return FINISHED
            self.computing.add(worker)
        return CONTINUE

    def reply(self, worker, status):
        """Send `worker` the parameters to compute its next gradient on: theta, extrapolated
        over the --ahead updates expected before its gradient comes back."""
        if worker in self.pending:
            self.pending[worker].wait()  # the previous reply to it has left the buffer
        out = self.replies[worker]
        out[0] = status
        body = out[1:]
        if self.ahead:  # where the next K updates are expected to take the parameters
            target = body if self.reply_scratch is None else self.reply_scratch
            torch.add(self.theta, self.v_total, alpha=-self.ahead * self.lr() / self.n_workers,
                      out=target)
        else:
            target = self.theta
        if target.data_ptr() != body.data_ptr():
            body.copy_(target)
        sent = self.sent.get(worker)
        if sent is not None and sent.data_ptr() != body.data_ptr():  # on a GPU
            sent.copy_(target)
        self.pending[worker] = dist.isend(out, dst=worker)
        self.sent_version[worker] = self.version

    def serve(self):
        """Serve until every worker is done or stopped, or one is lost."""
        self.heartbeat = distributed.Heartbeat(self.args.timeout)  # to the workers done
        # a receive open from each worker (a thread each): which one is lost shows at once
        inbox = distributed.Inbox(self.workers, self.layout.message_size, self.args.timeout,
                                  on_arrival=self.heard)
        active, finished, failure = set(self.workers), {}, None
        waiting = []  # --in-turn: the workers whose replies are held, in the order they came
        while active:
            if waiting and len(waiting) == len(active):  # --in-turn: nobody is computing
                worker = waiting.pop(0)  # the next in turn: on from today's theta, or stop
                if failure is not None:  # stopping: if it is gone too, the first reason stands
                    active.discard(worker)
                    self.send(worker, failure.exit_code)
                else:
                    failure = self.answer(worker, inbox, active)
                continue
            worker, message, error = inbox.next()  # from whichever worker sends first
            if error is not None:  # that worker died, or sent nothing for --timeout
                if not (isinstance(error, TimeoutError) or distributed.is_peer_failure(error)):
                    raise error
                if worker is None:  # a receive from any source (mpi): no one to name or tell
                    failure, self.broken = failure or self.lost(sorted(active), error), True
                    break
                failure = failure or self.lost([worker], error)
                active.discard(worker)  # the others are told at their next gradient
                self.gone.add(worker)
                continue
            begin = time.perf_counter()
            kind = message[0].item()
            self.computing.discard(worker)  # its gradient is here (or it is done)
            if kind == DONE:
                finished[worker] = int(message[1].item())
                active.discard(worker)  # (heard() has it hear the heartbeat meanwhile)
                continue
            failure = failure or self.check(kind, message)
            if failure is not None:  # stop: this gradient is not applied
                active.discard(worker)
                if kind == GRADIENT:  # it waits for the exit status (if it is gone by now,
                    self.send(worker, failure.exit_code)  # the first reason stands)
                continue
            self.apply(worker, message)
            if self.args.in_turn:  # its reply waits until no other worker computes
                waiting.append(worker)
            else:
                failure = self.answer(worker, inbox, active)
            self.last_update = time.perf_counter()
            self.busy += self.last_update - begin
            if self.version % self.updates_per_epoch == 0:
                self.end_epoch()
        self.finish(finished, failure)

    def heard(self, worker, message):
        """A message has landed (called from the Inbox's thread): a worker done with its part
        waits for its release from now on, so the heartbeat covers it now, not once this loop
        reads its DONE: that may be after an epoch end (evaluation, checkpoint, curve) longer
        than --timeout."""
        if message[0].item() == DONE:
            self.heartbeat.add(worker)

    def answer(self, worker, inbox, active):
        """Reply to `worker` to go on (or, with --share-work, to finish) and expect its next
        message; if it is gone, it leaves `active` and the PeerLost to stop with is returned."""
        failure = self.send(worker, self.go_on(worker))
        if failure is None:
            inbox.expect(worker)
        else:
            active.discard(worker)
            self.gone.add(worker)
        return failure

    def lost(self, workers, error):
        """The PeerLost to stop with: a worker died, or sent nothing for --timeout."""
        if isinstance(error, TimeoutError):  # the Inbox's
            why = f"worker {workers[0]}: {error}"
        elif len(workers) == 1:  # its own receive failed: its connection closed
            why = f"worker {workers[0]}: it died ({distributed.failure_line(error, 100)})"
        else:  # a receive from any source
            why = (f"one of workers {workers}: one died, or sent nothing for --timeout "
                   f"{self.args.timeout:g} s ({distributed.failure_line(error, 100)})")
        return PeerLost(f"the parameter server lost {why}; {self.saved()}")

    def send(self, worker, status):
        """reply(), or the PeerLost to stop with if `worker` is gone."""
        try:
            self.reply(worker, status)
        except RuntimeError as exc:
            if not distributed.is_peer_failure(exc):
                raise
            return self.lost([worker], exc)
        return None

    def check(self, kind, message):
        """The reason to stop everyone, if there is one."""
        if kind == STOPPING or self.proc.stop.signum:
            signum = self.proc.stop.signum or signal.SIGTERM
            return Interrupted(f"stopped by {signal.Signals(signum).name} after {self.version} "
                               f"updates: checkpoint written to {self.checkpoint.path}; "
                               f"{training.to_resume(self.args)}", signum)
        if not math.isfinite(message[3].item()):
            return NonFiniteLoss(f"loss became non-finite after {self.version} updates; the last "
                                 f"good checkpoint in {self.proc.out} is kept; lower --lr")
        return None

    def new_epoch(self, so_far=None):
        """Start an epoch's bookkeeping, or go on with a resumed one's (`so_far`)."""
        so_far = so_far or {"totals": [0.0, 0.0, 0.0], "staleness": [], "busy": 0.0,
                            "pulled": 0, "lr": self.lr(), "seconds": 0.0}
        self.totals = list(so_far["totals"])  # loss sum, correct, samples
        self.staleness = list(so_far["staleness"])
        self.busy, self.pulled = so_far["busy"], so_far["pulled"]
        self.lr_at_start = so_far["lr"]
        self.started = self.last_update = time.perf_counter() - so_far["seconds"]

    def epoch_so_far(self):
        """The bookkeeping of the epoch in progress, for a checkpoint written inside it (its
        time up to the last update: not the wait that found a worker lost)."""
        return {"totals": self.totals, "staleness": self.staleness, "busy": self.busy,
                "pulled": self.pulled, "lr": self.lr_at_start,
                "seconds": self.last_update - self.started}

    def average_statistics(self):
        """The model's BatchNorm statistics: the mean of the workers' latest (as sync SGD
        averages them over ranks), so that one model is evaluated and saved."""
        if self.statistics:
            mean = torch.stack(list(self.statistics.values())).mean(0)
            for b, values in zip(self.layout.buffers, mean.split(
                    [b.numel() for b in self.layout.buffers])):
                b.copy_(values.view_as(b))

    def end_epoch(self):
        seconds = time.perf_counter() - self.started
        self.average_statistics()
        test_loss, test_acc = training.evaluate(self.model, self.test_loader, self.proc)
        epoch = math.ceil(self.version / self.updates_per_epoch)
        updates = len(self.staleness)
        loss_sum, correct, samples = self.totals
        rows = self.state.rows
        row = {"epoch": epoch, "train_loss": loss_sum / samples,
               "train_acc": 100.0 * correct / samples, "test_loss": test_loss,
               "test_acc": test_acc, "lr": self.lr_at_start, "epoch_seconds": seconds,
               "elapsed_seconds": (rows[-1]["elapsed_seconds"] if rows else 0.0) + seconds,
               "images_per_s": samples / seconds, "updates": self.version,
               "updates_per_s": updates / seconds,
               "mean_staleness": sum(self.staleness) / updates,
               "max_staleness": max(self.staleness), "server_busy": self.busy / seconds,
               "pulled": self.pulled / updates}
        self.state.add(row)
        self.proc.log(training.epoch_line(row, self.args.epochs) +
                      f" | {row['updates_per_s']:.1f} updates/s | staleness mean "
                      f"{row['mean_staleness']:.2f} max {row['max_staleness']}"
                      + (f" | {100 * row['pulled']:.0f}% pulled" if self.pull else ""))
        self.new_epoch()  # before the checkpoint: nothing of the next epoch is done yet
        self.save()
        self.folder.write(self.state.rows)  # metrics.csv, curve.png (and tb/)

    def save(self):
        self.state.extra = {"updates": self.version,
                            "positions": [self.position[w] for w in self.workers],
                            "batches_per_worker": self.batches,
                            "epoch_so_far": self.epoch_so_far(),
                            "momentum": [self.v[w].cpu() for w in self.workers]}
        if self.args.dc_lambda:
            self.state.extra["mean_square"] = self.mean_square.cpu()
        self.checkpoint.save(self.state)

    def saved(self):
        return (f"it saved the model after {self.version} updates (epoch "
                f"{self.version // self.updates_per_epoch} complete) to {self.checkpoint.path}; "
                f"{training.to_resume(self.args)}")

    def finish(self, finished, failure):
        for worker, request in self.pending.items():
            if self.broken or worker in self.gone:  # it may never complete
                continue
            try:
                request.wait()
            except RuntimeError as exc:
                # while stopping, a reply to a worker that is gone may fail: the first reason
                # to stop stands, and the checkpoint below is still written
                if failure is None or not (isinstance(failure, PeerLost)
                                           or distributed.is_peer_failure(exc)):
                    raise
        for worker, sent in sorted(finished.items()):
            self.proc.log(f"worker {worker}: {sent} gradients sent, {self.applied[worker]} "
                          "applied")
        if self.staleness and failure is None:
            self.end_epoch()  # updates after the last full epoch-equivalent
        if isinstance(failure, (Interrupted, PeerLost)):
            self.average_statistics()
            self.save()  # the completed epochs' rows, the model as it is now
        self.heartbeat.stop()
        if not self.broken:
            status = torch.tensor([0.0 if failure is None else failure.exit_code])
            for worker in finished:
                try:
                    dist.send(status, dst=worker)  # release it
                except RuntimeError as exc:  # gone after its part: the run is complete
                    if not distributed.is_peer_failure(exc):
                        raise
                    self.proc.log(f"worker {worker}: gone before it was released "
                                  f"({distributed.failure_line(exc, 100)})")
        if failure is not None:
            raise failure


# ------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="cifar100", arch="hw4")
    flags.add_distributed_flags(parser)
    g = parser.add_argument_group("async SGD")
    g.add_argument("--straggler-delay", type=flags.non_negative_float, default=0.0,
                   metavar="SECONDS",
                   help="make worker 1 sleep this long after each step (shows staleness)")
    g.add_argument("--share-work", action="store_true",
                   help="end the run after its --epochs x updates-per-epoch updates, whichever "
                        "workers made them: a slower worker makes fewer, the others more, so it "
                        "does not set the run's length (its shard is then trained on less "
                        "often). Default: every worker trains on all of its shard every epoch")
    g.add_argument("--dc-lambda", type=float, default=DC_LAMBDA, metavar="LAMBDA",
                   help="delay compensation's strength, lambda in DC-ASGD's g + lambda g*g*"
                        "(theta - theta_sent) / sqrt(mean g^2) (default %(default)g: off; 2 is "
                        "DC-ASGD's and helped 2 workers only before the reply was extrapolated, "
                        "never 4 or 8)")
    g.add_argument("--ahead", type=float, default=None, metavar="K",
                   help="reply with the parameters extrapolated K updates ahead along the "
                        "workers' momentum, theta - K lr mean(v_j) (default: workers - 1, the "
                        "expected staleness; 0: theta as it is)")
    g.add_argument("--pull", type=float, default=PULL, metavar="P",
                   help="each update also moves the parameters P / N of the way back to the "
                        "ones its worker computed the gradient on (the head excepted under "
                        "--fresh-head), which damps the other workers' moves that the reply "
                        "did not foresee (default %(default)g; 0: off; 0.3 and 0.4 measured level)")
    g.add_argument("--pull-from", type=int, default=PULL_FROM, metavar="S",
                   help="pull only the gradients at least S updates stale (default "
                        "%(default)d: not those one update late, the most with 2 workers)")
    g.add_argument("--pull-centered", action="store_true",
                   help="measure the pull's gap from where the parameters were expected to be, "
                        "the reply plus K - s updates along the mean buffer for a gradient s "
                        "updates stale, so that its expected move is zero for any --ahead K "
                        "(default: off, the gap from the reply itself)")
    g.add_argument("--in-turn", action="store_true",
                   help="a control with nothing stale: the server replies to one worker at a "
                        "time, after the previous one's gradient is applied, so every gradient "
                        "(after the first round) is computed on the current parameters; "
                        "workers take turns and the run is as slow as one worker (use with "
                        "--ahead 0)")
    g.add_argument("--fresh-head", action=argparse.BooleanOptionalAction, default=True,
                   help="the server recomputes the head's (fc) gradient at its current "
                        "parameters from the features and labels each worker sends, so that "
                        "the layer staleness hurts most is never stale")
    parser.set_defaults(backend="gloo")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    for flag, value in (("--dc-lambda", args.dc_lambda), ("--ahead", args.ahead),
                        ("--pull", args.pull), ("--pull-from", args.pull_from)):
        if value is not None and value < 0:
            raise UserError(f"{flag} {value:g} is negative; use 0 (off) or more")
        if value is not None and not math.isfinite(value):
            raise UserError(f"{flag} {value:g} is not a number; use 0 (off) or more")
    if args.pull > 1:  # over a round of N updates the pull would overshoot the gap
        raise UserError(f"--pull {args.pull:g} is more than 1; use a fraction from 0 (off) to 1")
    launch = detect_launch()
    n_workers = launch.world_size - 1
    if n_workers < 1:
        raise UserError("async SGD needs at least 2 processes (rank 0 is the parameter server, "
                        "the others are workers); start it with e.g. mpirun -np 3")
    if args.backend not in ("gloo", "mpi"):
        raise UserError(f"--backend {args.backend}: the parameter server's messages are CPU "
                        "tensors, which only gloo and mpi move; use --backend gloo")
    if args.batch_size < n_workers:
        raise UserError(f"--batch-size {args.batch_size} is smaller than the {n_workers} "
                        f"workers; use at least {n_workers} (it is the global batch)")
    per_worker_batch = args.batch_size // n_workers
    proc = process.start(args, SCRIPT, launch.rank, launch.world_size, launch.local_rank)
    folder = outputs.RunFolder(args, proc, TARGET if args.dataset == "cifar100" else None)
    comm = distributed.start(args, proc, launch)
    try:
        comm.check_same_flags(args)  # one recipe for every rank
        train_set, test_set = data.load_datasets(args.dataset, args)
        # Workers shard the training set among themselves; the server alone evaluates.
        if comm.rank == 0:
            test_loader = loader.test_loader(test_set, args, proc)
        else:
            train_loader = loader.train_loader(train_set, args, proc, batch_size=per_worker_batch,
                                               rank=comm.rank - 1, world_size=n_workers)
        per_worker = math.ceil(len(train_set) / n_workers)  # DistributedSampler's shard size
        updates_per_epoch = math.ceil(per_worker / per_worker_batch) * n_workers

        model = build_model(args.arch, len(train_set.classes), args.dropout)
        # The server never trains: a contiguous copy halves its work per update (BENCHMARKS.md).
        model = proc.prepare(model) if comm.rank else model.to(proc.device)
        # The server's optimizer state (its momentum buffers, the updates done) is its own.
        checkpoint = Checkpoint(args, proc, model, optimizer=None, scheduler=None, comm=comm)
        state = checkpoint.resume()
        comm.broadcast_parameters(model)  # every worker starts from the server's weights
        if comm.rank == 0:
            if args.evaluate:
                return training.evaluate_checkpoint(model, test_loader, proc, checkpoint, state)
            training.describe(proc, args, model, train_set, test_set,
                              f"1 server + {n_workers} worker{'s' * (n_workers > 1)} x batch "
                              f"{per_worker_batch} = "
                              f"global batch {per_worker_batch * n_workers}, {updates_per_epoch} "
                              "updates per epoch")
            folder.write_config(resumed_after_epoch=state.epoch,
                                updates_per_epoch=updates_per_epoch)
            Server(model, n_workers, args, proc, test_loader, state, updates_per_epoch,
                   checkpoint, folder).serve()
            proc.log(f"final test accuracy: {state.rows[-1]['test_acc']:.2f}%")
            comm.finish()
        elif not args.evaluate:
            try:
                positions = resume_positions(state, n_workers, updates_per_epoch, args)
                computes = not args.share_work or comm.rank in first_round(
                    positions, args.epochs * updates_per_epoch)
                work(model, train_loader, args, proc, positions[comm.rank - 1], computes)
            except RuntimeError as exc:
                if not distributed.is_peer_failure(exc):
                    raise
                raise PeerLost(f"worker {proc.rank} lost the parameter server "
                               f"({distributed.failure_line(exc)})") from None
            released(proc, args)
            comm.finish()
    finally:
        comm.close()


if __name__ == "__main__":
    process.execute(main)
