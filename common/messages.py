"""The parameter server's messages (async_sgd_cifar100.py), one flat float32 tensor each:

    worker -> server  [kind, samples, correct, loss sum | gradient | BatchNorm buffers
                       | the head's input features | their labels]       kind: GRADIENT,
                       DONE (its epochs are trained) or STOPPING (it was asked to stop)
    server -> worker  [status | parameters]     status: CONTINUE, or the exit status to
                                                stop with
    at the end, server -> worker [status]       releases a worker that sent DONE (ALIVE, the
                                                heartbeat, until then)

and how a worker takes the server's statuses (the server's side: common/inbox.py).
"""
import itertools

import torch
import torch.distributed as dist

from .peers import peer_lost_as
from .run import Interrupted, NonFiniteLoss, PeerLost

GRADIENT, DONE, STOPPING = 0.0, 1.0, 2.0
HEADER = 4
CONTINUE = 0.0
ALIVE = -2.0  # the heartbeat: not a status the last word can have (0 or an exit status)


class Messages:
    """Where each parameter, BatchNorm buffer and head input sits in the flat messages."""

    def __init__(self, model, batch):
        self.params = list(model.parameters())
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.sizes = [p.numel() for p in self.params]
        self.n_params, self.n_buffers = sum(self.sizes), sum(b.numel() for b in self.buffers)
        starts = dict(zip(map(id, self.params), itertools.accumulate(self.sizes, initial=0)))
        self.head_parameters = model.fc.weight, model.fc.bias
        self.head = [slice(starts[id(p)], starts[id(p)] + p.numel())  # fc's, in the gradient
                     for p in self.head_parameters]
        self.batch, self.n_features = batch, model.fc.in_features  # room for a batch of inputs
        self.size = HEADER + self.n_params + self.n_buffers + batch * (self.n_features + 1)
        self.reply_size = 1 + self.n_params

    def pack(self, message, loss, output, labels, features):
        """A worker's gradient message: its header, the gradient and BatchNorm statistics (in
        one pass), and the head's input features and their labels."""
        n = labels.numel()
        message[:HEADER] = torch.tensor([GRADIENT, n, (output.argmax(1) == labels).sum().item(),
                                         loss.item() * n])
        tensors = [p.grad.reshape(-1) for p in self.params] + [b.reshape(-1) for b in self.buffers]
        body = message[HEADER:HEADER + self.n_params + self.n_buffers]
        if tensors[0].device == body.device:
            torch.cat(tensors, out=body)
        else:
            body.copy_(torch.cat(tensors))
        head = message[HEADER + self.n_params + self.n_buffers:]
        head[:n * self.n_features].copy_(features.detach().reshape(-1))
        head[self.batch * self.n_features:][:n].copy_(labels)

    def unpack(self, message):
        """A gradient message's gradient, BatchNorm statistics, head features and labels."""
        n = int(message[1].item())
        gradient, buffers, head = message[HEADER:].split(
            [self.n_params, self.n_buffers, self.batch * (self.n_features + 1)])
        features = head[:n * self.n_features].view(n, self.n_features)
        return gradient, buffers, features, head[self.batch * self.n_features:][:n].long()

    def flat_parameters(self):
        """The parameters as one flat tensor, which the model's parameters become views into."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        for p, view in zip(self.params, flat.split(self.sizes)):
            p.data = view.view_as(p)
        return flat

    def load_parameters(self, flat):
        for p, chunk in zip(self.params, flat.to(self.params[0].device).split(self.sizes)):
            p.data.copy_(chunk.view_as(p))

    def load_buffers(self, flat):
        for b, chunk in zip(self.buffers, flat.split([b.numel() for b in self.buffers])):
            b.copy_(chunk.view_as(b))


def stop_error(status, rank, hint):
    """The exception a worker stops with when the server says stop with this exit status;
    `hint` says how to resume."""
    if status == PeerLost.exit_code:
        return PeerLost(f"worker {rank}: the parameter server lost another worker and stopped; "
                        f"{hint}")
    if status >= 128:
        return Interrupted(f"worker {rank}: stopped by the parameter server (signal); its "
                           f"checkpoint is written; {hint}", status - 128)
    return NonFiniteLoss(f"worker {rank}: stopped by the parameter server (the loss or the "
                         "weights became NaN or inf; its line says which)")


def wait_for_release(rank, hint):
    """After DONE, wait for the server's word that the outputs are written, for as long as the
    other workers train (its heartbeat says it lives).  If it says the run stopped, or dies or
    goes silent for --timeout first, the run is not complete: a launcher that restarts failed
    ranks must restart this one too, for the group to meet again."""
    status = torch.zeros(1)
    with peer_lost_as(lambda why: f"worker {rank}: done, but the parameter server died or went "
                                  f"silent before it said the run was complete ({why}); {hint}",
                      limit=100):
        dist.recv(status, src=0)  # within --timeout: the heartbeat comes every quarter of it
        while status.item() == ALIVE:
            dist.recv(status, src=0)
    if status.item() != 0:
        raise stop_error(int(status.item()), rank, hint)


def losing_the_server(rank):
    """A worker's exchange with the server, where losing it is one line and the exit 200."""
    return peer_lost_as(lambda why: f"worker {rank} lost the parameter server ({why})")
