"""The trainer's handle on one joined generator worker (:class:`WorkerHandle`): its connection, its process group,
the requests it was sent and the answers it gave; and :class:`Lost`, which any use of a worker that has failed
raises."""

from __future__ import annotations

import dataclasses
import socket
import time

from grpolab.rollout.duplex import CLOSED, Duplex
from grpolab.rollout.remote.wire import send_frame
from grpolab.rollout.remote.worker import next_frame


class Lost(Exception):
    """``worker`` has failed (``why``): the pool drops it and draws its parts elsewhere."""

    def __init__(self, worker: WorkerHandle, why: str):
        super().__init__(why)
        self.worker, self.why = worker, why


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    """The trainer's handle on one worker."""

    id: int
    sock: socket.socket
    about: dict
    link: Duplex | None = None
    """The connection once the worker has joined, read and written on threads of its own (:func:`open_link`)."""
    group: object = None
    backend: str = "gloo"
    answers: dict = dataclasses.field(default_factory=dict)
    dropped: set = dataclasses.field(default_factory=set)
    """Tags of draws whose request was dropped (a draw ahead not asked for): their answers are stale."""
    sent: dict = dataclasses.field(default_factory=dict)
    """tag -> (what, monotonic time sent)."""
    rows: int = 0
    seconds: float = 0.0
    stale: int = 0
    """Answers read to requests that were dropped (read and let go)."""
    newest: int | None = None
    """The newest weight version it was sent (its buffers hold it: the next is sent as the delta from it)."""

    @property
    def name(self) -> str:
        return f"worker {self.id} ({self.about.get('host', '?')}, pid {self.about.get('pid', '?')})"

    def send(self, header: dict, tag: int) -> None:
        """Queue ``header`` with ``tag`` (its sequence number: the answer carries it); the link's writer sends it."""
        if self.link.failed:
            raise Lost(self, f"its connection failed ({self.link.error})")
        self.link.send((dict(header, tag=tag), ()))
        self.sent[tag] = (header["kind"], time.monotonic())

    def answer(self, tag: int, timeout: float):
        """The answer to ``tag`` if it has come within a short wait (None if not yet): ``(header, tensors)``.
        Raises :class:`Lost` when the worker closed, sent garbage or is past ``timeout`` seconds on its oldest
        request."""
        if tag in self.answers:
            return self.answers.pop(tag)
        frame = self.link.receive(timeout=0.05)
        if frame is CLOSED:
            raise Lost(self, f"its connection failed ({self.link.error})")
        if frame is not None:
            header, tensors = frame
            got = header.get("tag")
            asked = self.sent.pop(got, None)
            if asked is None:
                raise Lost(self, f"it answered request {got!r}, which it was not sent or had answered")
            kind, _ = asked
            if got in self.dropped:
                self.dropped.discard(got)
                self.stale += 1
            elif kind != "sync":  # a sync's answer only says when: read and let go
                self.answers[got] = (header, tensors)
            return self.answers.pop(tag, None)
        oldest = min((t for _, t in self.sent.values()), default=None)
        if oldest is not None and time.monotonic() - oldest > timeout:
            raise Lost(self, f"no answer in {timeout:g} s (--generator-timeout)")
        return None


def open_link(sock: socket.socket, timeout: float, name: str) -> Duplex:
    """A joined worker's connection on the trainer's side (:class:`grpolab.rollout.duplex.Duplex`): a reader thread
    takes each frame whole, so a worker's answer is read as it comes, also while the trainer waits in a weight
    broadcast (a worker blocked writing an answer nobody reads would never join the broadcast), and a writer sends
    the trainer's frames. The socket's ``timeout``: a frame half-read, or one the worker does not take, fails the
    connection after it."""
    sock.settimeout(timeout)

    def shutdown() -> None:
        sock.shutdown(socket.SHUT_RDWR)

    return Duplex(lambda: next_frame(sock), lambda frame: send_frame(sock, *frame), shutdown, sock.close, name)


def other_kernels(about: dict, device: str, dtype) -> str:
    """How a worker (its handshake's ``about``) samples otherwise than the trainer's own engine would, on
    ``device`` in ``dtype``: "with vllm", "on cuda:0", "in bfloat16" ("" if it does not)."""
    out = []
    if about.get("engine", "hf") != "hf":
        out.append(f"with {about['engine']}")
    if str(about.get("device", device)).split(":")[0] != str(device).split(":")[0]:
        out.append(f"on {about['device']}")
    asked = about.get("rollout_dtype", "auto")
    if asked not in ("auto", str(dtype).removeprefix("torch.")):
        out.append(f"in {asked}")
    return ", ".join(out)
