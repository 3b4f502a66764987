"""The generator pool's books (:class:`PoolBooks`): the run's counts, the weight broadcasts' seconds and the timeline
of events, read out as ``generators/*`` metrics and ``generators.jsonl`` lines."""

from __future__ import annotations

import threading

from grpolab.rollout.generator import SyncBooks


class PoolBooks:
    """What the pool did. ``counts``: the run's workers lost, rows redrawn, connections refused, stale answers (to
    draws ahead whose request was dropped: read and let go); ``broadcast_s``: the weight broadcasts' seconds since
    the last metrics; ``sync``: the weight syncs' bytes, seconds and changes since then. Events may be added from the
    listener's thread (refusals)."""

    def __init__(self):
        self.counts = {"lost": 0, "redrawn": 0, "refused": 0, "stale": 0}
        self.broadcast_s = 0.0
        self.sync = SyncBooks()
        self.events: list[dict] = []  # what pop_events returns: the timeline of draws, broadcasts, joins, losses
        self.lock = threading.Lock()

    def event(self, kind: str, worker: int | None = None, **fields) -> None:
        """One event of the timeline; ``worker``: the worker's id, where it is one worker's."""
        with self.lock:
            self.events.append({"kind": kind, **({"worker": worker} if worker is not None else {}), **fields})

    def refused(self, peer: str, at: float) -> None:
        """A connection from ``peer`` was refused at ``at`` (wall clock)."""
        self.counts["refused"] += 1
        self.event("refused", at=at, peer=peer)

    def pop_events(self) -> list[dict]:
        """The timeline since the last call, one dict per event (``generators.jsonl``; the report draws it):
        ``draw`` (a worker's part: ``start``, ``end`` on the worker's wall clock, ``rows``, ``version``),
        ``weights`` (one worker's broadcast of a version: ``start``, ``end``, ``bytes`` sent, ``base``: the version
        it was the delta from, None when it went whole), ``joined``, ``lost`` (``at``,
        ``why``), ``refused`` (``at``, ``peer``)."""
        with self.lock:
            events, self.events = self.events, []
        return events

    def pop_metrics(self, live: list) -> dict[str, float]:
        """``generators/*`` since the last call: the ``live`` workers (:class:`~grpolab.rollout.remote.handle.
        WorkerHandle`), rows drawn by each (``rows_worker<id>``), the busiest worker's drawing seconds (``draw_s``,
        its own clock), the weight broadcasts' seconds, the syncs' (:meth:`SyncBooks.pop`); and :attr:`counts` so
        far."""
        out = {
            "generators/workers": float(len(live)),
            "generators/broadcast_s": self.broadcast_s,
            **self.sync.pop(),
            **{f"generators/{k}": float(v) for k, v in self.counts.items()},  # lost, redrawn, refused, stale
        }
        out["generators/draw_s"] = max((w.seconds for w in live), default=0.0)
        for w in live:
            out[f"generators/rows_worker{w.id}"] = float(w.rows)
            w.rows, w.seconds = 0, 0.0
        self.broadcast_s = 0.0
        return out
