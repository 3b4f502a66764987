"""Generator workers: rollout engines in processes of their own, on this machine or others, joined over TCP.

A worker (``grpolab generator --connect HOST:PORT``, :func:`run_worker`) connects to a trainer started with
``--generators N``, which listens on ``--generator-listen`` (:class:`WorkerPool`). The worker keeps its own device,
engine (hf or vllm), rollout dtype and threads; the trainer keeps everything else (the collector, rewards,
environments, the update).

The connection: after the handshake (:mod:`grpolab.rollout.wire`: the protocol, the run id, an HMAC of a nonce
under the shared token), the trainer sends the model's class name, its config as JSON and its buffers; the worker
builds a replica, says it is ready, and both ends join a process group of their own (``torch.distributed``, gloo on
a CPU, NCCL between CUDA devices: two ranks, the trainer rank 0), over which every weight version is broadcast in
buckets of ``BUCKET_BYTES``, in the rollout dtype. Draws, their answers and the sync notices are frames on the TCP
connection. Weights are sent after the optimizer step, outside FSDP2's gather (:meth:`WorkerPool.weights_changed`
runs after ``full_weights`` has closed), so they never interleave with the trainer's own collectives.

Every rollout is drawn from its own key with a named weight version (the generator process's bookkeeping,
:mod:`grpolab.rollout.generator`, whose child loop each worker runs). A call's rows are split into N contiguous
parts (N = --generators), each padded to the whole call's prompt width and drawn as one batch by some live worker,
so the run does not depend on which workers are live, lost or late. With N = 1 it is the trainer's own engine's bit
for bit; with N > 1 the tokens are, and the log-probs to the last bits (docs/distributed.md: this CPU's matrix
kernels compute a row otherwise in a batch of fewer than 4 rows).

Faults: a worker that dies, closes its connection or gives no answer within ``--generator-timeout`` is dropped
(``generators/lost``) and its parts are drawn again by the next live worker from the same keys (``generators/
redrawn``). A worker that joins late gets the versions a later draw may still ask for (the newest K + 1) before it
draws. With no worker left the trainer waits ``--generator-wait`` seconds for one to join, then stops with one
:class:`grpolab.common.errors.GeneratorError`. A worker exits when its connection closes (the trainer ended or died:
the kernel closes a dead process's sockets, and TCP keepalive notices a vanished host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import os
import queue
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch

from grpolab.common.distributed import forced_backend
from grpolab.common.errors import ConfigError, GeneratorError
from grpolab.rollout.duplex import CLOSED, Duplex
from grpolab.rollout.generator import (
    START_TIMEOUT,
    STOP_MID_ANSWER,
    GeneratorSpec,
    ReplicaGenerator,
    SharedWeights,
    VersionedDraws,
)
from grpolab.rollout.sampler import Sampled, SamplingSettings
from grpolab.rollout.spec import EngineSpec, VLLMSettings
from grpolab.rollout.weights import base_model, lag_state, restored_lag, served_weights
from grpolab.rollout.wire import WireError, answer_challenge, challenge, check_answer, recv_frame, send_frame
from grpolab.vision.media import text_only

__all__ = ["TOKEN_ENV", "WorkerOptions", "WorkerPool", "read_token", "run_worker"]

log = logging.getLogger("grpolab.generators")

TOKEN_ENV = "GRPOLAB_GENERATOR_TOKEN"
"""The environment variable a shared token is read from (or a file named by --generator-token-file)."""
BUCKET_BYTES = 64 << 20
"""A weight broadcast's bucket: the flat buffer of each dtype goes in pieces of at most this many bytes."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to answer the challenge: a stranger that sends nothing is cut after it."""
RENDEZVOUS_TIMEOUT = 30.0
"""Seconds a worker that said it is ready waits to meet the trainer in their process group (the trainer builds it on
reading "ready"): a worker whose run ended or died meanwhile exits after it."""
SMALL = 1 << 16
"""The payload a handshake frame may carry (none)."""
RESULT_BYTES = 8 << 30
"""The largest answer the trainer reads (a draw's tensors)."""


def read_token(path: str = "") -> bytes:
    """The shared token: the file ``path``'s content (stripped), else $GRPOLAB_GENERATOR_TOKEN, else b"" (a trainer
    that listens on localhost only may go without)."""
    if path:
        return open(path, "rb").read().strip()
    return os.environ.get(TOKEN_ENV, "").encode()


