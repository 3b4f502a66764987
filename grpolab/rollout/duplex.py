"""One end of a connection to another process, read and written by two threads of its own, so that no wait on the
other end is without a deadline.

The reader takes each message whole and puts it in a queue that the caller reads with a timeout: a read of the
connection itself blocks until the whole message is there, so a peer stopped between a message's length and its
payload (SIGSTOP, a cgroup freezer, a debugger) would hold the caller for ever. The writer sends the caller's
messages in order while the reader drains the peer's: a peer writes its answer (megabytes at a hundred rows) only to
a reader, and with the caller writing a request of its own at that moment, neither would read, and both would wait
for ever. A stopped or dead peer leaves a thread blocked in the connection; :meth:`Duplex.close` shuts the
connection down, which ends that read or write, and with it the thread.

Used for the generator process's pipe (:mod:`grpolab.rollout.generator`) and each generator worker's socket
(:mod:`grpolab.rollout.remote`). Written here: ``multiprocessing.connection`` and grpolab's frames
(:mod:`grpolab.rollout.remote.wire`) read and write whole messages with no deadline of their own; a thread per direction
over them is the usual way to give them one.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

__all__ = ["CLOSED", "Duplex"]

CLOSED = object()
"""What the reader hands on when the connection ends (the peer died or closed it, or a message was malformed)."""


class Duplex:
    """``read()``: the next whole message (raises when the connection ends or a message is malformed);
    ``write(message)``: send one; ``shutdown()``: end any read or write blocked in the connection (for a socket,
    ``shutdown(SHUT_RDWR)``); ``release()``: close it once both threads are gone. ``name`` names the threads."""

    def __init__(
        self,
        read: Callable[[], object],
        write: Callable[[object], None],
        shutdown: Callable[[], None],
        release: Callable[[], None],
        name: str,
    ):
        self._read_one, self._write_one, self._shutdown, self._release = read, write, shutdown, release
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.failed = False
        """The writer could not write (the peer closed the connection or died)."""
        self.error: BaseException | None = None
        """Why the connection ended: the reader's or the writer's exception."""
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"{name}-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def _read(self) -> None:
        while True:
            try:
                message = self._read_one()
            except Exception as e:  # the connection ended, or a message was malformed: nothing more is read
                self.error = self.error or e
                self.inbox.put(CLOSED)
                return
            self.inbox.put(message)

    def _write(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self._write_one(message)
            except Exception as e:
                self.error, self.failed = self.error or e, True
                return

    def send(self, message) -> None:
        """Queue ``message`` for the peer (the writer sends the queue in order)."""
        self.outbox.put(message)

    def receive(self, timeout: float):
        """The peer's next message, :data:`CLOSED`, or None after ``timeout`` seconds without one."""
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, flush: float = 0.0) -> None:
        """End the connection: what is queued is written first for up to ``flush`` seconds (a parting "stop"), then
        the connection is shut down, which ends a read or write still blocked in it, so both threads are gone before
        it is released (and its descriptor could be reused)."""
        self.outbox.put(None)
        self._writer.join(timeout=flush)
        with contextlib.suppress(OSError):
            self._shutdown()
        self._writer.join(timeout=5)
        self._reader.join(timeout=5)
        self._release()
