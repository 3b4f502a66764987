"""A generator process: a rollout engine in a process of its own, drawing while the trainer updates.

:class:`ProcessEngine` is a rollout engine (``grpolab.rollout.engine.RolloutEngine``) whose draws run in a child
process. The child holds a replica of the policy's model and an :class:`grpolab.rollout.engine.HFEngine` over it (or
a :class:`grpolab.rollout.vllm_engine.VLLMEngine`, vLLM in the child's process, each version pushed into it);
the trainer keeps everything else (the collector, the rewards, the environments, the update).

Weights: after each optimizer step the trainer writes the served weights (``grpolab.rollout.weights.
served_weights``) into one shared-memory buffer per dtype, only where their bits changed (the buffer holds the
previous version, :mod:`grpolab.rollout.delta`), and sends the child those positions; the child builds from its
previous version and them a version of its own, numbered by the sync (0: the starting weights). A LoRA policy's
adapter goes unmerged beside its base weights, and the child merges it (``--lora-sync``: the base travels once).
Every draw names the version it must use: ``max(0, syncs - K)`` under ``--max-staleness K`` (the current ones inside
:meth:`ProcessEngine.current_weights`), so what the child draws depends only on the prompts, the keys and that
version, never on timing. The child keeps the versions a later draw may still ask for (the newest K + 1).

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
import logging
import os
import pickle
import signal
import time
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp

from grpolab.common.errors import GeneratorError
from grpolab.rollout.delta import Change, span_of
from grpolab.rollout.duplex import CLOSED
from grpolab.rollout.replica import START_TIMEOUT, GeneratorSpec, SharedWeights, pipe_end, serve
from grpolab.rollout.sampler import Sampled, SamplingSettings
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import base_model, held_state, held_version, restored_held, sent_lora, served_weights

__all__ = ["ProcessEngine", "SyncBooks", "VersionedDraws"]

log = logging.getLogger("grpolab.generator")


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
    :class:`grpolab.rollout.remote.pool.WorkerPool`): ``syncs`` weight syncs so far, ``max_staleness`` =
    --max-staleness K. A step draws with version :func:`grpolab.rollout.weights.held_version`, ``max(0, syncs - K)``,
    a held-out evaluation (inside :meth:`current_weights`) with the newest."""

    syncs: int = 0
    max_staleness: int = 0
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
        """The sync whose weights a step draws with now (0: the starting ones); None when K = 0."""
        return held_version(self.syncs, self.max_staleness) if self.max_staleness else None

    def _draw_version(self) -> int:
        return self.syncs if self._current else held_version(self.syncs, self.max_staleness)

    def _ahead_version(self) -> int | None:
        """The version the next step will draw with, if it exists already (K >= 1); None at K = 0 (it is the
        update's result)."""
        version = held_version(self.syncs + 1, self.max_staleness)
        return version if version <= self.syncs else None


class SyncBooks:
    """The weight syncs' books since the last metrics (``generators/sync_*``): the bytes that travelled (positions
    and values of deltas, whole stretches), the trainer's seconds, and of the elements compared those whose bits
    changed."""

    def __init__(self):
        self.bytes, self.seconds, self.changed, self.size = 0, 0.0, 0, 0

    def add(self, changes: list[Change]) -> None:
        """The stretches of one version sent to one receiver."""
        for c in changes:
            self.bytes += c.nbytes
            self.changed += c.changed
            self.size += c.size

    def pop(self) -> dict[str, float]:
        """``generators/sync_bytes``, ``generators/sync_s`` and ``generators/sync_delta_frac`` (the share of the
        elements compared whose bits changed; 1 for a receiver that held none) since the last call."""
        out = {
            "generators/sync_bytes": float(self.bytes),
            "generators/sync_s": self.seconds,
            "generators/sync_delta_frac": self.changed / self.size if self.size else 0.0,
        }
        self.__init__()
        return out