def split_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, ``PORT``) as (host, port)."""
    host, _, port = address.rpartition(":")
    try:
        return host.strip("[]") or default_host, int(port)
    except ValueError:
        raise ConfigError(f"{address!r} is not HOST:PORT") from None


def is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer whose host vanished within about a minute (Linux's TCP keepalive options)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _first_words(error: Exception) -> str:
    """A torch.distributed error's first line without gloo's source location and advice ("Connection closed by
    peer [127.0.0.1]:10901")."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return line.split(". This is typically")[0]


def _backend(trainer_device: str, worker_device: str) -> str:
    """NCCL between two CUDA devices, else gloo (through the CPU); ``$GRPOLAB_DIST_BACKEND=gloo``: gloo always (its
    ``nccl`` is this rule: NCCL where both tensors are on CUDA)."""
    if forced_backend() == "gloo":
        return "gloo"
    return "nccl" if str(trainer_device).startswith("cuda") and str(worker_device).startswith("cuda") else "gloo"


def _pair_group(store, name: str, rank: int, backend: str, timeout: float):
    """A two-rank process group of its own (the trainer 0, one worker 1) over ``store``: a dead worker breaks only
    its own group, never the trainer's default one (DDP/FSDP2)."""
    import torch.distributed as dist

    prefix = dist.PrefixStore(name + "/", store)
    span = datetime.timedelta(seconds=timeout)
    if backend == "nccl":  # on CUDA (docs/gpu.md says what has run there)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = span
        return dist.ProcessGroupNCCL(prefix, rank, 2, options)
    return dist.ProcessGroupGloo(prefix, rank, 2, span)


def _broadcast(group, backend: str, piece: torch.Tensor, device: str) -> None:
    """One bucket from rank 0 into rank 1's ``piece`` (NCCL through a copy on the CUDA device)."""
    if backend == "nccl":
        staged = piece.to(device)
        group.broadcast(staged, 0).wait()
        piece.copy_(staged)
    else:
        group.broadcast(piece, 0).wait()


def _buckets(buffers: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each flat buffer in pieces of at most BUCKET_BYTES (views: broadcasting into them fills the buffer)."""
    pieces = []
    for name in sorted(buffers):
        flat = buffers[name]
        step = max(1, BUCKET_BYTES // flat.element_size())
        pieces += [flat[i : i + step] for i in range(0, flat.numel(), step)]
    return pieces


def _layout_json(layout: dict) -> dict:
    return {n: [str(d).removeprefix("torch."), start, list(shape)] for n, (d, start, shape) in layout.items()}


def _layout_of(data: dict) -> dict:
    return {n: (getattr(torch, d), start, torch.Size(shape)) for n, (d, start, shape) in data.items()}


def _settings_json(s: SamplingSettings) -> dict:
    return dataclasses.asdict(s)


# ---------------------------------------------------------------------- the worker
@dataclasses.dataclass
class WorkerOptions:
    """A worker's own flags (``grpolab generator --help``)."""

    connect: str
    run: str | None = None
    device: str = "cpu"
    rollout_dtype: str = "auto"
    threads: int = 1
    engine: str = "hf"
    token_file: str = ""
    retry: float = 60.0
    """Seconds to keep trying to connect (a worker may start before its trainer listens)."""


def _connect(options: WorkerOptions) -> socket.socket:
    host, port = split_address(options.connect)
    deadline = time.monotonic() + options.retry
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise GeneratorError(f"no trainer answered at {host}:{port} in {options.retry:g} s ({e})") from None
            time.sleep(0.5)
    _keepalive(sock)
    return sock


def run_worker(options: WorkerOptions, say: Callable[[str], None] = print) -> int:
    """Join the trainer at ``options.connect`` and draw what it asks until it stops us or goes away. Returns 0
    when told to stop or when the trainer closed the connection, 1 when a weight broadcast failed."""
    from grpolab.common.rng import set_threads

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    set_threads(options.threads)
    sock = _connect(options)
    try:
        welcome, generator, slot, group = _join(sock, options)
        name = f"worker {welcome['id']}"
        say(f"grpolab generator: {name} of run {welcome['run']!r} ({options.engine}, {generator.spec.dtype}, "
            f"{options.device})")  # fmt: skip
        return _serve(sock, generator, slot, group, welcome["backend"], options.device, name, say)
    except TimeoutError:
        say("grpolab generator: the trainer took no answer, or sent part of a frame, within --generator-timeout; "
            "exiting")  # fmt: skip
        return 1
    except (ConnectionError, OSError) as e:
        say(f"grpolab generator: the trainer closed the connection ({e.__class__.__name__}); exiting")
        return 0
    finally:
        sock.close()


def _join(sock: socket.socket, options: WorkerOptions):
    """The handshake, the welcome, the replica and its engine, the pair group: (welcome, generator, slot, group)."""
    import torch.distributed as dist

    frame, _ = recv_frame(sock, SMALL)
    about = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": options.device,
        "engine": options.engine,
        "rollout_dtype": options.rollout_dtype,
        "threads": options.threads,
    }
    send_frame(sock, answer_challenge(frame, read_token(options.token_file), options.run, about))
    welcome, buffers = recv_frame(sock, RESULT_BYTES)
    if welcome.get("kind") == "refused":
        raise WireError(f"the trainer refused this worker: {welcome.get('why')}")
    if welcome.get("kind") != "welcome":
        raise WireError(f"the trainer answered {welcome.get('kind')!r}, not a welcome")
    # from here a frame half-read, or an answer the trainer does not take, fails within the run's --generator-timeout
    # (the trainer reads every frame on a thread of its own: a write waits only on a trainer that is stopped or gone)
    sock.settimeout(welcome["timeout"])
    spec = _spec(welcome, dict(zip(welcome["buffers"], buffers)), options)
    slot = SharedWeights.of_layout(_layout_of(welcome["layout"]))
    generator = ReplicaGenerator(spec, slot, slot.buffers)
    generator.versions, generator.loaded = {}, -1  # the trainer sends the versions it needs
    send_frame(sock, {"kind": "ready"})
    host, _ = split_address(options.connect)
    span = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT)
    met = threading.Event()
    threading.Thread(target=_exit_if_closed, args=(sock, met), name="grpolab-rendezvous-watch", daemon=True).start()
    store = dist.TCPStore(host, welcome["store_port"], is_master=False, timeout=span)
    group = _pair_group(store, welcome["group"], 1, welcome["backend"], welcome["timeout"])
    met.set()
    return welcome, generator, slot, group


