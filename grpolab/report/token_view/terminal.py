"""``grpolab tokens``: recorded rollouts in a terminal, each token's background painted by a quantity, or plain text
with the values when stdout is not a terminal."""

from __future__ import annotations

import itertools
import textwrap
import unicodedata
from collections.abc import Sequence

from grpolab.probes.token_credit import turn_share_keys
from grpolab.report.token_view.records import (
    NEWLINE_MARK,
    QUANTITIES,
    TERMINAL_MARKS,
    ColourScale,
    colour_scale,
    fmt,
    hue,
    is_context,
    pictures_note,
    quantity_of,
    resolve_step,
    rollout_head,
    select_rollout,
    split_by_advantage,
    terminal_style,
    token_values,
    value_at,
)

# ---------------------------------------------------------------- terminal


def _visible(ch: str) -> str:
    """A control character as its Unicode picture (one cell, and no terminal escape reaches the terminal)."""
    if unicodedata.category(ch) != "Cc":
        return ch
    return chr(0x2400 + ord(ch)) if ord(ch) < 0x20 else "\ufffd"


def _styled_chars(record: dict, scale: ColourScale) -> list[tuple[str, str]]:
    """The completion as (character, style) pairs; "\\n" pairs break the line, after a ``↵`` in the token's colour;
    a token with no text is a marker (``⟨eos⟩`` at the end, ``⟨∅⟩`` elsewhere)."""
    out, values, last = [], token_values(record, scale.quantity), len(record["tokens"]) - 1
    for i, tok in enumerate(record["tokens"]):
        context = is_context(record, i)  # an episode's environment tokens: dim, and no marker for a template's token
        if context and tok == "":
            continue
        style = "dim" if context else terminal_style(scale, scale.level(values[i]))
        if tok == "":
            out += [(c, f"{style} italic" if style else "dim italic") for c in TERMINAL_MARKS[i != last]]
        for ch in tok:
            if ch == "\n":
                out += [(NEWLINE_MARK, style or "dim"), ("\n", "")]
            else:
                out.append((_visible(ch), style))
    return out


def wrap_cells(chars: Sequence[tuple[str, str]], width: int) -> list[list[tuple[str, str]]]:
    """Lines of at most ``width`` cells, broken at "\\n" and after the last whitespace that fits (inside a word
    when it has none); unlike a word wrap that trims, every character is kept, so the lines join to the text."""
    from rich.cells import cell_len

    lines: list[list[tuple[str, str]]] = []
    line: list[tuple[str, str]] = []
    used = 0
    for ch, style in chars:
        if ch == "\n":
            lines.append(line)
            line, used = [], 0
            continue
        w = cell_len(ch)
        if used + w > width and line:
            cut = max((k + 1 for k, (c, _) in enumerate(line) if c.isspace()), default=len(line))
            cut = len(line) if ch.isspace() else cut
            lines.append(line[:cut])
            line = line[cut:]
            used = sum(cell_len(c) for c, _ in line)
            if used + w > width:
                lines.append(line)
                line, used = [], 0
        line.append((ch, style))
        used += w
    lines.append(line)
    return lines


def _legend_text(scale: ColourScale):
    from rich.text import Text

    q = quantity_of(scale.quantity)
    head = Text(f"{q.label} ({scale.quantity}): {q.meaning}", style="bold")
    if scale.span <= 0:
        return [head, Text("no values recorded for these tokens: nothing is coloured")]
    levels = [k / 4 for k in range(-4, 5)] if scale.diverging else [k / 8 for k in range(9)]
    lo, hi = scale.ends()
    bar = Text(f"{fmt(lo, q.fmt)} ")
    for lv in levels:
        r, g, b = (round(c * abs(lv)) for c in hue(scale, lv or 1.0))
        bar.append("  ", style=f"on rgb({r},{g},{b})")
    bar.append(f" {fmt(hi, q.fmt)}  (clamped beyond; the 98th percentile of the tokens shown)")
    sides = f"blue: {q.high} · red: {q.low}" if scale.diverging else (q.high or q.low)
    return [head, bar, Text(f"{sides} · {NEWLINE_MARK}: a newline · {' '.join(TERMINAL_MARKS)}: a token with no text")]


def _terminal_rollout(record: dict, scale: ColourScale, width: int):
    from rich.text import Text

    body = Text()
    for k, line in enumerate(wrap_cells(_styled_chars(record, scale), width)):
        if k:
            body.append("\n")
        for style, run in itertools.groupby(line, key=lambda cs: cs[1]):  # one span per run of one style
            body.append("".join(ch for ch, _ in run), style=style or None)
    head = Text(rollout_head(record, scale.quantity), style="bold")
    return [head, Text(f"Q: {record.get('question', '')}{pictures_note(record)}", style="dim"), body]


def _crop(text: str, width: int, pad: bool = False) -> str:
    from rich.cells import cell_len, set_cell_size

    if cell_len(text) <= width:
        return set_cell_size(text, width) if pad else text
    return set_cell_size(text, width - 1) + "…"


