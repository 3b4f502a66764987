"""The report's generator timeline, for a run drawn on generator workers (``--generators N``): who drew what when.

Reads ``generators.jsonl`` (one line per event of rank 0's pool: ``grpolab.rollout.remote.pool.WorkerPool.pop_events``)
and draws one lane per worker: its draws (the worker's wall clock) and the weight broadcasts to it (the trainer's),
with the moments workers joined or were lost. Workers on other machines share a time axis only as far as their
clocks agree (NTP: milliseconds), which is finer than a draw. Written by hand: no library draws these files.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpolab.report.markup import escape as _e
from grpolab.report.markup import png_img
from grpolab.rollout.worker_events import worker_totals  # the trainer's own sums (its per-step line's)

SHOWN_STEPS = 12
"""The timeline shows the last this many steps (the table counts them all): a long run's bars would be hairlines."""


def read_events(run_dir: Path) -> list[dict]:
    """Every event of ``generators.jsonl``, with its step; a line cut by a kill is skipped."""
    path = run_dir / "generators.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def worker_table(events: list[dict]) -> list[dict]:
    """Per worker: rows drawn, draws, drawing seconds, rows per second while drawing, broadcast seconds, the step
    it was lost at (None if never)."""
    lost = {}
    for e in events:
        if e["kind"] == "lost":
            lost.setdefault(e["worker"], e["step"])
    return [
        {"worker": w, **t, "lost_at": lost.get(w), "rows_per_s": t["rows"] / t["draw_s"] if t["draw_s"] > 0 else None}
        for w, t in worker_totals(events).items()
    ]


def timeline_png(events: list[dict]) -> bytes | None:
    """One lane per worker over the last :data:`SHOWN_STEPS` steps: draws (blue, labelled by rows), weight
    broadcasts (orange), joins (green) and losses (red); seconds from the first event shown."""
    from grpolab.report.plotting import figure_png, plt

    steps = sorted({e["step"] for e in events})
    shown = [e for e in events if e["step"] in set(steps[-SHOWN_STEPS:])]
    timed = [e for e in shown if "start" in e or "at" in e]
    workers = sorted({e["worker"] for e in shown if "worker" in e})
    if not timed or not workers:
        return None
    t0 = min(e.get("start", e.get("at")) for e in timed)
    lane = {w: i for i, w in enumerate(workers)}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(workers)))
    for kind, colour, height in (("draw", "tab:blue", 0.6), ("weights", "tab:orange", 0.3)):
        for e in shown:
            if e["kind"] == kind:
                y = lane[e["worker"]]
                ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y - height / 2, height), color=colour)
    for kind, colour, marker in (("joined", "tab:green", "^"), ("lost", "tab:red", "x")):
        pts = [(e["at"] - t0, lane[e["worker"]]) for e in shown if e["kind"] == kind]
        if pts:
            ax.scatter(*zip(*pts), color=colour, marker=marker, s=60, zorder=3, label=kind)
    ax.plot([], [], color="tab:blue", lw=6, label="draw")
    ax.plot([], [], color="tab:orange", lw=6, label="weights")
    ax.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
    ax.set_ylim(-0.6, len(workers) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds (steps {min(e['step'] for e in shown)} to {max(e['step'] for e in shown)})")
    ax.legend(fontsize=8, loc="upper right", ncol=4)
    ax.grid(alpha=0.3, axis="x")
    return figure_png(fig, dpi=90)


def _cell(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def generators_section(run_dir: Path) -> str:
    """The report's section, headed (empty for a run without generator workers): the per-worker table and the
    timeline."""
    events = read_events(run_dir)
    if not events:
        return ""
    rows = "".join(
        f"<tr><td class='l'>worker {r['worker']}</td><td>{r['rows']}</td><td>{r['draws']}</td>"
        f"<td>{r['draw_s']:.1f}</td><td>{_cell(r['rows_per_s'], '.1f')}</td><td>{r['weights_s']:.1f}</td>"
        f"<td>{_cell(r['lost_at'], 'd')}</td></tr>"
        for r in worker_table(events)
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("rows", "draws", "drawing (s)", "rows/s drawing", "weights received (s)", "lost at step")
    )
    refused = sum(e["kind"] == "refused" for e in events)
    png = timeline_png(events)
    figure = png_img(png, "generator timeline") if png else ""
    note = f"<p>{refused} connection(s) refused (not grpolab generators of this run).</p>" if refused else ""
    return (
        '<h2 id="generators">Generator workers: who drew what, when</h2>\n'
        f"<table><tr><th class='l'>worker</th>{head}</tr>{rows}</table>{note}{figure}"
        f"<p class='ci'>{_e('Draws on each worker’s clock, broadcasts on the trainer’s; rank 0’s workers.')}</p>"
    )
