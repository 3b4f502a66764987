"""A generator process: a rollout engine in a process of its own, drawing while the trainer updates.

:class:`ProcessEngine` is a rollout engine (``grpolab.rollout.engine.RolloutEngine``) whose draws run in a child
process. The child holds a replica of the policy's model and an :class:`grpolab.rollout.engine.HFEngine` over it (or
a :class:`grpolab.rollout.vllm_engine.VLLMEngine`, vLLM in the child's process, each version pushed into it);
the trainer keeps everything else (the collector, the rewards, the environments, the update).

Weights: after each optimizer step the trainer writes the served weights (``grpolab.rollout.weights.
served_weights``) into one shared-memory buffer per dtype, and the child copies them into a version of its own,
numbered by the sync (0: the starting weights). Every draw names the version it must use:
``max(0, syncs - K)`` under ``--max-staleness K`` (the current ones inside :meth:`ProcessEngine.current_weights`),
so what the child draws depends only on the prompts, the keys and that version, never on timing. The child keeps the
versions a later draw may still ask for (the newest K + 1).

Overlap: :meth:`ProcessEngine.prefetch` asks, before the update of step t, for the rollouts of step t + 1; with
K >= 1 their weights (those after step t - K) already exist. When the collector then asks for exactly that draw (the
same prompts, keys, settings and version) it gets the prefetched rows; any other request (a held-out evaluation, a
changed group size, a later round) is drawn afresh, and the rows drawn ahead wait for their own request or are
dropped when the next draw ahead replaces them. With K = 0 nothing can be prefetched and the process draws what the trainer's own engine
would, at the same threads, bit for bit.

Messages run in order over one pipe, so a draw asked before a weight sync uses the weights it names even while the
trainer writes the next ones: the trainer writes the buffer only after the child has acknowledged the previous sync.

Faults: every wait is bounded (``--generator-timeout``) and checks that the child lives; a child that died, hung or
raised becomes one :class:`grpolab.common.errors.GeneratorError` naming what it was doing. The child ignores Ctrl-C
(the trainer finishes its step, saves and stops it) and dies with its parent (``PR_SET_PDEATHSIG``, and a check of
its parent between messages), so it never outlives the run.

Written here rather than taken from a library: the exact version bookkeeping is what makes an asynchronous run
reproducible, and none of torch.multiprocessing's pools or queues keeps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp

from grpolab.common.errors import GeneratorError
from grpolab.config.rollout import EngineSection
from grpolab.rollout.duplex import CLOSED, Duplex
from grpolab.rollout.sampler import Sampled, SamplingSettings
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import base_model, lag_state, restored_lag, served_weights, skeleton, snapshot

__all__ = ["GeneratorSpec", "ProcessEngine", "VersionedDraws", "build_process_engine", "weights_digest"]

START_TIMEOUT = 300.0
"""Seconds the child may take to start (import torch and transformers, build its replica) when --generator-timeout
is shorter."""


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """What the child needs to build its engine: the policy's model class, config and buffers (its weights come
    through the shared buffers), the dtypes, the token ids, the device and threads."""

    model_class: type
    config: object
    buffers: dict[str, torch.Tensor]
    param_dtype: torch.dtype
    dtype: torch.dtype
    """The dtype the engine samples in (--rollout-dtype resolved)."""
    eos_id: int
    pad_id: int
    device: str
    threads: int
    always_copy: bool
    """Sample from a copy of the weights even where the replica's own would do, as the trainer's engine does under
    a lag (so both run the same kernels)."""
    trainable: bool
    """Whether the policy's parameters require gradients: the replica's then do too, because some of torch's CPU
    kernels differ in their last bits with it, and the replica must draw what the policy's own weights draw."""
    vllm: object = None
    """vLLM's start settings (:class:`grpolab.rollout.spec.VLLMSettings`) when the generator runs vLLM on the
    replica (each version pushed into it as the in-process engine pushes the trainer's); None: grpolab's sampler."""
    seed: int = 0
    """vLLM's own seed (the run's)."""
    fp32_head: bool = False
    """The LM head's product in fp32 when the engine samples in bf16 or fp16 (--fp32-head)."""
    storage: torch.dtype | None = None
    """The copy's dtype outside its products (a sampler that computes as a mixed-precision trainer's autocast)."""


