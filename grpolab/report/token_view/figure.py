"""``grpolab tokens RUN --png FILE``: a step's recorded rollouts as a picture, positive advantages on the left and
negative on the right, each character cell painted with its token's colour on the page's scale.

Drawn on a monospace grid with matplotlib (a picture goes where HTML cannot: a Markdown page, a slide); a token with
no text (end of sequence) is a cell of its own marked ``∅``, a newline a dimmed ``↵`` before the break.
"""

from __future__ import annotations

import io
import textwrap

from grpolab.report.token_view.records import (
    AdvantageSplit,
    ColourScale,
    colour_scale,
    fmt,
    hue,
    is_context,
    pictures_note,
    quantity_of,
    resolve_step,
    rollout_head,
    split_by_advantage,
    token_values,
)


def _cells(record: dict, scale: ColourScale, width: int) -> list[list[tuple[str, float | None, bool]]]:
    """The completion as lines of ``width`` cells: (character, level, marker?)."""
    lines: list[list] = [[]]
    for i, (span, v) in enumerate(zip(record["tokens"], token_values(record, scale.quantity))):
        if is_context(record, i) and not span:  # a chat template's marker in an episode's environment tokens
            continue
        level = scale.level(v)
        for ch in span or "∅":
            if ch == "\n":
                lines[-1].append(("↵", level, True))
                lines.append([])
                continue
            if len(lines[-1]) >= width:
                lines.append([])
            lines[-1].append((ch, level, not span))
    return lines


def _text_lines(record: dict, quantity: str, width: int) -> list[str]:
    """The rollout's header (as the page and the terminal write it) and its question, wrapped to ``width``."""
    return textwrap.wrap(rollout_head(record, quantity), width) + textwrap.wrap(
        "Q: " + repr(record["question"]) + pictures_note(record), width
    )


def _column(split: AdvantageSplit, per_side: int) -> list[list[dict]]:
    return [split.positive[:per_side], split.negative[:per_side]]


def tokens_figure(
    records: list[dict], step: int | None = None, quantity: str = "dlogp", per_side: int = 2, width: int = 56
) -> bytes:
    """PNG bytes: the step's first ``per_side`` positive- and negative-advantage rollouts, ``width`` characters a
    line, coloured on one scale (:func:`grpolab.report.token_view.records.colour_scale`) with its legend."""
    from grpolab.report.plotting import plt

    step = resolve_step(records, step)
    split = split_by_advantage(records, step)
    columns = _column(split, per_side)
    shown = [r for col in columns for r in col]
    scale = colour_scale([v for r in shown for v in token_values(r, quantity)], quantity)
    blocks = [[(r, _cells(r, scale, width)) for r in col] for col in columns]
    rows = max(sum(2 + len(_text_lines(r, quantity, width)) + len(c) for r, c in col) for col in blocks)
    fig = plt.figure(figsize=(2 * width * 0.105 + 0.6, (rows + 5) * 0.2))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 2 * width + 4)
    ax.set_ylim(rows + 5, 0)
    ax.axis("off")
    title = f"step {step}: {quantity_of(quantity).label}"
    ax.text(0.5, 1.0, title, fontsize=10, weight="bold", va="center")
    lo, hi = scale.ends()
    q = quantity_of(quantity)
    colours = f"blue: {q.high}, red: {q.low}" if q.diverging else f"purple: {q.high}"
    ax.text(0.5, 2.0, f"colour saturates at {fmt(lo, q.fmt)} .. {fmt(hi, q.fmt)}; {colours}", fontsize=8, va="center")
    for c, (col, heading) in enumerate(zip(blocks, ("advantage > 0", "advantage < 0"))):
        x0, y = 0.5 + c * (width + 3), 3.5
        ax.text(x0, y, heading, fontsize=9, weight="bold", va="center")
        y += 1
        for record, lines in col:
            for line in _text_lines(record, quantity, width):
                ax.text(x0, y, line, fontsize=7, va="center", color="#555", family="monospace")
                y += 1
            for line in lines:
                for i, (ch, level, marker) in enumerate(line):
                    if level:
                        r, g, b = hue(scale, level)
                        alpha = 0.85 * abs(level)
                        ax.add_patch(plt.Rectangle((x0 + i, y - 0.5), 1, 1, color=(r / 255, g / 255, b / 255, alpha)))
                    colour = "#999" if marker else "black"
                    ax.text(x0 + i + 0.5, y, ch, fontsize=8, ha="center", va="center", family="monospace", color=colour)
                y += 1
            y += 1
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