class ProcessEngine(VersionedDraws):
    """A rollout engine drawing in a generator process (module docstring). ``model``: the policy's model (its
    weights are pushed at each :meth:`weights_changed`); ``spec.max_staleness``: --max-staleness K; ``threads``: the
    child's torch threads; ``timeout``: seconds any one answer may take."""

    def __init__(self, model: torch.nn.Module, spec: EngineSpec, *, threads: int = 1, timeout: float = 900.0):
        self.model, self.full_weights, self.timeout = model, spec.full_weights, timeout
        self.max_staleness = spec.max_staleness
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
        self._whole = False  # the next sync writes every weight (after a restore: the child holds no version)
        self.books = SyncBooks()
        base = base_model(model)
        param = next(model.parameters())
        self.lora, note = sent_lora(model, spec.lora_sync)  # LoRA: the base and the factors, merged by the child
        if note:
            log.warning(note)
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
            always_copy=spec.max_staleness > 0,
            trainable=param.requires_grad,
            vllm=spec.vllm,
            seed=spec.seed,
            fp32_head=spec.fp32_head,
            storage=spec.storage,
            lora=self.lora,
        )
        conn, self.process = _start_child(spec, self.shared)
        self._pipe = pipe_end(conn)
        self.note = self._answer(0, "starting", max(self.timeout, START_TIMEOUT))
        """Why the generator's copy has no fused decoder (None when it has one, or samples the replica)."""

    # ------------------------------------------------------------------ the engine's interface
    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        """One completion per prompt, drawn in the generator process with the weights of the sync this draw names
        (``max(0, syncs - K)``; the newest inside :meth:`current_weights`). The rows :meth:`prefetch` started for
        exactly this request are taken; any other request is drawn now (a draw ahead waits for its own request).

        Args:
            prompts (list[list[int]]): N prompts' token ids, unpadded: B prompts, each repeated G times, N = B*G.
            keys (list[tuple[int, ...]]): [N] rollout keys; ``keys[n]`` seeds row n, whatever the other rows are.
            settings (SamplingSettings): the sampling settings of every row, as the child's engine takes them.
            media (Sequence[Media | None] | None): [N] each prompt's images (:class:`grpolab.vision.media.Media` or
                None), sent with the request; None for text prompts.

        Returns:
            Sampled: the child engine's answer (:meth:`grpolab.rollout.engine.HFEngine.generate`'s, or
                :meth:`grpolab.rollout.vllm_engine.VLLMEngine.generate`'s with ``entropy`` None): ``batch`` with
                ``prompt_ids``, ``prompt_mask`` [N, P] and ``completion_ids``, ``completion_mask`` [N, T], its
                ``media`` None (the trainer keeps the rows' images), ``logprobs`` [N, T], ``entropy`` [N, T].

        Raises:
            GeneratorError: the child died, gave no answer within ``timeout`` seconds, or raised (its traceback in
                the message; e.g. vLLM in the child refusing rows with images).
        """
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
        """Push the policy's weights once the child has taken the previous ones: the shared buffers hold those, and
        only the positions whose bits changed are written, and named to the child (their int32 indices, with the
        pipe's message), which builds the new version from its previous one and them (after a restore, every
        weight)."""
        if self._sync_tag is not None:
            self.spans.append(("sync", *self._answer(self._sync_tag, f"taking the weights of sync {self.syncs}")))
        t0 = time.perf_counter()
        changes = self.shared.update(self._served(), full=self._whole)
        spans = None if self._whole else [span_of(b, start, c) for b, start, c in changes if c.changed]
        self._whole = False
        self.syncs += 1
        keep_from = held_version(self.syncs, self.max_staleness)
        self._sync_tag = self._send("sync", self.syncs, keep_from, spans)
        self.books.add([c for _, _, c in changes])
        self.books.seconds += time.perf_counter() - t0

    def pop_metrics(self) -> dict[str, float]:
        """``generators/sync_*`` since the last call (:meth:`SyncBooks.pop`): bytes written into the shared buffers
        and positions sent, the trainer's seconds, the share of elements changed."""
        return self.books.pop()

    # ------------------------------------------------------------------ checkpoints
    def held_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a checkpoint keeps of the weights in flight, in the form of
        :meth:`grpolab.rollout.weights.SamplerWeights.held_state` (so either engine resumes the other's)."""
        held = held_version(self.syncs, self.max_staleness)
        versions = self._answer(self._send("state"), "handing over the weights in flight")
        pending = [(v, versions[v]) for v in range(held + 1, self.syncs + 1)]
        return held_state(held, self.syncs, versions[held], pending)

    def restore_held(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`held_state`'s weights: the child draws with them as the uninterrupted run would."""
        held, pending = restored_held(counts, tensors)
        versions = {counts["version"]: held, **dict(pending)}
        self._answer(self._send("restore", versions), "taking the checkpoint's weights in flight")
        self.syncs, self._whole = counts["syncs"], True

    # ------------------------------------------------------------------ the pipe
    def _served(self) -> dict[str, torch.Tensor]:
        """The weights the child is sent: served, or with LoRA the base and factors apart (:attr:`lora`)."""
        with torch.no_grad(), self.full_weights():
            return {n: t.cpu() for n, t in served_weights(self.model, unmerged=bool(self.lora))}

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