def _plain_token_line(record: dict, i: int, quantity: str, width: int) -> str:
    """``   4  answer     ' 84'             dlogp=+0.0123  adv=+0.870  ratio=1.000``: the fields that fit."""
    from rich.cells import cell_len

    line = f"{i:>4}  {_crop(str(value_at(record, 'segment', i) or '–'), 9, True)}  {_crop(repr(record['tokens'][i]), 16, True)}"
    value = token_values(record, quantity)[i]
    fields = [f"{quantity}={fmt(value, quantity_of(quantity).fmt)}"]
    for key in ("dlogp", "adv", "ratio", *(["teacher"] if "teacher" in record else [])):
        if key != quantity:
            fields.append(f"{key}={fmt(value_at(record, key, i), QUANTITIES[key].fmt)}")
    if value_at(record, "clipped", i):
        fields.append("clipped")
    for f in fields:
        if cell_len(line) + 2 + len(f) > width:
            break
        line += "  " + f
    return _crop(line, width)


def plain_lines(rollouts: Sequence[dict], quantity: str, width: int = 80) -> list[str]:
    """The plain-text view: what the quantity means, then per rollout a header, its question and one line per
    token with its values; no line longer than ``width`` cells."""
    q = quantity_of(quantity)
    lines = textwrap.wrap(f"{q.label} ({quantity}): {q.meaning}", width)
    for r in rollouts:
        lines += [
            "",
            *textwrap.wrap(rollout_head(r, quantity), width),
            _crop(f"Q: {r.get('question', '')!r}{pictures_note(r)}", width),
        ]
        lines += [_plain_token_line(r, i, quantity, width) for i in range(len(r["tokens"]))]
    return lines


def render_terminal(
    records: Sequence[dict],
    step: int | None = None,
    quantity: str = "dlogp",
    console=None,
    width: int | None = None,
    *,
    plain: bool | None = None,
    rollout: tuple[int, int] | None = None,
) -> None:
    """Print the rollouts of ``step`` (default: the last recorded; ``rollout`` = (prompt, rollout) for one) with each
    token's background coloured by ``quantity`` on one scale, positive-advantage rollouts first, then negative, then
    zero. ``plain`` (default: when the console is not a terminal): plain text with the values, one line per token.
    Lines stay within ``width`` (default: the console's)."""
    from rich.console import Console
    from rich.text import Text

    quantity_of(quantity)
    step = resolve_step(records, step)
    if rollout is not None:
        shown = [select_rollout(records, step, *rollout)]
    else:
        shown = [r for side in split_by_advantage(records, step)[1:] for r in side]
    console = console or (Console(width=width) if width else Console())
    width = min(width or console.width, console.width)
    if console.is_terminal if plain is None else not plain:
        scale = colour_scale((v for r in shown for v in token_values(r, quantity)), quantity)
        for text in _legend_text(scale):
            console.print(text, width=width)
        for r in shown:
            head, question, body = _terminal_rollout(r, scale, width)
            console.print(Text(""), head, question, sep="\n", width=width)
            console.print(body, width=width, no_wrap=True, crop=True)  # wrapped already, every character kept
        return
    for line in plain_lines(shown, quantity, width):
        console.out(line, highlight=False)


SUMMARY_ROWS = (
    ("answer_share", "answer: share of |dlogp|"),
    ("answer_token_frac", "answer: share of tokens"),
    ("reasoning_share", "reasoning: share of |dlogp|"),
    ("reasoning_token_frac", "reasoning: share of tokens"),
    ("format_share", "format: share of |dlogp|"),
    ("format_token_frac", "format: share of tokens"),
    ("low_p_share", "p_before < 0.9: share of |dlogp|"),
    ("low_p_token_frac", "p_before < 0.9: share of tokens"),
    ("half_mass_frac", "tokens holding half of |dlogp|"),
    ("sign_corr", "corr(dlogp, sign of advantage)"),
    ("abs_mean", "mean |dlogp| per token"),
)


def summary_table(spans: list[dict]) -> str:
    """``grpolab tokens RUN --summary``: one column per span of steps, one row per aggregate, each ``mean [lo, hi]``
    (:func:`grpolab.probes.token_credit.summarise_credit`), as plain text."""
    head = ["aggregate (mean over steps, 95% interval)"] + [f"steps {s['first']}-{s['last']}" for s in spans]
    body = []
    turns = [(k, f"turn {k[4:-6]}: share of |dlogp|") for k in turn_share_keys(spans)]  # episodes
    for key, label in [*SUMMARY_ROWS, *turns]:
        cells = []
        for s in spans:
            v = s.get(key)
            cells.append("–" if v is None else f"{v[0]:.3g} [{v[1]:.3g}, {v[2]:.3g}]")
        body.append([label] + cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [head, *body]
    ]
    return "\n".join(lines)
