"""The generator process's child, public for every process that draws rollouts for a trainer from weight versions
it is sent: the child of :class:`grpolab.rollout.generator.ProcessEngine` and each generator worker
(:mod:`grpolab.rollout.remote.worker`). :class:`ReplicaGenerator` holds a replica of the policy's model, an engine
over it and the weight versions a draw may still name; :func:`serve` is the child's loop over its pipe;
:class:`SharedWeights` the buffers the weights come through; :class:`GeneratorSpec` what the child is built from.
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

import torch

from grpolab.rollout.delta import Change, Span, apply, encode, patched_weights, whole
from grpolab.rollout.duplex import Duplex
from grpolab.rollout.lora_merge import LoraFactors, merged_served
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import skeleton, snapshot

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
    lora: dict[str, LoraFactors] = dataclasses.field(default_factory=dict)
    """``--lora-sync adapter``: the adapted layers whose base weight and factors come unmerged (the child merges
    them, :func:`grpolab.rollout.lora_merge.merged_served`); empty: every weight comes as it is served."""


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

    def update(self, served: dict[str, torch.Tensor], full: bool = False) -> list[tuple[str, int, Change]]:
        """Write ``served`` over the version the buffers hold, only where its bits differ (``full``: all of it);
        returns each weight's place and :class:`grpolab.rollout.delta.Change` (``(buffer, start, change)``; a tied
        weight once)."""
        out, seen = [], set()
        with torch.no_grad():
            for name, (dtype, start, _) in self.layout.items():
                if (dtype, start) in seen:
                    continue
                seen.add((dtype, start))
                view, new = self._views[name].view(-1), served[name].detach().reshape(-1)
                change = encode(view, new)
                if full and not change.full:
                    change = whole(new, change.changed)
                apply(view, change)
                out.append((str(dtype), start, change))
        return out


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
        self.layout = shared.layout
        self.slot = shared.views(buffers)
        self.replica = skeleton(spec.model_class, spec.config, spec.buffers, spec.param_dtype, spec.device, False)
        self.replica.requires_grad_(spec.trainable)
        self.params = dict(self.replica.named_parameters(remove_duplicate=False))
        self.newest: tuple[dict, dict, bool] | None = None
        """The newest version as it came (the slot's weights), as it is served, and whether it came merged."""
        self.versions = {0: self.take()}
        self._load(0)
        engine = EngineSpec(spec.eos_id, spec.pad_id, spec.dtype, spec.storage, spec.fp32_head, seed=spec.seed,
                            vllm=spec.vllm)  # fmt: skip
        if spec.vllm is not None:
            from grpolab.rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(self.replica, engine)
        else:
            self.engine = HFEngine(self.replica, engine, always_copy=spec.always_copy)
        self.loaded = 0

    def forget(self) -> None:
        """Hold no version (a worker, whose trainer sends the versions it needs, the first of them whole)."""
        self.versions, self.loaded, self.newest = {}, -1, None

    def take(self, spans: list[Span] | None = None, merged: bool = False) -> dict[str, torch.Tensor]:
        """The slot's weights as a new version, served: a snapshot (``spans`` None), or the newest version before
        with the positions ``spans`` name taken from the slot (the rest is unchanged: the trainer wrote, or the
        worker received, only those). ``merged``: the slot's LoRA-adapted weights are merged already (a version a
        checkpoint kept)."""
        if spans is not None and self.newest is None:
            raise ValueError("a weight delta came to a generator that holds no version to apply it to")
        raw = snapshot(self.slot) if spans is None else patched_weights(self.newest[0], self.slot, self.layout, spans)
        reuse = None if spans is None or merged or self.newest[2] else self.newest[:2]
        served = merged_served(raw, self.spec.lora, self.spec.device, merged, reuse)
        self.newest = (raw, served, merged)
        return served

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
        if kind == "sync":  # ("sync", tag, version, keep_from[, spans[, merged]]): spans None, the slot whole
            version, keep_from, *how = message[2:]
            t0 = time.time()
            self.versions[version] = self.take(*how)
            for v in [v for v in self.versions if v < keep_from]:  # never asked for again (the loaded: in place)
                del self.versions[v]
            return "synced", tag, (t0, time.time())
        if kind == "state":
            return "state", tag, dict(self.versions)
        if kind == "restore":
            self.versions = dict(message[2])
            self.loaded, self.newest = -1, None  # the next sync comes whole
            return "restored", tag, None
        raise ValueError(f"unknown message {kind!r}")


STOP_MID_ANSWER = "GRPOLAB_TEST_STOP_MID_ANSWER"
"""Tests only: a generator process whose environment names a kind of answer here ("drawn", "synced", ...) writes the
length of its first such answer, stops itself with SIGSTOP, and writes the rest only if continued: the trainer must
meet its deadline on a message cut between its length and its payload."""


def put_message(conn, message) -> None:
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


def get_message(conn):
    """A message :func:`put_message` sent (from our own process only: the pipe is the trainer's and its child's)."""
    return pickle.loads(conn.recv_bytes())


def pipe_end(conn) -> Duplex:
    """The trainer's end of the pipe to its generator process, read and written on threads of its own
    (:class:`grpolab.rollout.duplex.Duplex`: no wait on the child is without a deadline). Requests are pickled by
    :meth:`ProcessEngine._send` before they are queued, so that an object that cannot be sent fails there."""

    def shutdown() -> None:
        with socket.socket(fileno=os.dup(conn.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)

    return Duplex(lambda: get_message(conn), conn.send_bytes, shutdown, conn.close, "grpolab-generator")


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphan after a SIGKILL of the trainer)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def serve(spec: GeneratorSpec, shared: SharedWeights, buffers: dict, conn, parent: int) -> None:
    """The child's loop: build the engine, then answer the trainer's messages in order until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it ends its step, saves and stops us
    die_with_parent()
    try:
        generator = ReplicaGenerator(spec, shared, buffers)
        weights = getattr(generator.engine, "weights", None)
        put_message(conn, ("ready", 0, getattr(weights, "note", None)))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    return  # the trainer is gone
                continue
            message = get_message(conn)
            if message[0] == "stop":
                return
            put_message(conn, generator.handle(message))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer closed the pipe
    except BaseException:
        with contextlib.suppress(Exception):
            put_message(conn, ("error", -1, traceback.format_exc()))
