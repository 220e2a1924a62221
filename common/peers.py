"""A lost peer told from a bug: communication that fails because another rank died or went silent
is one line and the retryable exit 200 (PeerLost); any other error stays as it is."""
import re
from contextlib import contextmanager

import torch.distributed as dist

from .run import PeerLost


def is_peer_failure(exc):
    """Did a collective fail because another rank died or stopped answering?"""
    return isinstance(exc, dist.DistError) or any(marker in str(exc) for marker in (
        "gloo", "Connection reset", "Connection closed", "Timed out", "NCCL", "timed out",
        "pair closure"))


def failure_line(exc, limit=160):
    """A collective's error in a few words: its first line without the source location gloo
    puts first or its advice to check the remote logs; if still long, its end."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically caused")[0]
    return text[-limit:]


@contextmanager
def peer_lost_as(say, limit=160):
    """Communication that fails because another rank died or went silent ends this one with
    the line `say(the error's failure_line)` and the retryable exit (PeerLost); any other error
    (a tensor on a device the backend does not take, say) stays as it is: retrying cannot help."""
    try:
        yield
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        raise PeerLost(say(failure_line(exc, limit))) from None