def _exit_if_closed(sock: socket.socket, met: threading.Event) -> None:
    """While the worker waits to meet the trainer in their process group (torch.distributed's waits cannot be
    interrupted), end the process if the trainer closes the connection: its run ended or it died."""
    while not met.is_set():
        ready, _, _ = select.select([sock], [], [], 0.2)
        if not ready:
            continue
        try:
            closed = sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            closed = True
        if closed and not met.is_set():
            print("grpolab generator: the trainer closed the connection before the weights' group formed; exiting")
            os._exit(1)
        met.wait(0.2)  # a frame waits for the serving loop


def _next_frame(sock: socket.socket) -> tuple[dict, list[torch.Tensor]]:
    """The trainer's next frame. Between frames a worker is idle, for as long as the trainer trains (its wait ends
    when the connection does: the kernel closes a dead trainer's socket, TCP keepalive notices a vanished host);
    once a frame has begun, the rest of it comes within the socket's timeout (--generator-timeout)."""
    while not select.select([sock], [], [], 1.0)[0]:
        pass
    return recv_frame(sock, RESULT_BYTES)


class _StopsMidFrame:
    """Tests only (``$GRPOLAB_TEST_STOP_MID_ANSWER`` = "drawn"): a socket whose first write sends a frame's magic and
    length, then stops this process (SIGSTOP) before the rest: the trainer must meet its deadline on a frame cut
    there."""

    def __init__(self, sock: socket.socket):
        self.sock, self.cut = sock, False

    def sendall(self, data) -> None:
        if not self.cut:
            self.cut = True
            self.sock.sendall(bytes(data[:8]))
            os.kill(os.getpid(), signal.SIGSTOP)
            data = data[8:]
        self.sock.sendall(data)


def _serve(sock, generator, slot, group, backend: str, device: str, name: str, say) -> int:
    """Answer the trainer's frames in order: weight syncs (their buckets by broadcast), draws, stop."""
    pieces = _buckets(slot.buffers)
    writer = sock
    if os.environ.pop(STOP_MID_ANSWER, None) == "drawn":
        writer = _StopsMidFrame(sock)
    while True:
        header, _ = _next_frame(sock)
        kind, tag = header.get("kind"), header.get("tag", 0)
        if kind == "stop":
            return 0
        if kind == "sync":
            t0 = time.time()
            try:
                for piece in pieces:
                    _broadcast(group, backend, piece, device)
            except RuntimeError as e:
                say(f"grpolab generator: {name}: a weight broadcast failed ({_first_words(e)}); exiting")
                return 1
            generator.handle(("sync", tag, header["version"], header["keep_from"]))
            send_frame(sock, {"kind": "synced", "tag": tag, "span": [t0, time.time()]})
        elif kind == "draw":
            keys = [tuple(k) for k in header["keys"]]
            draw = (header["version"], header["prompts"], keys, SamplingSettings(**header["settings"]), None)  # text
            _, _, (out, span, digest) = generator.handle(("draw", tag, *draw, header["digest"]))
            stats = [out.logprobs, out.entropy]  # an engine may give none (vLLM: no entropies)
            answer = {"kind": "drawn", "tag": tag, "span": list(span), "digest": digest}
            answer["absent"] = [i for i, t in enumerate(stats) if t is None]
            send_frame(writer, answer, [*out.batch.tensors, *(t for t in stats if t is not None)])
        else:
            raise WireError(f"a message of kind {kind!r}")


