"""The report's section: recorded rollouts as HTML, each token painted by a quantity, and the credit/* aggregates
over training as a figure."""

from __future__ import annotations

import io
import math
from pathlib import Path

from grpolab.common.jsonlines import read_jsonl, step_record
from grpolab.report.markup import escape as _e
from grpolab.report.markup import png_img, thumbnails
from grpolab.report.token_view.records import (
    CREDIT_FILE,
    AdvantageSplit,
    ColourScale,
    colour_scale,
    css_background,
    fmt,
    is_context,
    number,
    quantity_of,
    read_token_credit,
    recorded_steps,
    rollout_head,
    split_by_advantage,
    token_title,
    token_values,
)

# ---------------------------------------------------------------- HTML

TOKEN_CSS = """
.tc-cols { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; align-items: start; }
.tc-col h4 { margin: .4em 0; } .tc-pos h4 { color: #1f6feb; } .tc-neg h4 { color: #cf222e; }
.tc-roll { border: 1px solid #d0d7de; border-radius: 6px; padding: .5em .7em; margin-bottom: .8em; }
.tc-head { margin: 0 0 .3em; font-size: .88em; color: #57606a; font-variant-numeric: tabular-nums; }
.tc-q { margin: 0 0 .4em; }
.tc-text { font: 13px/1.7 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap;
           word-break: break-word; }
.tok { border-radius: 2px; } .tok .nl::before { content: "↵"; color: #8c959f; }
.tok.ctx { color: #8c959f; background: #f6f8fa; }
.tok-mark { font-size: .72em; color: #57606a; border: 1px dashed #8c959f; border-radius: 3px; padding: 0 .25em;
            margin: 0 .15em; user-select: none; }
.tc-bar { display: inline-flex; vertical-align: middle; margin: 0 .4em; border: 1px solid #d0d7de; }
.tc-bar span { display: inline-block; width: 1.5em; height: 1em; }
"""


def _token_spans_html(record: dict, scale: ColourScale, values: list[float | None]) -> str:
    """The completion as one ``<span>`` per token: the text spans join to the completion exactly; a token with
    no text is a ``tok-mark`` box that is not part of it."""
    parts, last = [], len(record["tokens"]) - 1
    for i, tok in enumerate(record["tokens"]):
        context = is_context(record, i)  # an episode's environment tokens: muted, and no box for a template's marker
        if context and tok == "":
            continue
        style = css_background(scale, scale.level(values[i]))
        attrs = f' style="{style}"' if style else ""
        title = _e(token_title(record, i))
        if tok == "":
            parts.append(f'<span class="tok-mark"{attrs} title="{title}">{"eos" if i == last else "∅"}</span>')
        else:
            text = _e(tok).replace("\n", '<span class="nl">\n</span>')  # the CSS draws a ↵ before each newline
            parts.append(f'<span class="tok{" ctx" if context else ""}"{attrs} title="{title}">{text}</span>')
    return "".join(parts)


def _rollout_html(record: dict, scale: ColourScale, run_dir: Path) -> str:
    """One rollout's card: its header, its prompt's pictures (thumbnails, as the samples table shows them) and
    question, and its tokens coloured."""
    values = token_values(record, scale.quantity)
    return (
        f'<div class="tc-roll" data-step="{record["step"]}" data-prompt="{_e(record.get("prompt", ""))}" '
        f'data-rollout="{_e(record.get("rollout", ""))}">'
        f'<p class="tc-head">{_e(rollout_head(record, scale.quantity))}</p>'
        f"{thumbnails(record.get('images') or [], run_dir)}"
        f'<pre class="tc-q">{_e(record.get("question", ""))}</pre>'
        f'<div class="tc-text">{_token_spans_html(record, scale, values)}</div></div>'
    )


def _shown(split: AdvantageSplit, per_side: int) -> tuple[list[dict], list[dict]]:
    return split.positive[:per_side], split.negative[:per_side]


