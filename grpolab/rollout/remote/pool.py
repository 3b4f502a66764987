"""The trainer's side of the generator workers (``--generators N``): :class:`WorkerPool` listens, admits workers,
broadcasts each weight version, splits every draw into contiguous parts among the live workers and redraws a lost
worker's parts from the same keys."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import queue
import socket
import threading
import time
from collections.abc import Callable

import torch

from grpolab.common.distributed import forced_backend
from grpolab.common.errors import ConfigError, GeneratorError
from grpolab.rollout.duplex import CLOSED, Duplex
from grpolab.rollout.generator import VersionedDraws
from grpolab.rollout.remote.common import (
    HANDSHAKE_TIMEOUT,
    SMALL,
    TOKEN_ENV,
    broadcast_piece,
    first_words,
    is_local,
    keepalive,
    layout_json,
    log,
    pair_group,
    read_token,
    settings_json,
    split_address,
    transport_backend,
    weight_buckets,
)
from grpolab.rollout.remote.wire import WireError, challenge, check_answer, recv_frame, send_frame
from grpolab.rollout.remote.worker import next_frame
from grpolab.rollout.replica import START_TIMEOUT, SharedWeights
from grpolab.rollout.sampler import Sampled, SamplingSettings
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import base_model, lag_state, restored_lag, served_weights
from grpolab.vision.media import text_only


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

    return Duplex(lambda: next_frame(sock), lambda frame: send_frame(sock, *frame), shutdown, sock.close, name)


class _Lost(Exception):
    def __init__(self, worker: _Worker, why: str):
        super().__init__(why)
        self.worker, self.why = worker, why


def _welcome(model, dtype, spec: EngineSpec, timeout, run) -> dict:
    """What a worker needs to build its replica and engine (:func:`worker_spec` reads it), as JSON: the model's class
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
        self._welcome["layout"] = layout_json(self.slot.layout)
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
        worker.backend = transport_backend(self.device, str(about.get("device", "cpu")))
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
            worker.group = pair_group(store, f"worker{worker.id}", 0, worker.backend, self.timeout)
            keepalive(sock)
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
            for piece in weight_buckets(self.versions[version]):
                broadcast_piece(worker.group, worker.backend, piece, self.device)
        except RuntimeError as e:
            raise _Lost(worker, f"the weight broadcast failed ({first_words(e)})") from None
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
            "settings": settings_json(settings),
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
