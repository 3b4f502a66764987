"""What the generator workers did in a step, read from their events (:meth:`grpolab.rollout.remote.pool.WorkerPool.pop_events`,
or generators.jsonl): each worker's totals and the step's one log line. Plain functions of the events, without the
pool's sockets and process groups, for the run's log (:mod:`grpolab.training.recipe`) and the report
(:mod:`grpolab.report.generators`).
"""

from __future__ import annotations


def worker_totals(events: list[dict]) -> dict[int, dict]:
    """Per worker named in ``events`` (:meth:`WorkerPool.pop_events`' or generators.jsonl's), in the order of their
    ids: rows drawn, draws, drawing seconds (``draw_s``) and seconds of the weight broadcasts to it (``weights_s``)."""
    out: dict[int, dict] = {}
    for e in sorted((e for e in events if "worker" in e), key=lambda e: e["worker"]):
        row = out.setdefault(e["worker"], {"rows": 0, "draws": 0, "draw_s": 0.0, "weights_s": 0.0})
        if e["kind"] == "draw":
            row["rows"] += e["rows"]
            row["draws"] += 1
            row["draw_s"] += e["end"] - e["start"]
        elif e["kind"] == "weights":
            row["weights_s"] += e["end"] - e["start"]
    return out


def step_line(events: list[dict]) -> str | None:
    """One line on the workers' share of a step, from its :meth:`WorkerPool.pop_events`: each worker's rows, its
    drawing seconds and rows per second while drawing, and the weight broadcasts' seconds; None if nothing was
    drawn."""
    totals = worker_totals(events)
    parts = [
        f"worker {w}: {t['rows']} rows in {t['draw_s']:.2f} s ({t['rows'] / max(t['draw_s'], 1e-9):.1f}/s)"
        for w, t in totals.items()
        if t["draws"]
    ]
    if not parts:
        return None
    weights = sum(t["weights_s"] for t in totals.values())
    lost = [str(e["worker"]) for e in events if e["kind"] == "lost"]
    tail = f"; lost worker {', '.join(lost)}" if lost else ""
    return f"generators: {' · '.join(parts)} · weights {weights:.2f} s{tail}"