def _step_html(split: AdvantageSplit, scale: ColourScale, per_side: int, which: str, run_dir: Path) -> str:
    """A step's positive- and negative-advantage rollouts side by side."""
    pos, neg = _shown(split, per_side)

    def column(cls: str, title: str, shown: list[dict], total: int) -> str:
        cards = "".join(_rollout_html(r, scale, run_dir) for r in shown) or "<p>none recorded at this step</p>"
        return f'<div class="tc-col {cls}"><h4>{title} ({len(shown)} of {total})</h4>{cards}</div>'

    zero = f'<p class="sub">{len(split.zero)} recorded rollout(s) with advantage 0 not shown.</p>' if split.zero else ""
    return (
        f"<h3>Step {split.step} ({which})</h3>"
        f'<div class="tc-cols">{column("tc-pos", "advantage &gt; 0", pos, len(split.positive))}'
        f"{column('tc-neg', 'advantage &lt; 0', neg, len(split.negative))}</div>{zero}"
    )


def legend_html(scale: ColourScale) -> str:
    """The colour bar with the scale's values, and what the colours and the quantity mean."""
    q = quantity_of(scale.quantity)
    if scale.span <= 0:
        return f'<p class="sub">No values of <code>{_e(scale.quantity)}</code> were recorded for these tokens.</p>'
    levels = [k / 5 for k in range(-5, 6)] if scale.diverging else [k / 10 for k in range(11)]
    bar = "".join(f'<span style="{css_background(scale, lv)}"></span>' for lv in levels)
    lo, hi = scale.ends()
    colours = (
        f"blue: {q.high}; red: {q.low}" if scale.diverging else (q.high or q.low)
    ) + f"; beyond {fmt(scale.span, '.3g')} from {fmt(scale.centre, 'g')} the colour is clamped"
    return (
        f"<p><b>{_e(q.label)}</b> (<code>{_e(scale.quantity)}</code>) "
        f'{_e(fmt(lo, q.fmt))}<span class="tc-bar">{bar}</span>{_e(fmt(hi, q.fmt))}</p>'
        f'<p class="sub">{_e(q.meaning)}. Colours: {_e(colours)} (the scale: the 98th percentile over the tokens '
        'shown). Hover a token for its values; a dashed box (<span class="tok-mark">eos</span>) is a token with no '
        "text of its own, not part of the completion.</p>"
    )


_PANELS = (
    ("credit/sign_corr", "corr(dlogp, sign of advantage)", 0.0),
    ("credit/half_mass_frac", "tokens holding half the |dlogp|", 0.5),
    ("credit/abs_mean", "mean |dlogp|", None),
)