class SharedWeights:
    """Served weights in shared memory: one flat buffer per dtype, each weight a view into it (a tied weight is one
    view under its several names)."""

    def __init__(self, served: dict[str, torch.Tensor], shared: bool = True):
        layout: dict[str, tuple[torch.dtype, int, torch.Size]] = {}
        sizes: dict[torch.dtype, int] = {}
        first: dict[int, str] = {}
        for name, t in served.items():
            if id(t) in first:
                layout[name] = layout[first[id(t)]]
                continue
            first[id(t)] = name
            layout[name] = (t.dtype, sizes.get(t.dtype, 0), t.shape)
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
        self.layout = layout
        self.buffers = {str(d): torch.empty(n, dtype=d) for d, n in sizes.items()}
        if shared:
            self.buffers = {d: b.share_memory_() for d, b in self.buffers.items()}
        self._views = self.views()

    @classmethod
    def of_layout(cls, layout: dict[str, tuple[torch.dtype, int, torch.Size]]) -> SharedWeights:
        """Buffers of this process (not shared) for ``layout`` (another process's :attr:`layout`), zero-filled."""
        self = cls.__new__(cls)
        self.layout = layout
        sizes: dict[torch.dtype, int] = {}
        for dtype, start, shape in layout.values():
            sizes[dtype] = max(sizes.get(dtype, 0), start + shape.numel())
        self.buffers = {str(d): torch.zeros(n, dtype=d) for d, n in sizes.items()}
        self._views = self.views()
        return self

    def views(self, buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Each weight's view into ``buffers`` (default: this process's)."""
        buffers = self.buffers if buffers is None else buffers
        return {
            name: buffers[str(dtype)][start : start + shape.numel()].view(shape)
            for name, (dtype, start, shape) in self.layout.items()
        }

    def write(self, served: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, view in self._views.items():
                view.copy_(served[name])


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """A checksum of weights by name (what a test compares the generator's weights by)."""
    h = hashlib.sha256()
    for name, t in sorted(weights.items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------- the child
class ReplicaGenerator:
    """The child's side: a replica of the policy, the engine over it and the weight versions it was sent."""

    def __init__(self, spec: GeneratorSpec, shared: SharedWeights, buffers: dict[str, torch.Tensor]):
        from grpolab.common.rng import set_threads
        from grpolab.rollout.engine import HFEngine

        set_threads(spec.threads)
        self.spec = spec
        self.slot = shared.views(buffers)
        self.replica = skeleton(spec.model_class, spec.config, spec.buffers, spec.param_dtype, spec.device, False)
        self.replica.requires_grad_(spec.trainable)
        self.params = dict(self.replica.named_parameters(remove_duplicate=False))
        self.versions = {0: snapshot(self.slot)}
        self._load(0)
        engine = EngineSpec(spec.eos_id, spec.pad_id, spec.dtype, spec.storage, spec.fp32_head, seed=spec.seed,
                            vllm=spec.vllm)  # fmt: skip
        if spec.vllm is not None:
            from grpolab.rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(self.replica, engine)
        else:
            self.engine = HFEngine(self.replica, engine, always_copy=spec.always_copy)
        self.loaded = 0

    def _load(self, version: int) -> None:
        with torch.no_grad():
            for name, t in self.versions[version].items():
                if name in self.params:
                    self.params[name].copy_(t)

    def use(self, version: int) -> None:
        """Draw with the weights of sync ``version`` from now on."""
        if version == self.loaded:
            return
        if version not in self.versions:
            raise KeyError(f"weights of sync {version} were asked for; held: {sorted(self.versions)}")
        self._load(version)
        self.engine.weights_changed()
        self.loaded = version

    def handle(self, message: tuple) -> tuple:
        kind, tag = message[0], message[1]
        if kind == "draw":
            version, prompts, keys, settings, media, digest = message[2:]
            self.use(version)
            t0 = time.time()
            out = self.engine.generate(prompts, keys, settings, media)
            # The trainer has the rows' images: the answer leaves them out. Both ends write whole messages into one
            # pipe, so an answer that outgrew its buffer while the trainer sends the next (large) draw would deadlock.
            out = out._replace(batch=out.batch._replace(media=None))
            held = weights_digest(self.versions[version]) if digest else None
            return "drawn", tag, (out, (t0, time.time()), held)
        if kind == "sync":
            version, keep_from = message[2:]
            t0 = time.time()
            self.versions[version] = snapshot(self.slot)
            for v in [v for v in self.versions if v < keep_from]:  # never asked for again (the loaded: in place)
                del self.versions[v]
            return "synced", tag, (t0, time.time())
        if kind == "state":
            return "state", tag, dict(self.versions)
        if kind == "restore":
            self.versions = dict(message[2])
            self.loaded = -1
            return "restored", tag, None
        raise ValueError(f"unknown message {kind!r}")


STOP_MID_ANSWER = "GRPOLAB_TEST_STOP_MID_ANSWER"
"""Tests only: a generator process whose environment names a kind of answer here ("drawn", "synced", ...) writes the
length of its first such answer, stops itself with SIGSTOP, and writes the rest only if continued: the trainer must
meet its deadline on a message cut between its length and its payload."""


def _put(conn, message) -> None:
    """Send ``message`` down the pipe as plain pickle bytes: tensors go by value. (torch.multiprocessing's pickler
    would send them as file descriptors, which the receiver fetches from the sender's resource-sharer thread with a
    read that has no timeout: a stopped, hung sender would block the receiver for ever.)"""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if os.environ.get(STOP_MID_ANSWER) == message[0]:
        os.environ.pop(STOP_MID_ANSWER)
        # multiprocessing's framing (a 4-byte big-endian length, then the bytes), written in two parts by hand
        os.write(conn.fileno(), len(data).to_bytes(4, "big", signed=True))
        os.kill(os.getpid(), signal.SIGSTOP)
        with os.fdopen(os.dup(conn.fileno()), "wb") as raw:
            raw.write(data)
        return
    conn.send_bytes(data)


def _get(conn):
    """A message :func:`_put` sent (from our own process only: the pipe is the trainer's and its child's)."""
    return pickle.loads(conn.recv_bytes())


def _pipe(conn) -> Duplex:
    """The trainer's end of the pipe to its generator process, read and written on threads of its own
    (:class:`grpolab.rollout.duplex.Duplex`: no wait on the child is without a deadline). Requests are pickled by
    :meth:`ProcessEngine._send` before they are queued, so that an object that cannot be sent fails there."""

    def shutdown() -> None:
        with socket.socket(fileno=os.dup(conn.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)

    return Duplex(lambda: _get(conn), conn.send_bytes, shutdown, conn.close, "grpolab-generator")


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphan after a SIGKILL of the trainer)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def serve(spec: GeneratorSpec, shared: SharedWeights, buffers: dict, conn, parent: int) -> None:
    """The child's loop: build the engine, then answer the trainer's messages in order until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it ends its step, saves and stops us
    _die_with_parent()
    try:
        generator = ReplicaGenerator(spec, shared, buffers)
        weights = getattr(generator.engine, "weights", None)
        _put(conn, ("ready", 0, getattr(weights, "note", None)))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    return  # the trainer is gone
                continue
            message = _get(conn)
            if message[0] == "stop":
                return
            _put(conn, generator.handle(message))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer closed the pipe
    except BaseException:
        with contextlib.suppress(Exception):
            _put(conn, ("error", -1, traceback.format_exc()))


# ---------------------------------------------------------------------- the trainer's side
def _start_child(spec: GeneratorSpec, shared: SharedWeights):
    """The generator process serving ``spec`` over ``shared``, started (spawned: no state of the trainer's comes
    along but what it is given), and the trainer's end of its pipe."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(
        target=serve, args=(spec, shared, shared.buffers, child, os.getpid()), name="grpolab-generator", daemon=True
    )
    process.start()
    child.close()
    return conn, process


def _request_key(request: tuple) -> tuple:
    """A draw request as the draw ahead is matched against it: rows' images by what they hold (a draw ahead encoded
    its own bundles of the same records, other objects of the same pixels)."""
    *head, media = request
    return (*head, None if media is None else tuple(None if m is None else m.key() for m in media))


class VersionedDraws:
    """Which weight version a draw names, for an engine that draws elsewhere (:class:`ProcessEngine`, and
    :class:`grpolab.rollout.workers.WorkerPool`): ``syncs`` weight syncs so far, ``lag`` = --max-staleness K. A
    step draws with version ``max(0, syncs - K)``, a held-out evaluation (inside :meth:`current_weights`) with the
    newest."""

    syncs: int = 0
    lag: int = 0
    _current: bool = False

    @contextlib.contextmanager
    def current_weights(self) -> Iterator[None]:
        """Inside the block, draw with the policy's current weights (a held-out evaluation)."""
        self._current = True
        try:
            yield
        finally:
            self._current = False

    def weights_version(self) -> int | None:
        """The sync whose weights a step draws with now (0: the starting ones); None without a lag."""
        return max(0, self.syncs - self.lag) if self.lag else None

    def _draw_version(self) -> int:
        return self.syncs if self._current else max(0, self.syncs - self.lag)

    def _ahead_version(self) -> int | None:
        """The version the next step will draw with, if it exists already (K >= 1); None at K = 0 (it is the
        update's result)."""
        version = max(0, self.syncs + 1 - self.lag)
        return version if version <= self.syncs else None


class ProcessEngine(VersionedDraws):
    """A rollout engine drawing in a generator process (module docstring). ``model``: the policy's model (its
    weights are pushed at each :meth:`weights_changed`); ``lag``: --max-staleness K; ``threads``: the child's torch
    threads; ``timeout``: seconds any one answer may take."""

    def __init__(self, model: torch.nn.Module, spec: EngineSpec, *, threads: int = 1, timeout: float = 900.0):
        self.model, self.full_weights, self.lag, self.timeout = model, spec.full_weights, spec.lag, timeout
        self.syncs = 0
        self.spans: list[tuple[str, float, float]] = []
        """What the child did and when (wall-clock seconds): ("generate" | "sync", start, end)."""
        self.prefetches = {"used": 0, "dropped": 0}
        """Draws started ahead and then asked for, and those dropped because the request differed."""
        self.digests: list[str] | None = None
        """Set to a list, and each draw appends the checksum of the weights it was drawn with (tests)."""
        self.stale = 0
        """Answers read and let go: draws ahead whose request was dropped (each request and answer carries its tag)."""
        self._answers: dict[int, object] = {}
        self._dropped: set[int] = set()
        self._tag = 0
        self._sync_tag: int | None = None
        self._prefetched: tuple[tuple, int] | None = None
        self._current = False
        base = base_model(model)
        param = next(model.parameters())
        served = self._served()
        self.shared = SharedWeights(served)
        self.shared.write(served)
        spec = GeneratorSpec(
            type(base),
            base.config,
            {n: b.detach().cpu() for n, b in base.named_buffers()},
            param.dtype,
            spec.dtype or param.dtype,
            spec.eos_id,
            spec.pad_id,
            str(param.device),
            threads,
            always_copy=spec.lag > 0,
            trainable=param.requires_grad,
            vllm=spec.vllm,
            seed=spec.seed,
            fp32_head=spec.fp32_head,
            storage=spec.storage,
        )
        conn, self.process = _start_child(spec, self.shared)
        self._pipe = _pipe(conn)
        self.note = self._answer(0, "starting", max(self.timeout, START_TIMEOUT))
        """Why the generator's copy has no fused decoder (None when it has one, or samples the replica)."""

    # ------------------------------------------------------------------ the engine's interface
    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        request = (self._draw_version(), prompts, [tuple(k) for k in keys], settings, media)
        if self._prefetched is not None and self._prefetched[0] == _request_key(request):
            tag = self._prefetched[1]
            self._prefetched = None
            self.prefetches["used"] += 1
        else:  # drawn afresh; a draw ahead stays for the request it was made for (an evaluation comes between)
            tag = self._send("draw", *request, self.digests is not None)
        out, span, digest = self._answer(tag, f"drawing {len(prompts)} rollouts")
        self.spans.append(("generate", *span))
        if self.digests is not None:
            self.digests.append(digest)
        return out

    def prefetch(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> bool:
        """Start drawing the next step's rollouts now, with the weights that step will use; False when they do not
        exist yet (K = 0: they are the update's result). Rows with images are sent with their bundles."""
        version = self._ahead_version()
        if version is None:
            return False
        self._drop_prefetch()
        request = (version, prompts, [tuple(k) for k in keys], settings, media)
        self._prefetched = (_request_key(request), self._send("draw", *request, self.digests is not None))
        return True

    def weights_changed(self) -> None:
        """Push the policy's weights: written into the shared buffers once the child has taken the previous ones."""
        if self._sync_tag is not None:
            self.spans.append(("sync", *self._answer(self._sync_tag, f"taking the weights of sync {self.syncs}")))
        self.shared.write(self._served())
        self.syncs += 1
        keep_from = max(0, self.syncs - self.lag)
        self._sync_tag = self._send("sync", self.syncs, keep_from)

    # ------------------------------------------------------------------ checkpoints
    def lag_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a checkpoint keeps of the weights in flight, in the form of
        :meth:`grpolab.rollout.weights.SamplerWeights.lag_state` (so either engine resumes the other's)."""
        held = max(0, self.syncs - self.lag)
        versions = self._answer(self._send("state"), "handing over the weights in flight")
        pending = [(v, versions[v]) for v in range(held + 1, self.syncs + 1)]
        return lag_state(held, self.syncs, versions[held], pending)

    def restore_lag(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`lag_state`'s weights: the child draws with them as the uninterrupted run would."""
        held, pending = restored_lag(counts, tensors)
        versions = {counts["version"]: held, **dict(pending)}
        self._answer(self._send("restore", versions), "taking the checkpoint's weights in flight")
        self.syncs = counts["syncs"]

    # ------------------------------------------------------------------ the pipe
    def _served(self) -> dict[str, torch.Tensor]:
        with torch.no_grad(), self.full_weights():
            return {n: t.cpu() for n, t in served_weights(self.model)}

    def _drop_prefetch(self) -> None:
        if self._prefetched is not None:
            self._dropped.add(self._prefetched[1])
            self.prefetches["dropped"] += 1
            self._prefetched = None

    def _send(self, kind: str, *payload) -> int:
        """Queue request ``kind`` for the child (the pipe's writer sends it; :meth:`_answer` waits for the answer
        with its deadline); returns its tag."""
        if self._pipe.failed or not self.process.is_alive():
            what = {"draw": "a draw", "sync": "new weights", "state": "a request for its weights"}.get(kind, kind)
            raise self._failure(f"being sent {what}")
        self._tag += 1
        self._pipe.send(pickle.dumps((kind, self._tag, *payload), protocol=pickle.HIGHEST_PROTOCOL))
        return self._tag

    def _answer(self, tag: int, doing: str, timeout: float | None = None):
        """The child's answer to request ``tag``, reading (and keeping) others on the way; a child that died, hung
        past the timeout (default: the engine's) or raised is a :class:`GeneratorError` saying it was ``doing``."""
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        while tag not in self._answers:
            message = self._pipe.receive(timeout=0.1)
            if message is CLOSED:
                raise self._failure(doing)
            if message is not None:
                kind, got, payload = message
                if kind == "error":
                    self.close()
                    raise GeneratorError(f"the generator process failed while {doing}:\n{payload}")
                if got in self._dropped:  # a draw ahead whose request was dropped: read, then let go
                    self._dropped.discard(got)
                    self.stale += 1
                else:
                    self._answers[got] = payload
            elif not self.process.is_alive():
                raise self._failure(doing)
            elif time.monotonic() > deadline:
                self.close(ask=False)  # a hung child reads nothing: asking could block on a full pipe
                raise GeneratorError(
                    f"the generator process (pid {self.process.pid}) gave no answer in {timeout:g} s while "
                    f"{doing}; it was stopped (--generator-timeout sets the wait)"
                )
        return self._answers.pop(tag)

    def _failure(self, doing: str) -> GeneratorError:
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        self.close()
        return GeneratorError(f"the generator process (pid {self.process.pid}) died ({how}) while {doing}")

    def close(self, ask: bool = True) -> None:
        """Stop the child (asked first, unless ``ask`` is False, then terminated, then killed) and close the pipe."""
        if ask and self.process.is_alive() and not self._pipe.failed:
            self._pipe.send(pickle.dumps(("stop", 0)))
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()  # a stopped child too: SIGKILL needs no SIGCONT
            self.process.join()
        self._pipe.close()


def build_process_engine(
    engine: EngineSection,
    seed: int,
    policy,
    full_weights=contextlib.nullcontext,
    fp32_head: bool = False,
    autocast: bool = False,
) -> ProcessEngine:
    """A generator process for ``policy`` as the run's ``engine`` options ask (--rollout-engine, --max-staleness,
    --rollout-dtype, --generator-threads, --generator-timeout, vLLM's); ``seed``: vLLM's; ``full_weights``: the
    context in which the weights are whole (FSDP); ``fp32_head``, ``autocast``: as
    :func:`grpolab.rollout.engine.build_engine` takes them."""
    return ProcessEngine(
        policy.model,
        EngineSpec.of(engine, seed, policy, full_weights, fp32_head, autocast),
        threads=engine.generator_threads or torch.get_num_threads(),
        timeout=engine.generator_timeout,
    )
