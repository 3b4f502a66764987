"""The trainer's side of the generator workers (``--generators N``): :class:`WorkerPool` admits the workers its
:class:`grpolab.rollout.remote.listener.Listener` greeted, broadcasts each weight version, splits every draw into
contiguous parts among the live workers and redraws a lost worker's parts from the same keys."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable

import torch

from grpolab.common.errors import ConfigError, GeneratorError
from grpolab.rollout.delta import Change
from grpolab.rollout.generator import VersionedDraws
from grpolab.rollout.remote.books import PoolBooks
from grpolab.rollout.remote.common import (
    TOKEN_ENV,
    broadcast_piece,
    first_words,
    is_local,
    layout_json,
    log,
    lora_json,
    read_token,
    split_address,
    weight_buckets,
)
from grpolab.rollout.remote.handle import Lost, WorkerHandle, other_kernels
from grpolab.rollout.remote.listener import Listener, welcome
from grpolab.rollout.remote.parts import contiguous_parts, draw_header, merge_parts
from grpolab.rollout.remote.versions import HeldVersions
from grpolab.rollout.replica import START_TIMEOUT
from grpolab.rollout.sampler import Sampled, SamplingSettings
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import base_model
from grpolab.vision.media import text_only


class WorkerPool(VersionedDraws):
    """A rollout engine whose draws run on generator workers (module docstring). ``model``: the policy's model;
    ``expect``: workers to wait for before the first draw; ``listen``: HOST:PORT; ``token``: the shared secret
    (required unless ``listen`` is local); ``run``: the run id a worker may name; ``spec.max_staleness``:
    --max-staleness K; ``timeout``: seconds any one answer may take; ``wait``: seconds to wait for a worker when none
    is live."""

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
        self.max_staleness, self.timeout, self.wait, self.expect = spec.max_staleness, timeout, wait, expect
        self.say, self.pad_id = say, spec.pad_id
        param = next(model.parameters())
        self.dtype = spec.dtype or param.dtype
        self.device = str(param.device)
        # the weights go in the rollout dtype; a sampler that keeps the policy's outside its products (storage) takes
        # those in it, and the weights it reads only in products in the rollout dtype (HeldVersions' product_dtype)
        self.send_dtype = param.dtype if spec.storage is not None else self.dtype
        self.syncs = 0
        self.prefetches = {"used": 0, "dropped": 0}
        self.digests: list[str] | None = None
        self.books = PoolBooks()
        self.counts = self.books.counts
        self._tag = 0
        self._prefetched = None
        self._live: list[WorkerHandle] = []
        self.versions = HeldVersions(model, spec.full_weights, self.send_dtype, self.max_staleness, spec.lora_sync,
                                     self.device, product_dtype=self.dtype, fp32_head=spec.fp32_head)  # fmt: skip
        if self.versions.note:
            say(f"generators: {self.versions.note}")
        greeting = welcome(model, self.dtype, spec, timeout, run)
        greeting["layout"] = layout_json(self.versions.slot.layout)
        greeting["lora"] = lora_json(self.versions.lora)
        buffers = {n: b.detach().cpu() for n, b in base_model(model).named_buffers()}
        self.listener = Listener(
            host, port, welcome=greeting, buffers=buffers, token=token, run=run, device=self.device,
            timeout=timeout, say=say, refused=lambda peer: self.books.refused(peer, time.time()),
        )  # fmt: skip
        self.address = self.listener.address
        say(f"generators: listening on {self.address} for {expect} worker(s) (run id {run!r})")
        self._admit(expect, START_TIMEOUT + wait)
        if len(self._live) < expect:
            say(f"generators: {len(self._live)} of {expect} workers joined in {START_TIMEOUT + wait:g} s; going on")

    # ------------------------------------------------------------------ joining
    def _admit(self, want: int = 0, within: float = 0.0) -> None:
        """Take in the workers that have joined (each gets the versions a draw may still ask for), waiting up to
        ``within`` seconds until at least ``want`` are live."""
        deadline = time.monotonic() + within
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic()) if len(self._live) < want else 0
                joining = self.listener.joining
                worker = joining.get(timeout=min(timeout, 1.0)) if timeout else joining.get_nowait()
            except queue.Empty:
                if len(self._live) >= want or time.monotonic() > deadline:
                    return
                continue
            try:
                self._send_held(worker)
                self._live.append(worker)
                about = worker.about
                self.books.event(
                    "joined", worker.id, at=time.time(), engine=about.get("engine"), device=about.get("device")
                )
                self.say(f"generators: {worker.name} joined ({about.get('engine')}, {about.get('device')})")
                other = other_kernels(about, self.device, self.dtype)
                if other:
                    self.say(
                        f"generators: warning: {worker.name} samples {other}: its log-probs are not the trainer's "
                        "(--engine-correction weighs the mismatch; engine/* measures it)"
                    )
            except Lost as e:
                self._drop(e.worker, e.why)

    # ------------------------------------------------------------------ the engine's interface
    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        """Draw one completion per prompt on the live workers, each part from its rows' keys with the weight version
        this step names (:class:`grpolab.rollout.generator.VersionedDraws`), or take the draw ahead
        (:meth:`prefetch`) if it was this one.

        Args:
            prompts (list[list[int]]): N prompts' token ids (a group repeats its prompt G times).
            keys (list[tuple[int, ...]]): N keys; ``keys[n]`` seeds row n, so a row is the same whichever worker
                draws it.
            settings (SamplingSettings): temperature, top-p/k, the completion budget T, the prompt width.
            media: must be None (workers draw text only).

        Returns:
            Sampled: the batch ``[N, P]`` prompts, ``[N, T]`` completions, the sampler's log-probs and entropies
            ``[N, T]`` (0 on padding), rows in the call's order.

        Raises:
            GeneratorError: no worker is live and none joins within ``wait`` seconds.
        """
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
        """Broadcast the policy's new weights to every live worker (after the optimizer step), to each as the delta
        from the version it holds (:meth:`HeldVersions.changes`)."""
        start = time.perf_counter()
        self._admit()  # a worker that joined gets the versions held so far, then this one with the others
        self.syncs += 1
        self.versions.add(self.syncs)
        t0 = time.perf_counter()
        for worker in list(self._live):
            try:
                self._send_weights(worker, self.syncs)
            except Lost as e:
                self._drop(e.worker, e.why)
        self.versions.release()  # the version before, the deltas' base, went with the sends
        self.books.broadcast_s += time.perf_counter() - t0
        self.books.sync.seconds += time.perf_counter() - start

    def pop_metrics(self) -> dict[str, float]:
        """``generators/*`` since the last call (:meth:`PoolBooks.pop_metrics`)."""
        return self.books.pop_metrics(self._live)

    def pop_events(self) -> list[dict]:
        """The workers' timeline since the last call (:meth:`PoolBooks.pop_events`)."""
        return self.books.pop_events()

    # ------------------------------------------------------------------ checkpoints
    def held_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return self.versions.held_state(self.syncs)

    def restore_held(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.versions.restore(counts, tensors)
        self.syncs = counts["syncs"]
        for worker in list(self._live):
            worker.newest = None  # its buffers hold none of these: the oldest goes whole
            try:
                self._send_held(worker)
            except Lost as e:
                self._drop(e.worker, e.why)

    # ------------------------------------------------------------------ the wire
    def _drop_prefetch(self) -> None:
        if self._prefetched is not None:
            for worker, _, tag in self._prefetched[1]:
                worker.dropped.add(tag)
            self.prefetches["dropped"] += 1
            self._prefetched = None

    def _send(self, worker: WorkerHandle, header: dict) -> int:
        """Send ``header`` to ``worker`` with the next tag (taken only once it is sent); returns the tag."""
        tag = self._tag + 1
        worker.send(header, tag)  # raises Lost for a failed connection
        self._tag = tag
        return tag

    def _send_held(self, worker: WorkerHandle) -> None:
        """Every version a draw may still ask for, oldest first (a worker that joins, a resumed run's): the oldest
        whole, each other as the delta from the one before."""
        for version in sorted(v for v in self.versions.held if v >= self.versions.keep_from):
            self._send_weights(worker, version)

    def _send_weights(self, worker: WorkerHandle, version: int) -> None:
        """``version`` to ``worker``: a header that says, per bucket, whole (-1) or how many positions changed since
        the version the worker holds, then the buckets (:func:`send_buckets`)."""
        base = worker.newest if worker.newest in self.versions.held else None
        changes, start = self.versions.changes(base, version), time.time()
        merged, keep_from = version in self.versions.merged, self.versions.keep_from
        header = {"kind": "sync", "version": version, "keep_from": keep_from, "merged": merged}
        self._send(worker, {**header, "pieces": [-1 if c.full else c.changed for c in changes]})  # answer: let go
        try:
            send_buckets(worker, weight_buckets(self.versions.held[version]), changes, self.device)
        except RuntimeError as e:
            raise Lost(worker, f"the weight broadcast failed ({first_words(e)})") from None
        worker.newest = version
        self.books.sync.add(changes)
        sent = sum(c.nbytes for c in changes)
        self.books.event("weights", worker.id, start=start, end=time.time(), version=version, base=base, bytes=sent)

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

    def _send_draw(self, worker: WorkerHandle, request: tuple, rows: list[int]) -> int:
        return self._send(worker, draw_header(request, rows, digest=self.digests is not None))

    def _send_draws(self, request: tuple) -> list[tuple[WorkerHandle, list[int], int]]:
        self._ensure_live()
        return [self._assign(request, rows, i) for i, rows in enumerate(contiguous_parts(len(request[1]), self.expect))]

    def _assign(self, request: tuple, rows: list[int], turn: int) -> tuple[WorkerHandle, list[int], int]:
        """Send ``rows`` to the ``turn``-th live worker (in the order they joined, round); a worker whose
        connection fails is dropped and the next one tried."""
        while True:
            self._ensure_live()
            worker = self._live[turn % len(self._live)]
            try:
                return worker, rows, self._send_draw(worker, request, rows)
            except Lost as e:
                self._drop(e.worker, e.why)

    def _collect(self, request: tuple, parts: list[tuple[WorkerHandle, list[int], int]]) -> Sampled:
        got: dict[int, tuple[list[int], dict, list[torch.Tensor]]] = {}
        pending = list(enumerate(parts))
        while pending:
            still = []
            for i, (worker, rows, tag) in pending:
                try:
                    answer = self._wait(worker, tag)
                except Lost as e:
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
                self.books.event("draw", worker.id, start=start, end=end, rows=len(rows), version=request[0])
            pending = still
        parts = [got[i] for i in sorted(got)]
        if self.digests is not None:
            self.digests += [header.get("digest") for _, header, _ in parts]
        return merge_parts(len(request[1]), [(rows, tensors) for rows, _, tensors in parts], self.pad_id)

    def _wait(self, worker: WorkerHandle, tag: int):
        """Worker ``worker``'s answer to ``tag`` if it has come within a short wait (None if not yet); raises
        :class:`Lost` for a worker that was dropped, closed, sent garbage or is past the timeout."""
        if tag not in worker.answers and worker not in self._live:  # an answer already read is still taken
            raise Lost(worker, "it was dropped")
        stale = worker.stale
        try:
            return worker.answer(tag, self.timeout)
        finally:
            self.counts["stale"] += worker.stale - stale

    def _drop(self, worker: WorkerHandle, why: str) -> None:
        if worker in self._live:
            self._live.remove(worker)
            self.counts["lost"] += 1
            self.books.event("lost", worker.id, at=time.time(), why=why)
            self.say(f"generators: lost {worker.name}: {why}; {len(self._live)} left")
        worker.link.close()

    def close(self) -> None:
        """Tell every worker to stop, and stop listening."""
        self.listener.close()
        for worker in self._live:
            with contextlib.suppress(Lost):
                self._send(worker, {"kind": "stop"})
            worker.link.close(flush=5.0)
            worker.group = None
        self._live = []
        self.listener.release()


def send_buckets(worker: WorkerHandle, pieces: list, changes: list[Change], device: str) -> None:
    """A version's buckets to ``worker`` on their pair group, each as its :class:`grpolab.rollout.delta.Change`
    says: the whole bucket, or its positions (int32) then its values, or nothing when none changed (what
    :func:`grpolab.rollout.remote.worker.receive_version` takes)."""
    for (_, _, piece), change in zip(pieces, changes):
        if change.full:
            broadcast_piece(worker.group, worker.backend, piece, device)
        elif change.changed:
            broadcast_piece(worker.group, worker.backend, change.indices, device)
            broadcast_piece(worker.group, worker.backend, change.values, device)


def worker_pool(model: torch.nn.Module, spec: EngineSpec, say: Callable[[str], None] = log.warning) -> WorkerPool:
    """The pool of generator workers ``spec.placement`` asks for (--generators, --generator-listen, --generator-wait,
    --generator-timeout, --generator-token-file). Rank r of a torchrun job listens on the port plus r, and its workers
    draw its share of the rollouts."""
    place = spec.placement
    host, port = split_address(place.listen)
    return WorkerPool(
        model,
        spec,
        expect=place.workers,
        listen=f"{host}:{port + place.rank if port else 0}",
        token=read_token(place.token_file),
        run=place.run,
        timeout=place.timeout,
        wait=place.wait,
        say=say,
    )