def _smoothed(ax, rows: list[dict], key: str, colour: str, label: str, ls: str = "-") -> bool:
    from grpolab.report.plotting import running_mean

    pts = [(r["step"], r[key]) for r in rows if number(r.get(key)) is not None]
    if not pts:
        return False
    x, y = [p[0] for p in pts], [p[1] for p in pts]
    ax.plot(x, y, color=colour, alpha=0.25, lw=0.8, ls=ls)
    ax.plot(x, running_mean(y, max(1, len(y) // 20)), color=colour, lw=1.4, ls=ls, label=label)
    return True


def credit_figure(rows: list[dict]) -> bytes | None:
    """The ``credit/*`` aggregates against step, as PNG bytes (None when none were logged): the |dlogp| shares of
    the answer, reasoning and format tokens (their token shares dashed), sign_corr, half_mass_frac, abs_mean and the
    mean dlogp of positive- and negative-advantage rollouts; a light rolling mean over each."""
    from grpolab.report.plotting import plt

    # the three segments, and the tokens the policy gave < 0.9 before the update (credit/low_p_*)
    segs = (("answer", "tab:green"), ("reasoning", "tab:blue"), ("format", "tab:orange"), ("low_p", "tab:gray"))
    panels = []
    if any(number(r.get(f"credit/{s}_share")) is not None for r in rows for s, _ in segs):
        panels.append("shares")
    panels += [p for p in _PANELS if any(number(r.get(p[0])) is not None for r in rows)]
    if any(number(r.get(k)) is not None for r in rows for k in ("credit/dlogp_pos", "credit/dlogp_neg")):
        panels.append("sides")
    if not panels:
        return None
    cols = min(3, len(panels))
    fig, axes = plt.subplots(
        math.ceil(len(panels) / cols), cols, figsize=(5 * cols, 3.4 * math.ceil(len(panels) / cols)), squeeze=False
    )
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    for ax, panel in zip(axes.flat, panels):
        if panel == "shares":
            for seg, colour in segs:
                name = "p < 0.9" if seg == "low_p" else seg
                _smoothed(ax, rows, f"credit/{seg}_share", colour, f"{name} |dlogp|")
                _smoothed(ax, rows, f"credit/{seg}_token_frac", colour, f"{name} tokens", ls="--")
            ax.set_title("share of |dlogp| by segment (dashed: of tokens)", fontsize=9)
            ax.set_ylim(-0.02, 1.02)
        elif panel == "sides":
            _smoothed(ax, rows, "credit/dlogp_pos", "tab:blue", "advantage > 0")
            _smoothed(ax, rows, "credit/dlogp_neg", "tab:red", "advantage < 0")
            ax.axhline(0.0, color="k", lw=0.6, ls=":")
            ax.set_title("mean dlogp per token, by advantage sign", fontsize=9)
        else:
            key, title, ref = panel
            _smoothed(ax, rows, key, "tab:purple", key)
            if ref is not None:
                ax.axhline(ref, color="k", lw=0.6, ls=":")
            ax.set_title(f"{title} ({key})", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows, _ = read_jsonl(path, step_record)
    return rows


def token_credit_html(run_dir: str | Path, quantity: str = "dlogp", per_side: int = 2) -> str:
    """The report's "Where the credit lands" section (its CSS is :data:`TOKEN_CSS`): for the first and the last
    recorded step, up to ``per_side`` positive- and negative-advantage rollouts side by side, every token coloured
    by ``quantity`` on one shared scale, then the ``credit/*`` aggregates of metrics.jsonl over training."""
    quantity_of(quantity)
    run_dir = Path(run_dir)
    notes: list[str] = []
    records = read_token_credit(run_dir, warn=notes.append)
    parts = [f'<p class="sub">{_e(n)}</p>' for n in notes]
    steps = recorded_steps(records)
    if steps:
        splits = [split_by_advantage(records, s) for s in dict.fromkeys((steps[0], steps[-1]))]
        shown = [r for sp in splits for side in _shown(sp, per_side) for r in side]
        scale = colour_scale((v for r in shown for v in token_values(r, quantity)), quantity)
        parts.append(
            f'<p class="sub">{len(records)} rollouts recorded over {len(steps)} steps (<code>{CREDIT_FILE}</code>); '
            "GRPO gives every token of a rollout the same advantage, the update does not move them equally.</p>"
        )
        parts.append(legend_html(scale))
        names = ["first recorded", "last recorded"] if len(splits) == 2 else ["the only recorded step"]
        parts += [_step_html(sp, scale, per_side, name, run_dir) for sp, name in zip(splits, names)]
    else:
        parts.append(f"<p>{CREDIT_FILE} holds no readable records.</p>")
    figure = credit_figure(_metric_rows(run_dir))
    if figure:
        parts.append(png_img(figure, "token credit over training"))
    return "".join(parts)


def credit_section(run_dir: str | Path, rows: list[dict], quantity: str = "dlogp") -> str:
    """The section's body for ``grpolab report``: :func:`token_credit_html` when the run has token_credit.jsonl,
    one line when only ``credit/*`` metrics were logged, "" when neither."""
    if (Path(run_dir) / CREDIT_FILE).is_file():
        return token_credit_html(run_dir, quantity)
    if any(k.startswith("credit/") for r in rows for k in r):
        return f"<p>credit/* metrics were logged but {CREDIT_FILE} is missing from the run directory.</p>"
    return ""