def _spec(welcome: dict, buffers: dict[str, torch.Tensor], options: WorkerOptions) -> GeneratorSpec:
    """The replica's :class:`GeneratorSpec` from the trainer's welcome: its model class (a transformers class, by
    name: nothing from the network runs as code), config (JSON), buffers and dtypes; device, threads and engine
    the worker's own."""
    import transformers

    model_class = getattr(transformers, welcome["model_class"], None)
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise WireError(f"{welcome['model_class']!r} is not a transformers model class")
    config = transformers.AutoConfig.for_model(**welcome["config"])
    if welcome.get("attention"):
        config._attn_implementation = welcome["attention"]
    param_dtype = getattr(torch, welcome["param_dtype"])
    dtype = (
        getattr(torch, welcome["dtype"]) if options.rollout_dtype == "auto" else getattr(torch, options.rollout_dtype)
    )
    vllm = None
    if options.engine == "vllm":
        vllm = VLLMSettings(2048, True, 0.3, False, fp32_head=welcome["fp32_head"])
    storage = getattr(torch, welcome["storage"]) if welcome.get("storage") and dtype != param_dtype else None
    return GeneratorSpec(
        model_class,
        config,
        buffers,
        param_dtype,
        dtype,
        welcome["eos_id"],
        welcome["pad_id"],
        options.device,
        options.threads,
        always_copy=welcome["always_copy"],
        trainable=welcome["trainable"],
        vllm=vllm,
        seed=welcome["seed"],
        fp32_head=welcome["fp32_head"],
        storage=storage,
    )


# ---------------------------------------------------------------------- the trainer's side
@dataclasses.dataclass(eq=False)
class _Worker:
    """The trainer's handle on one worker."""

    id: int
    sock: socket.socket
    about: dict
    link: Duplex | None = None
    """The connection once the worker has joined, read and written on threads of its own (:func:`_link`)."""
    group: object = None
    backend: str = "gloo"
    answers: dict = dataclasses.field(default_factory=dict)
    dropped: set = dataclasses.field(default_factory=set)
    """Tags of draws whose request was dropped (a draw ahead not asked for): their answers are stale."""
    sent: dict = dataclasses.field(default_factory=dict)
    """tag -> (what, monotonic time sent)."""
    rows: int = 0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"worker {self.id} ({self.about.get('host', '?')}, pid {self.about.get('pid', '?')})"


def _link(sock: socket.socket, timeout: float, name: str) -> Duplex:
    """A joined worker's connection on the trainer's side (:class:`grpolab.rollout.duplex.Duplex`): a reader thread
    takes each frame whole, so a worker's answer is read as it comes, also while the trainer waits in a weight
    broadcast (a worker blocked writing an answer nobody reads would never join the broadcast), and a writer sends
    the trainer's frames. The socket's ``timeout``: a frame half-read, or one the worker does not take, fails the
    connection after it."""
    sock.settimeout(timeout)

    def shutdown() -> None:
        sock.shutdown(socket.SHUT_RDWR)

    return Duplex(lambda: _next_frame(sock), lambda frame: send_frame(sock, *frame), shutdown, sock.close, name)


class _Lost(Exception):
    def __init__(self, worker: _Worker, why: str):
        super().__init__(why)
        self.worker, self.why = worker, why


def _welcome(model, dtype, spec: EngineSpec, timeout, run) -> dict:
    """What a worker needs to build its replica and engine (:func:`_spec` reads it), as JSON: the model's class
    name and config, the dtypes, the token ids, the lag, the head, vLLM's seed (``spec``'s), the timeout and the run
    id."""
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
        "always_copy": spec.lag > 0,
        "trainable": param.requires_grad,
        "fp32_head": spec.fp32_head,
        "seed": spec.seed,
        "timeout": timeout,
    }


