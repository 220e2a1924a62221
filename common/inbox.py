"""The parameter server's side of its messages (common/messages.py): a receive from whichever
worker sends first that tells at once which one is lost (`Inbox`), a heartbeat for the workers
waiting for their release, the release, and the replies in flight waited for."""
import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist

from .messages import ALIVE, DONE
from .peers import failure_line, is_peer_failure
from .run import PeerLost


class Inbox:
    """Each message as it arrives, whichever peer sent it -- and which peer is lost, the moment
    its connection breaks or once it has sent nothing for `timeout` seconds since expected.

    With gloo, a thread per peer waits in a receive from that peer alone.  (A receive from any
    source cannot say which peer is gone: the server would serve the others while a dead
    worker's shard went untrained.)  A thread receives once its peer's next message is
    `expect`ed, into a buffer of its own.  The timeout is kept here, not by gloo, which closes
    every pair of the group when one receive times out: the others can still be told to stop.
    The mpi backend runs one operation at a time: there, one receive from any source.  A worker
    that sends DONE waits for its release from then on: the `heartbeat` covers it from the
    moment that lands, not once the server reads it (maybe after an epoch end > timeout)."""

    def __init__(self, peers, size, timeout, heartbeat):
        self.arrived, self.timeout, self.heartbeat = queue.Queue(), timeout, heartbeat
        self.threaded = dist.get_backend() == "gloo"
        self.messages = {p: torch.zeros(size) for p in peers}
        self.allowed = {p: threading.Semaphore(0) for p in peers}  # receive its next now
        self.due = {}  # the time by which each expected peer's next message must come
        for p in peers:
            self.expect(p)
            if self.threaded:
                threading.Thread(target=self.receive, args=(p,), daemon=True).start()

    def receive(self, peer):
        while True:
            self.allowed[peer].acquire()
            try:  # no gloo timeout (the class's docstring)
                dist.irecv(self.messages[peer], src=peer).wait(datetime.timedelta(days=365))
            except RuntimeError as exc:  # it died (gloo's error says so)
                self.arrived.put((peer, exc))
                return
            if self.messages[peer][0].item() == DONE:  # it waits for its release from now on
                self.heartbeat.add(peer)
            self.arrived.put((peer, None))

    def expect(self, peer):
        """Receive `peer`'s next message (its buffer is free again) within the timeout."""
        self.due[peer] = time.monotonic() + self.timeout
        self.allowed[peer].release()

    def next(self):
        """(peer, its message, None), or (peer, None, why it is lost): the error its receive
        failed with, or a TimeoutError.  Without threads the peer may be None."""
        if not self.threaded:  # one receive from any source, with the group's timeout
            message = next(iter(self.messages.values()))
            try:
                peer = dist.recv(message)
            except RuntimeError as exc:
                return None, None, exc
            if message[0].item() == DONE:
                self.heartbeat.add(peer)
            return peer, message, None
        while True:
            late = min(self.due, key=self.due.get)
            try:
                peer, error = self.arrived.get(timeout=max(self.due[late] - time.monotonic(), 0))
            except queue.Empty:
                if time.monotonic() < self.due[late]:
                    continue
                del self.due[late]
                return late, None, TimeoutError(f"it sent nothing for --timeout "
                                                f"{self.timeout:g} s")
            if self.due.pop(peer, None) is None:  # heard from after its --timeout: the run
                continue  # stops already without it, its message is dropped
            return peer, None if error else self.messages[peer], error


class Heartbeat:
    """Tells the peers that wait for this rank's last word (async workers done with their part,
    waiting for their release) that it lives: a beat every quarter of `timeout`, from a thread
    of its own.  Such a peer may wait far longer than `timeout` for the others' work, yet knows
    within `timeout` when this rank dies, hangs or is cut off."""

    def __init__(self, timeout):
        self.period, self.peers, self.lock = timeout / 4, set(), threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.beat, daemon=True)
        self.thread.start()

    def add(self, peer):
        with self.lock:
            self.peers.add(peer)

    def beat(self):
        alive = torch.tensor([ALIVE])
        while not self.stopped.wait(self.period):
            with self.lock:
                peers = sorted(self.peers)
            for peer in peers:
                try:
                    dist.isend(alive, dst=peer).wait()
                except RuntimeError:  # gone: its release will find it so, and say it
                    with self.lock:
                        self.peers.discard(peer)

    def stop(self):
        """No more beats: the last word can follow."""
        self.stopped.set()
        self.thread.join()


def release(workers, status, log):
    """Tell each worker done with its part the run's exit status (0: complete)."""
    for worker in workers:
        try:
            dist.send(torch.tensor([float(status)]), dst=worker)
        except RuntimeError as exc:  # gone after its part: the run is complete all the same
            if not is_peer_failure(exc):
                raise
            log(f"worker {worker}: gone before it was released ({failure_line(exc, 100)})")


def wait_for_sends(pending, gone, failure):
    """Wait for the replies still in flight, but those to workers `gone`: while stopping, a
    reply to a worker gone too may fail, and the first reason to stop (`failure`) stands."""
    for worker, request in pending.items():
        if worker in gone:  # it may never complete
            continue
        try:
            request.wait()
        except RuntimeError as exc:
            if failure is None or not (isinstance(failure, PeerLost) or is_peer_failure(exc)):
                raise


def lost_worker(worker, error, active, timeout):
    """Which worker the server lost and how, for its line: `worker` died or sent nothing for
    --timeout (None: one of the `active` ones, from a receive from any source)."""
    if not (isinstance(error, TimeoutError) or is_peer_failure(error)):
        raise error
    if worker is None:
        return (f"one of workers {sorted(active)}: one died, or sent nothing for --timeout "
                f"{timeout:g} s ({failure_line(error, 100)})")
    if isinstance(error, TimeoutError):  # the Inbox's
        return f"worker {worker}: {error}"
    return f"worker {worker}: it died ({failure_line(error, 100)})"  # its connection closed
