"""Where generator workers join a trainer (:class:`Listener`): the listening socket, the weight broadcasts'
rendezvous, and a thread that greets each connection (the handshake, the welcome, the replica's build, the pair
group) and hands the joined workers to the pool (:class:`grpolab.rollout.remote.pool.WorkerPool`), which admits them
on its own thread."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import queue
import socket
import threading
from collections.abc import Callable

import torch

from grpolab.common.distributed import forced_backend
from grpolab.common.errors import ConfigError
from grpolab.rollout.remote.common import HANDSHAKE_TIMEOUT, SMALL, keepalive, pair_group, transport_backend
from grpolab.rollout.remote.handle import WorkerHandle, open_link
from grpolab.rollout.remote.wire import WireError, challenge, check_answer, recv_frame, send_frame
from grpolab.rollout.replica import START_TIMEOUT
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import base_model


def welcome(model, dtype, spec: EngineSpec, timeout, run) -> dict:
    """What a worker needs to build its replica and engine (:func:`worker_spec` reads it), as JSON: the model's class
    name and config, the dtypes, the token ids, the staleness K, the head, vLLM's seed (``spec``'s), the timeout and
    the run id."""
    storage = spec.storage
    base, param = base_model(model), next(model.parameters())
    return {
        "kind": "welcome",
        "run": run,
        "model_class": type(base).__name__,
        "config": json.loads(base.config.to_json_string(use_diff=False)),
        "attention": getattr(base.config, "_attn_implementation", None),
        "param_dtype": str(param.dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
        "storage": str(storage).removeprefix("torch.") if storage is not None else None,
        "eos_id": spec.eos_id,
        "pad_id": spec.pad_id,
        "always_copy": spec.max_staleness > 0,
        "trainable": param.requires_grad,
        "fp32_head": spec.fp32_head,
        "seed": spec.seed,
        "timeout": timeout,
    }


class Listener:
    """Listens on ``host:port`` and greets each connection on a thread of its own, so a stranger cannot block the
    trainer. A worker that passes the handshake gets ``welcome`` (with its id, group and ``buffers``), builds its
    replica and joins a pair group; it is then put on :attr:`joining`. ``refused(peer)`` is called for each
    connection refused; ``say`` writes the log lines."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        welcome: dict,
        buffers: dict[str, torch.Tensor],
        token: bytes,
        run: str,
        device: str,
        timeout: float,
        say: Callable[[str], None],
        refused: Callable[[str], None],
    ):
        import torch.distributed as dist

        try:
            forced_backend()  # a backend the workers' groups cannot have ends the run here, not each worker's start
        except ValueError as e:
            raise ConfigError(f"--generators: {e}") from None
        self.welcome, self.buffers, self.token, self.run = welcome, buffers, token, run
        self.device, self.timeout, self.say, self.refused = device, timeout, say, refused
        self.joining: queue.Queue[WorkerHandle] = queue.Queue()
        self.closed = False
        span = datetime.timedelta(seconds=START_TIMEOUT)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=span)
        self.welcome["store_port"] = self.store.port  # the worker reaches it at the host it connected to
        self.server = socket.create_server((host, port), backlog=16)
        self.address = f"{host}:{self.server.getsockname()[1]}"
        self.ids = itertools.count(1)
        self.accepting = threading.Thread(target=self.accept, name="grpolab-generators-accept", daemon=True)
        self.accepting.start()

    def accept(self) -> None:
        """The accepting thread's loop: each connection is greeted on a thread of its own."""
        while not self.closed:
            try:
                sock, peer = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self.greet, args=(sock, peer), daemon=True).start()

    def greet(self, sock: socket.socket, peer) -> None:
        """A new connection: the handshake, then :meth:`join`. Refused with one log line if anything is off."""
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            sent = challenge(self.run)
            send_frame(sock, sent)
            hello, _ = recv_frame(sock, SMALL)
            about = check_answer(sent, hello, self.token)
        except (WireError, ConnectionError, OSError, ValueError) as e:
            self.refused(f"{peer[0]}:{peer[1]}")
            self.say(f"generators: refused a connection from {peer[0]}:{peer[1]}: {e}")
            with contextlib.suppress(OSError):
                send_frame(sock, {"kind": "refused", "why": str(e)})
            sock.close()
            return
        worker = WorkerHandle(next(self.ids), sock, about)
        worker.backend = transport_backend(self.device, str(about.get("device", "cpu")))
        try:
            self.join(worker)
        except Exception as e:  # anything that keeps it from joining is one line; the run goes on without it
            self.say(f"generators: {worker.name} failed to start: {type(e).__name__}: {e}")
            sock.close()
            return
        self.joining.put(worker)
        if self.closed:  # the run ended while it joined: close() may have emptied the queue before this put
            worker.link.close()

    def join(self, worker: WorkerHandle) -> None:
        """The welcome and the buffers, the worker's ready, its pair group and its link."""
        sock = worker.sock
        names = sorted(self.buffers)
        welcome = dict(self.welcome, id=worker.id, group=f"worker{worker.id}", buffers=names, backend=worker.backend)
        send_frame(sock, welcome, [self.buffers[n] for n in names])
        sock.settimeout(START_TIMEOUT)
        ready, _ = recv_frame(sock, SMALL)
        if ready.get("kind") != "ready":
            raise WireError(f"answered {ready.get('kind')!r}, not ready")
        store = self.store
        if self.closed or store is None:
            raise WireError("the run has ended")
        worker.group = pair_group(store, f"worker{worker.id}", 0, worker.backend, self.timeout)
        keepalive(sock)
        worker.link = open_link(sock, self.timeout, f"grpolab-worker{worker.id}")

    def close(self) -> None:
        """Stop listening; close the links of workers that joined but were not admitted."""
        self.closed = True
        with contextlib.suppress(OSError):  # wakes the accepting thread (close() alone does not, on Linux)
            self.server.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.server.close()
        self.accepting.join(timeout=5)
        while not self.joining.empty():
            self.joining.get_nowait().link.close()

    def release(self) -> None:
        """The broadcasts' rendezvous goes with the pool (after its workers were told to stop)."""
        self.store = None
