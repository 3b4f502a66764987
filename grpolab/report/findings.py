"""The report's opening section: the doctor's findings (:mod:`grpolab.doctor`), each linked to a plot of the metrics
that show it, with its threshold drawn and the steps of its evidence shaded; and the pass@k figure of the
evaluation section.

Written by hand, as the rest of the page: ``html.escape`` guards every value taken from the run.
"""

from __future__ import annotations

from pathlib import Path

from grpolab.doctor.conditions import Finding
from grpolab.doctor.examine import examine, explained, summary_figures
from grpolab.report.markup import escape as _e
from grpolab.report.markup import png_img as _png

CSS = """
.finding { border-left: 4px solid #d0d7de; padding: .3em .8em; margin: .6em 0; background: #f6f8fa; }
.finding.error { border-color: #cf222e; } .finding.warning { border-color: #bf8700; } .finding.info { border-color: #0969da; }
.finding .sev { font-weight: 700; font-size: .8em; letter-spacing: .04em; margin-right: .5em; }
.finding.error .sev { color: #cf222e; } .finding.warning .sev { color: #9a6700; } .finding.info .sev { color: #0969da; }
.finding p { margin: .25em 0; } .healthy { color: #1a7f37; font-weight: 600; }
"""


def plotted_keys(rows: list[dict], finding: Finding) -> list[str]:
    """The metrics of ``finding`` that the run logged, at most 3: the panels of its figure."""
    return [k for k in finding.keys if any(r.get(k) is not None for r in rows)][:3]


def finding_figure(rows: list[dict], finding: Finding) -> bytes | None:
    """The metrics of ``finding`` against step (one panel each, at most 3), its threshold on the first panel and the
    steps of its evidence shaded; PNG bytes, None when the run logged none of them."""
    from grpolab.report.plotting import figure_png, plt

    keys = plotted_keys(rows, finding)
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 2.8), squeeze=False)
    for i, (ax, key) in enumerate(zip(axes.flat, keys)):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=2.5, lw=1, color="tab:blue")
        ax.axvspan(finding.steps[0], finding.steps[1], color="tab:orange", alpha=0.15, label="evidence")
        if i == 0 and finding.threshold is not None:
            ax.axhline(finding.threshold, color="tab:red", ls="--", lw=1, label=f"threshold {finding.threshold:g}")
        if key == "doctor/weight_change" and pts and min(p[1] for p in pts) > 0:
            ax.set_yscale("log")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return figure_png(fig, dpi=85)


def _finding_html(f: Finding, findings: list[Finding], has_plot: bool) -> str:
    when = f.when()
    link = f' · <a href="#doctor-{_e(f.name)}">the plot</a>' if has_plot else ""
    effects = explained(f, findings)
    parts = [
        f'<p><span class="sev">{_e(f.severity.upper())}</span><b>{_e(f.title)}</b> '
        f'<span class="ci">({_e(f.name)}{"; " + _e(when) if when else ""}){link}</span></p>',
        f"<p>Evidence: {_e(f.evidence)}</p>",
        f"<p>Change: <code>{_e(f.fix)}</code></p>",
    ]
    if effects:
        parts.insert(1, f"<p>The likely cause of: {_e(', '.join(effects))}</p>")
    if f.example:
        ex = f.example
        head = f"step {ex.get('step', '?')}: {ex.get('question', '')}"
        parts.append(
            f"<details><summary>example ({_e(ex['note'])})</summary><p>{_e(head)}</p>"
            f"<pre>{_e(ex.get('completion', ''))}</pre></details>"
        )
    return f'<div class="finding {_e(f.severity)}">{"".join(parts)}</div>'


def doctor_section(run_dir: str | Path) -> str:
    """The doctor's findings on the run in ``run_dir`` (most serious first), each linked to its plot below them; a
    healthy run's 'no problems found' with the figures that say so."""
    run, findings = examine(run_dir)
    figures = {f.name: finding_figure(run.rows, f) for f in findings}
    serious = [f for f in findings if f.severity != "info"]
    head = (
        ""
        if serious
        else '<p class="healthy">No problems found.</p><ul>'
        + "".join(f"<li>{_e(s)}</li>" for s in summary_figures(run))
        + "</ul>"
    )
    items = "".join(_finding_html(f, findings, figures[f.name] is not None) for f in findings)
    plots = "".join(
        f'<figure id="doctor-{_e(f.name)}">{_png(figures[f.name], f.name)}'
        f"<figcaption>{_e(f.title)}: {_e(', '.join(plotted_keys(run.rows, f)))}</figcaption></figure>"
        for f in findings
        if figures[f.name] is not None
    )
    note = (
        '<p class="sub">What <code>grpolab doctor RUN</code> prints: the checks replayed at every check step of the '
        "run; each finding's plot shades the steps of its evidence and draws its threshold.</p>"
    )
    return head + items + plots + note


def pass_k_figure(rows: list[dict]) -> bytes | None:
    """pass@k against k at the first and the last evaluation that logged it, with 95% intervals (PNG bytes)."""
    from grpolab.eval.accuracy import pass_ks
    from grpolab.report.plotting import figure_png, plt

    evals = [r for r in rows if pass_ks(r)]
    if not evals:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for row, colour in (
        ((evals[0], "tab:gray"), (evals[-1], "tab:blue")) if len(evals) > 1 else ((evals[0], "tab:blue"),)
    ):
        ks = pass_ks(row)
        y = [row[f"eval/pass@{k}"] for k in ks]
        lo = [y[i] - row.get(f"eval/pass@{k}_lo", y[i]) for i, k in enumerate(ks)]
        hi = [row.get(f"eval/pass@{k}_hi", y[i]) - y[i] for i, k in enumerate(ks)]
        ax.errorbar(ks, y, yerr=[lo, hi], marker="o", capsize=3, color=colour, label=f"step {row['step']}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(pass_ks(evals[-1]), [str(k) for k in pass_ks(evals[-1])])
    ax.set_xlabel("k (samples per question)")
    ax.set_ylabel("pass@k (held out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return figure_png(fig, dpi=90)


def pass_k_html(rows: list[dict]) -> str:
    """The pass@k figure with its one-line reading, or '' for a run whose evaluation logged no pass@k."""
    figure = pass_k_figure(rows)
    if figure is None:
        return ""
    return (
        f'<div id="passk">{_png(figure, "pass@k against k")}<p class="sub">pass@k: the chance that at least one of k '
        "samples is right, from each question's samples by the unbiased estimator, 95% intervals over questions. "
        "If RL sharpens the policy onto answers it could already find, pass@1 rises while pass@k at large k does "
        "not (or falls).</p></div>"
    )