class WorkerPool(VersionedDraws):
    """A rollout engine whose draws run on generator workers (module docstring). ``model``: the policy's model;
    ``expect``: workers to wait for before the first draw; ``listen``: HOST:PORT; ``token``: the shared secret
    (required unless ``listen`` is local); ``run``: the run id a worker may name; ``lag``: --max-staleness K;
    ``timeout``: seconds any one answer may take; ``wait``: seconds to wait for a worker when none is live."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: EngineSpec,
        *,
        expect: int = 1,
        listen: str = "127.0.0.1:29650",
        token: bytes = b"",
        run: str = "run",
        timeout: float = 900.0,
        wait: float = 60.0,
        say: Callable[[str], None] = log.warning,
    ):
        host, port = split_address(listen)
        if not is_local(host) and not token:
            raise ConfigError(
                f"--generator-listen {listen}: a non-local address needs a shared token (${TOKEN_ENV} or "
                "--generator-token-file)"
            )
        self.model, self.full_weights, self.lag = model, spec.full_weights, spec.lag
        self.timeout, self.wait, self.expect = timeout, wait, expect
        self.token, self.run, self.say, self.pad_id = token, run, say, spec.pad_id
        param = next(model.parameters())
        self.dtype = spec.dtype or param.dtype
        self.device = str(param.device)
        # the weights go in the rollout dtype, unless the sampler keeps the policy's outside its products (storage)
        self.send_dtype = param.dtype if spec.storage is not None else self.dtype
        self.syncs = 0
        self.prefetches = {"used": 0, "dropped": 0}
        self.digests: list[str] | None = None
        self.counts = {"lost": 0, "redrawn": 0, "refused": 0, "stale": 0}
        self.broadcast_s = 0.0
        self._events: list[dict] = []  # what pop_events returns: the timeline of draws, broadcasts, joins, losses
        self._events_lock = threading.Lock()  # the accepting thread adds refusals
        self._tag = 0
        self._prefetched = None
        self._live: list[_Worker] = []
        self._joining: queue.Queue[_Worker] = queue.Queue()
        self._closed = False
        served = self._served()
        self.slot = SharedWeights(served, shared=False)
        self.slot.write(served)
        self.versions = {0: {d: b.clone() for d, b in self.slot.buffers.items()}}
        self._welcome = _welcome(model, self.dtype, spec, timeout, run)
        self._welcome["layout"] = _layout_json(self.slot.layout)
        self._buffers = {n: b.detach().cpu() for n, b in base_model(model).named_buffers()}
        self._listen(host, port)
        say(f"generators: listening on {self.address} for {expect} worker(s) (run id {run!r})")
        self._admit(expect, START_TIMEOUT + wait)
        if len(self._live) < expect:
            say(f"generators: {len(self._live)} of {expect} workers joined in {START_TIMEOUT + wait:g} s; going on")

    # ------------------------------------------------------------------ joining
    def _listen(self, host: str, port: int) -> None:
        """The weight broadcasts' rendezvous (a TCPStore on a free port), the listening socket, the accepting
        thread. A backend the workers' groups cannot have ends the run here, not each worker's start."""
        import torch.distributed as dist

        try:
            forced_backend()
        except ValueError as e:
            raise ConfigError(f"--generators: {e}") from None
        span = datetime.timedelta(seconds=START_TIMEOUT)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=span)
        self._welcome["store_port"] = self.store.port  # the worker reaches it at the host it connected to
        self._server = socket.create_server((host, port), backlog=16)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._ids = itertools.count(1)
        self._accepting = threading.Thread(target=self._accept, name="grpolab-generators-accept", daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock, peer), daemon=True).start()

    def _greet(self, sock: socket.socket, peer) -> None:
        """A new connection: the handshake, the welcome, the replica's build, the pair group. Refused with one log
        line if anything is off; never on the trainer's thread, so a stranger cannot block it."""
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            sent = challenge(self.run)
            send_frame(sock, sent)
            hello, _ = recv_frame(sock, SMALL)
            about = check_answer(sent, hello, self.token)
        except (WireError, ConnectionError, OSError, ValueError) as e:
            self.counts["refused"] += 1
            self._event("refused", at=time.time(), peer=f"{peer[0]}:{peer[1]}")
            self.say(f"generators: refused a connection from {peer[0]}:{peer[1]}: {e}")
            with contextlib.suppress(OSError):
                send_frame(sock, {"kind": "refused", "why": str(e)})
            sock.close()
            return
        worker = _Worker(next(self._ids), sock, about)
        worker.backend = _backend(self.device, str(about.get("device", "cpu")))
        try:
            names = sorted(self._buffers)
            welcome = dict(
                self._welcome, id=worker.id, group=f"worker{worker.id}", buffers=names, backend=worker.backend
            )
            send_frame(sock, welcome, [self._buffers[n] for n in names])
            sock.settimeout(START_TIMEOUT)
            ready, _ = recv_frame(sock, SMALL)
            if ready.get("kind") != "ready":
                raise WireError(f"answered {ready.get('kind')!r}, not ready")
            store = self.store
            if self._closed or store is None:
                raise WireError("the run has ended")
            worker.group = _pair_group(store, f"worker{worker.id}", 0, worker.backend, self.timeout)
            _keepalive(sock)
            worker.link = _link(sock, self.timeout, f"grpolab-worker{worker.id}")
        except Exception as e:  # anything that keeps it from joining is one line; the run goes on without it
            self.say(f"generators: {worker.name} failed to start: {type(e).__name__}: {e}")
            sock.close()
            return
        self._joining.put(worker)
        if self._closed:  # the run ended while it joined: close() may have emptied the queue before this put
            worker.link.close()

    def _admit(self, want: int = 0, within: float = 0.0) -> None:
        """Take in the workers that have joined (each gets the versions a draw may still ask for), waiting up to
        ``within`` seconds until at least ``want`` are live."""
        deadline = time.monotonic() + within
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic()) if len(self._live) < want else 0
                worker = self._joining.get(timeout=min(timeout, 1.0)) if timeout else self._joining.get_nowait()
            except queue.Empty:
                if len(self._live) >= want or time.monotonic() > deadline:
                    return
                continue
            try:
                for version in sorted(self.versions):
                    self._send_weights(worker, version)
                self._live.append(worker)
                about = worker.about
                self._event("joined", worker.id, at=time.time(), engine=about.get("engine"), device=about.get("device"))
                self.say(f"generators: {worker.name} joined ({about.get('engine')}, {about.get('device')})")
                other = other_kernels(about, self.device, self.dtype)
                if other:
                    self.say(
                        f"generators: warning: {worker.name} samples {other}: its log-probs are not the trainer's "
                        "(--engine-correction weighs the mismatch; engine/* measures it)"
                    )
            except _Lost as e:
                self._drop(e.worker, e.why)

    # ------------------------------------------------------------------ the engine's interface
    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        text_only(media)
        request = (self._draw_version(), prompts, [tuple(k) for k in keys], settings)
        if self._prefetched is not None and self._prefetched[0] == request:
            parts = self._prefetched[1]
            self._prefetched = None
            self.prefetches["used"] += 1
        else:
            parts = self._send_draws(request)
        return self._collect(request, parts)

    def prefetch(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> bool:
        text_only(media)
        version = self._ahead_version()
        if version is None:
            return False
        self._drop_prefetch()
        request = (version, prompts, [tuple(k) for k in keys], settings)
        self._prefetched = (request, self._send_draws(request))
        return True

    def weights_changed(self) -> None:
        """Broadcast the policy's new weights to every live worker (after the optimizer step)."""
        self._admit()  # a worker that joined gets the versions held so far, then this one with the others
        served = self._served()
        self.slot.write(served)
        self.syncs += 1
        self.versions[self.syncs] = {d: b.clone() for d, b in self.slot.buffers.items()}
        keep_from = max(0, self.syncs - self.lag)
        for v in [v for v in self.versions if v < keep_from]:
            del self.versions[v]
        t0 = time.perf_counter()
        for worker in list(self._live):
            try:
                self._send_weights(worker, self.syncs)
            except _Lost as e:
                self._drop(e.worker, e.why)
        self.broadcast_s += time.perf_counter() - t0

    def pop_metrics(self) -> dict[str, float]:
        """``generators/*`` since the last call: live workers, rows drawn by each (``rows_worker<id>``), the
        busiest worker's drawing seconds (``draw_s``, its own clock), the weight broadcasts' seconds; and the
        run's counts so far: workers lost, rows redrawn, connections refused, stale answers (to draws ahead whose
        request was dropped: read and let go)."""
        out = {
            "generators/workers": float(len(self._live)),
            "generators/broadcast_s": self.broadcast_s,
            "generators/lost": float(self.counts["lost"]),
            "generators/redrawn": float(self.counts["redrawn"]),
            "generators/refused": float(self.counts["refused"]),
            "generators/stale": float(self.counts["stale"]),
        }
        out["generators/draw_s"] = max((w.seconds for w in self._live), default=0.0)
        for w in self._live:
            out[f"generators/rows_worker{w.id}"] = float(w.rows)
            w.rows, w.seconds = 0, 0.0
        self.broadcast_s = 0.0
        return out

    def pop_events(self) -> list[dict]:
        """The timeline since the last call, one dict per event (``generators.jsonl``; the report draws it):
        ``draw`` (a worker's part: ``start``, ``end`` on the worker's wall clock, ``rows``, ``version``),
        ``weights`` (one worker's broadcast of a version: ``start``, ``end``), ``joined``, ``lost`` (``at``,
        ``why``), ``refused`` (``at``, ``peer``)."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def _event(self, kind: str, worker: int | None = None, **fields) -> None:
        with self._events_lock:
            self._events.append({"kind": kind, **({"worker": worker} if worker is not None else {}), **fields})

    # ------------------------------------------------------------------ checkpoints
    def lag_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        held = max(0, self.syncs - self.lag)
        pending = [(v, self._named(v)) for v in range(held + 1, self.syncs + 1)]
        return lag_state(held, self.syncs, self._named(held), pending)

    def restore_lag(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        held, pending = restored_lag(counts, tensors)
        self.versions = {}
        for version, named in [(counts["version"], held), *pending]:
            self.slot.write(named)
            self.versions[version] = {d: b.clone() for d, b in self.slot.buffers.items()}
        self.syncs = counts["syncs"]
        for worker in list(self._live):
            try:
                for version in sorted(self.versions):
                    self._send_weights(worker, version)
            except _Lost as e:
                self._drop(e.worker, e.why)

    def _named(self, version: int) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.slot.views(self.versions[version]).items()}

    # ------------------------------------------------------------------ the wire
    def _served(self) -> dict[str, torch.Tensor]:
        cast: dict[tuple, torch.Tensor] = {}  # a tied weight (the same memory under two names) stays one tensor
        with torch.no_grad(), self.full_weights():
            out = {}
            for n, t in served_weights(self.model):
                key = (t.data_ptr(), t.shape, t.dtype)
                if key not in cast:
                    cast[key] = t.detach().to("cpu", self.send_dtype if t.is_floating_point() else t.dtype)
                out[n] = cast[key]
            return out

    def _drop_prefetch(self) -> None:
        if self._prefetched is not None:
            for worker, _, tag in self._prefetched[1]:
                worker.dropped.add(tag)
            self.prefetches["dropped"] += 1
            self._prefetched = None

    def _send(self, worker: _Worker, header: dict) -> int:
        """Queue ``header`` for ``worker`` with the next tag (its sequence number: the answer carries it); the link's
        writer sends it. Returns the tag."""
        if worker.link.failed:
            raise _Lost(worker, f"its connection failed ({worker.link.error})")
        self._tag += 1
        worker.link.send((dict(header, tag=self._tag), ()))
        worker.sent[self._tag] = (header["kind"], time.monotonic())
        return self._tag

    def _send_weights(self, worker: _Worker, version: int) -> None:
        keep_from = min(self.versions)
        start = time.time()
        self._send(worker, {"kind": "sync", "version": version, "keep_from": keep_from})  # its answer: read, let go
        try:
            for piece in _buckets(self.versions[version]):
                _broadcast(worker.group, worker.backend, piece, self.device)
        except RuntimeError as e:
            raise _Lost(worker, f"the weight broadcast failed ({_first_words(e)})") from None
        self._event("weights", worker.id, start=start, end=time.time(), version=version)

    def _chunks(self, n: int) -> list[list[int]]:
        """Rows 0..n-1 in ``expect`` (--generators N) contiguous parts, sizes as even as they go, whatever number
        of workers is live: each part is drawn as one batch by some worker, so the rows, and every bit of what is
        computed for them, do not depend on which workers are live, lost or late."""
        k = max(1, min(self.expect, n))
        bounds = [round(i * n / k) for i in range(k + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]

    def _ensure_live(self) -> None:
        self._admit()
        if not self._live:
            self.say(f"generators: no worker is live; waiting {self.wait:g} s for one to join")
            self._admit(1, self.wait)
        if not self._live:
            raise GeneratorError(
                f"no generator worker left (lost {self.counts['lost']}), and none joined in {self.wait:g} s "
                f"(--generator-wait); the trainer listens on {self.address}"
            )

    def _send_draw(self, worker: _Worker, request: tuple, rows: list[int]) -> int:
        version, prompts, keys, settings = request
        # every part padded as the whole call would be: each row computed as the trainer's own engine computes it
        settings = dataclasses.replace(settings, prompt_width=max(settings.prompt_width, *map(len, prompts)))
        return self._send(worker, {
            "kind": "draw",
            "version": version,
            "prompts": [prompts[i] for i in rows],
            "keys": [list(keys[i]) for i in rows],
            "settings": _settings_json(settings),
            "digest": self.digests is not None,
        })  # fmt: skip

    def _send_draws(self, request: tuple) -> list[tuple[_Worker, list[int], int]]:
        self._ensure_live()
        return [self._assign(request, rows, i) for i, rows in enumerate(self._chunks(len(request[1])))]

    def _assign(self, request: tuple, rows: list[int], turn: int) -> tuple[_Worker, list[int], int]:
        """Send ``rows`` to the ``turn``-th live worker (in the order they joined, round); a worker whose
        connection fails is dropped and the next one tried."""
        while True:
            self._ensure_live()
            worker = self._live[turn % len(self._live)]
            try:
                return worker, rows, self._send_draw(worker, request, rows)
            except _Lost as e:
                self._drop(e.worker, e.why)

    def _collect(self, request: tuple, parts: list[tuple[_Worker, list[int], int]]) -> Sampled:
        got: dict[int, tuple[list[int], dict, list[torch.Tensor]]] = {}
        pending = list(enumerate(parts))
        while pending:
            still = []
            for i, (worker, rows, tag) in pending:
                try:
                    answer = self._wait(worker, tag)
                except _Lost as e:
                    self._drop(e.worker, e.why)
                    self.counts["redrawn"] += len(rows)
                    still.append((i, self._assign(request, rows, i)))
                    continue
                if answer is None:
                    still.append((i, (worker, rows, tag)))
                    continue
                header, tensors = answer
                stats = iter(tensors[4:])
                tensors = tensors[:4] + [None if j in header.get("absent", ()) else next(stats) for j in (0, 1)]
                got[i] = (rows, header, tensors)
                worker.rows += len(rows)
                worker.seconds += header["span"][1] - header["span"][0]
                start, end = header["span"]  # the worker's clock (wall time: one machine's, or NTP's)
                self._event("draw", worker.id, start=start, end=end, rows=len(rows), version=request[0])
            pending = still
        return self._merge(len(request[1]), [got[i] for i in sorted(got)])

    def _wait(self, worker: _Worker, tag: int):
        """Worker ``worker``'s answer to ``tag`` if it has come within a short wait (None if not yet); raises
        :class:`_Lost` for a worker that closed, sent garbage or is past the timeout on its oldest request."""
        if tag in worker.answers:
            return worker.answers.pop(tag)
        if worker not in self._live:
            raise _Lost(worker, "it was dropped")
        frame = worker.link.receive(timeout=0.05)
        if frame is CLOSED:
            raise _Lost(worker, f"its connection failed ({worker.link.error})")
        if frame is not None:
            header, tensors = frame
            got = header.get("tag")
            asked = worker.sent.pop(got, None)
            if asked is None:
                raise _Lost(worker, f"it answered request {got!r}, which it was not sent or had answered")
            kind, _ = asked
            if got in worker.dropped:
                worker.dropped.discard(got)
                self.counts["stale"] += 1
            elif kind != "sync":  # a sync's answer only says when: read and let go
                worker.answers[got] = (header, tensors)
            return worker.answers.pop(tag, None)
        oldest = min((t for _, t in worker.sent.values()), default=None)
        if oldest is not None and time.monotonic() - oldest > self.timeout:
            raise _Lost(worker, f"no answer in {self.timeout:g} s (--generator-timeout)")
        return None

    def _merge(self, n: int, parts: list[tuple[list[int], dict, list[torch.Tensor]]]) -> Sampled:
        """The workers' rows in the call's order, padded as one draw pads them (prompts left, completions right)."""
        P = max(t[0].shape[1] for _, _, t in parts)
        T = max(t[2].shape[1] for _, _, t in parts)
        first = parts[0][2]
        out = [
            first[0].new_full((n, P), self.pad_id),
            first[1].new_zeros((n, P)),
            first[2].new_full((n, T), self.pad_id),
            first[3].new_zeros((n, T)),
            *(None if first[j] is None else first[j].new_zeros((n, T)) for j in (4, 5)),  # absent: vLLM's entropy
        ]
        for rows, header, t in parts:
            idx = torch.tensor(rows)
            p, c = t[0].shape[1], t[2].shape[1]
            out[0][idx, P - p :] = t[0]
            out[1][idx, P - p :] = t[1]
            for j in (2, 3, 4, 5):
                if out[j] is not None:
                    out[j][idx, :c] = t[j]
            if self.digests is not None:
                self.digests.append(header.get("digest"))
        from grpolab.common.batch import Batch

        return Sampled(Batch(*out[:4]), out[4], out[5])

    def _drop(self, worker: _Worker, why: str) -> None:
        if worker in self._live:
            self._live.remove(worker)
            self.counts["lost"] += 1
            self._event("lost", worker.id, at=time.time(), why=why)
            self.say(f"generators: lost {worker.name}: {why}; {len(self._live)} left")
        worker.link.close()

    def close(self) -> None:
        """Tell every worker to stop, and stop listening."""
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accepting thread (close() alone does not, on Linux)
            self._server.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._server.close()
        self._accepting.join(timeout=5)
        while not self._joining.empty():
            self._joining.get_nowait().link.close()
        for worker in self._live:
            with contextlib.suppress(_Lost):
                self._send(worker, {"kind": "stop"})
            worker.link.close(flush=5.0)
            worker.group = None
        self._live = []
        self.store = None  # the broadcasts' rendezvous goes with the pool


def other_kernels(about: dict, device: str, dtype: torch.dtype) -> str:
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


def build_worker_pool(
    engine,
    seed: int,
    policy,
    full_weights=contextlib.nullcontext,
    fp32_head: bool = False,
    autocast: bool = False,
    *,
    run: str = "run",
    rank: int = 0,
    say: Callable[[str], None] = log.warning,
) -> WorkerPool:
    """The pool of generator workers the run's ``engine`` options ask for (--generators, --generator-listen,
    --generator-wait, --generator-timeout, --generator-token-file, --max-staleness, --rollout-dtype). Rank ``rank``
    of a torchrun job listens on the port plus its rank, and its workers draw its share of the rollouts."""
    host, port = split_address(engine.generator_listen)
    return WorkerPool(
        policy.model,
        EngineSpec.of(engine, seed, policy, full_weights, fp32_head, autocast),
        expect=engine.generators,
        listen=f"{host}:{port + rank if port else 0}",
        token=read_token(engine.generator_token_file),
        run=run,
        timeout=engine.generator_timeout,
        wait=engine.generator_wait,
        say=say,
    )
