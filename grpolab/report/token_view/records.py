"""The records of ``--log-token-credit``: what each quantity means, reading ``token_credit.jsonl``, choosing the
rollouts of a step, the colour scale and the per-token text both views share."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from grpolab.common.jsonlines import read_jsonl

CREDIT_FILE = "token_credit.jsonl"
PER_TOKEN = ("ids", "segment", "dlogp", "logp", "logp_sampler", "entropy", "adv", "ratio", "clipped", "teacher")
POSITIVE_RGB = (31, 111, 235)  # blue: above the quantity's centre
NEGATIVE_RGB = (207, 34, 46)  # red: below it
SEQUENTIAL_RGB = (130, 80, 223)  # purple: distance from the centre, one direction
NEWLINE_MARK = "↵"  # drawn before each newline of a token's span, in its colour (on the page, by the CSS)
CONTEXT = "context"  # the segment of an episode's environment tokens: shown muted, never coloured
TERMINAL_MARKS = ("⟨eos⟩", "⟨∅⟩")  # a token with no text: the last one (end of sequence), any other


# ---------------------------------------------------------------- quantities


class Quantity(NamedTuple):
    """A per-token value to paint: ``diverging`` ones colour by the side of ``centre`` (blue above, red below),
    sequential ones by the distance from ``centre`` in one hue. ``fmt`` formats a value; ``high``/``low`` say what
    a value above/below the centre means."""

    label: str
    meaning: str
    diverging: bool
    centre: float
    fmt: str
    high: str
    low: str


QUANTITIES: dict[str, Quantity] = {
    "dlogp": Quantity(
        "change of log-prob",
        "log pi_after(token) - log pi_before(token): what the step's update did to the token (default)",
        True,
        0.0,
        "+.4f",
        "made more likely by the update",
        "made less likely",
    ),
    "adv": Quantity(
        "advantage in the loss",
        "the advantage the loss gave the token (0 where the token carried no loss)",
        True,
        0.0,
        "+.3f",
        "reinforced (advantage > 0)",
        "discouraged (advantage < 0)",
    ),
    "teacher": Quantity(
        "teacher's term",
        "with --teacher: the teacher's part of the token's advantage (rkl-reward: coef x clip(log pi_teacher - log "
        "pi_sampler)), or the divergence from the teacher there (rkl, fkl, jsd); GRPO's own advantage is the same for "
        "every token of a rollout",
        True,
        0.0,
        "+.3f",
        "the teacher finds the token likelier than the student did",
        "the teacher finds it less likely",
    ),
    "ratio": Quantity(
        "importance ratio",
        "pi/pi_old at the update; uncoloured where the token carried no loss",
        True,
        1.0,
        ".3f",
        "ratio > 1 (the policy already favours the token more than the sampler did)",
        "ratio < 1",
    ),
    "entropy": Quantity(
        "sampler entropy",
        "entropy (nats) of the sampler's next-token distribution at the token",
        False,
        0.0,
        ".3f",
        "darker: a less certain sampler",
        "",
    ),
    "logp": Quantity(
        "log-prob before the update",
        "the trainer's log-prob of the token before the update",
        False,
        0.0,
        ".3f",
        "",
        "darker: a less likely token",
    ),
    "logp_sampler": Quantity(
        "sampler log-prob",
        "the rollout engine's log-prob of the token when it was sampled",
        False,
        0.0,
        ".3f",
        "",
        "darker: a less likely token",
    ),
    "prob_change": Quantity(
        "change of probability",
        "exp(logp + dlogp) - exp(logp): the token's probability after the update minus before",
        True,
        0.0,
        "+.4f",
        "probability rose",
        "probability fell",
    ),
}


def quantity_of(name: str) -> Quantity:
    """The quantity called ``name``; a ValueError naming the choices otherwise."""
    if name not in QUANTITIES:
        raise ValueError(f"unknown quantity {name!r}; choose from {', '.join(QUANTITIES)}")
    return QUANTITIES[name]


def number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def is_context(record: dict, i: int) -> bool:
    """Whether token ``i`` is an episode's environment token (context, with no values)."""
    return value_at(record, "segment", i) == CONTEXT


def value_at(record: dict, key: str, i: int):
    """Token ``i``'s entry of the per-token list ``key`` (None where the list is null or missing)."""
    values = record.get(key)
    return values[i] if isinstance(values, list) else None


def token_values(record: dict, quantity: str) -> list[float | None]:
    """One value of ``quantity`` per completion token, ``[T]``; None where the run recorded none."""
    quantity_of(quantity)
    n = len(record["tokens"])
    if quantity == "prob_change":
        out = []
        for i in range(n):
            lp, d = number(value_at(record, "logp", i)), number(value_at(record, "dlogp", i))
            out.append(None if lp is None or d is None else math.exp(lp + d) - math.exp(lp))
        return out
    return [number(value_at(record, quantity, i)) for i in range(n)]


def fmt(v, spec: str) -> str:
    v = number(v)
    if v is None:
        return "–"
    if v != 0 and abs(v) < 1e-3:
        return format(v, ("+" if spec.startswith("+") else "") + ".2e")
    return format(v, spec)


# ---------------------------------------------------------------- reading


def _record_problem(obj) -> str | None:
    """Why ``obj`` is not a usable token-credit record (None when it is)."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if not isinstance(obj.get("step"), int) or isinstance(obj.get("step"), bool):
        return "no integer step"
    tokens, completion = obj.get("tokens"), obj.get("completion")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or not isinstance(completion, str):
        return "no tokens list of strings or no completion"
    if "".join(tokens) != completion:
        return "the tokens' spans do not join to the completion"
    if number(obj.get("advantage")) is None:
        return "no numeric advantage"
    if not isinstance(obj.get("dlogp"), list):
        return "no dlogp list"
    for key in PER_TOKEN:
        if isinstance(obj.get(key), list) and len(obj[key]) != len(tokens):
            return f"{key} has {len(obj[key])} entries for {len(tokens)} tokens"
    return None


def read_token_credit(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The records of ``RUN_DIR/token_credit.jsonl`` (or of that file given itself), in file order.

    Malformed lines are skipped and reported through ``warn`` (default: ``warnings.warn``) in one message
    with their count, never silently. A missing file raises FileNotFoundError saying how to record one.
    """
    path = Path(run_dir)
    path = path if path.is_file() else path / CREDIT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no per-token credit recorded in this run; train with `grpolab train --log-token-credit K` "
            "to record K rollouts per step"
        )
    records, skipped = read_jsonl(path, _record_problem)
    if skipped:
        message = f"{path.name}: skipped {len(skipped)} malformed line(s) ({'; '.join(skipped[:3])}"
        message += ", ...)" if len(skipped) > 3 else ")"
        (warn or (lambda m: warnings.warn(m, stacklevel=3)))(message)
    return records


def recorded_steps(records: Iterable[dict]) -> list[int]:
    """The steps that have records, ascending."""
    return sorted({r["step"] for r in records})


def resolve_step(records: Sequence[dict], step: int | None = None) -> int:
    """``step`` if it was recorded, the last recorded step if None; a ValueError naming the nearest otherwise."""
    steps = recorded_steps(records)
    if not steps:
        raise ValueError("token_credit.jsonl holds no records")
    if step is None:
        return steps[-1]
    if step not in steps:
        nearest = sorted(sorted(steps, key=lambda s: (abs(s - step), s))[:3])
        raise ValueError(
            f"step {step} was not recorded; nearest recorded steps: {', '.join(map(str, nearest))} "
            f"({len(steps)} recorded, {steps[0]} to {steps[-1]})"
        )
    return step


class AdvantageSplit(NamedTuple):
    """A step's records by the sign of their advantage, each list strongest first (then by prompt, rollout)."""

    step: int
    positive: list[dict]
    negative: list[dict]
    zero: list[dict]


def split_by_advantage(records: Iterable[dict], step: int) -> AdvantageSplit:
    """The records of ``step`` with positive, negative and zero advantage."""
    at = sorted(
        (r for r in records if r["step"] == step),
        key=lambda r: (-abs(r["advantage"]), r.get("prompt", 0), r.get("rollout", 0)),
    )
    return AdvantageSplit(
        step,
        [r for r in at if r["advantage"] > 0],
        [r for r in at if r["advantage"] < 0],
        [r for r in at if r["advantage"] == 0],
    )


def select_rollout(records: Iterable[dict], step: int, prompt: int, rollout: int) -> dict:
    """The record of rollout ``rollout`` of prompt ``prompt`` at ``step``; a ValueError listing those recorded."""
    at = [r for r in records if r["step"] == step]
    for r in at:
        if r.get("prompt") == prompt and r.get("rollout") == rollout:
            return r
    have = ", ".join(f"{r.get('prompt')}:{r.get('rollout')}" for r in at)
    raise ValueError(f"no rollout {prompt}:{rollout} at step {step}; recorded there (PROMPT:ROLLOUT): {have}")


# ---------------------------------------------------------------- colour scale


class ColourScale(NamedTuple):
    """Maps a value to a level: in [-1, 1] for a diverging quantity (the sign: the side of ``centre``), in [0, 1]
    for a sequential one (the distance from ``centre`` towards ``direction``). ``span``: the distance at which the
    colour saturates (values beyond are clamped); 0 when there is nothing to colour."""

    quantity: str
    centre: float
    span: float
    diverging: bool
    direction: float = 1.0

    def level(self, v: float | None) -> float | None:
        if v is None or self.span <= 0:
            return None
        x = (v - self.centre) / self.span
        if self.diverging:
            return max(-1.0, min(1.0, x))
        return max(0.0, min(1.0, x * self.direction))

    def ends(self) -> tuple[float, float]:
        """The values at the two ends of the legend's bar, low to high level."""
        if self.diverging:
            return self.centre - self.span, self.centre + self.span
        return self.centre, self.centre + self.direction * self.span


def colour_scale(values: Iterable[float | None], quantity: str, percentile: float = 98.0) -> ColourScale:
    """One scale for every token shown: ``span`` is the ``percentile`` of |v - centre| over ``values`` (so one
    outlier does not wash the rest out), or their largest when that percentile is 0 (mostly-exact values)."""
    q = quantity_of(quantity)
    dev = np.array([v - q.centre for v in values if v is not None], dtype=np.float64)  # [M]
    if dev.size == 0:
        return ColourScale(quantity, q.centre, 0.0, q.diverging)
    direction = 1.0 if q.diverging or np.median(dev) >= 0 else -1.0
    mag = np.abs(dev)
    span = float(np.percentile(mag, percentile))
    return ColourScale(quantity, q.centre, span if span > 0 else float(mag.max()), q.diverging, direction)


def hue(scale: ColourScale, level: float) -> tuple[int, int, int]:
    if not scale.diverging:
        return SEQUENTIAL_RGB
    return POSITIVE_RGB if level > 0 else NEGATIVE_RGB


def css_background(scale: ColourScale, level: float | None) -> str:
    """The token's CSS background on a white page: the hue at an opacity of 0.85 |level| ("" when uncoloured)."""
    if level is None or level == 0:
        return ""
    r, g, b = hue(scale, level)
    return f"background-color:rgba({r},{g},{b},{0.85 * abs(level):.3f})"


def terminal_style(scale: ColourScale, level: float | None) -> str:
    """The token's rich style: white on the hue darkened towards black by 1 - |level|, made for a dark terminal
    (a level under 0.05 is left uncoloured)."""
    if level is None or abs(level) < 0.05:
        return ""
    r, g, b = (round(c * abs(level)) for c in hue(scale, level))
    return f"bright_white on rgb({r},{g},{b})"


# ---------------------------------------------------------------- per-token text


def _prob(lp) -> str:
    lp = number(lp)
    return "–" if lp is None else f"{math.exp(lp):.3f}"


def token_title(record: dict, i: int) -> str:
    """Token ``i``'s values, one line per group, for a hover title or a tooltip."""
    tok, lp, d = record["tokens"][i], value_at(record, "logp", i), value_at(record, "dlogp", i)
    after = None if number(lp) is None or number(d) is None else lp + d
    clipped = value_at(record, "clipped", i)
    what = "" if tok else (" (end of sequence)" if i == len(record["tokens"]) - 1 else " (no text of its own)")
    return "\n".join(
        [
            f"{tok!r}{what}  token {i}, id {value_at(record, 'ids', i)}, {value_at(record, 'segment', i) or '–'}",
            f"dlogp {fmt(d, '+.4f')}   p {_prob(lp)} -> {_prob(after)}",
            f"adv {fmt(value_at(record, 'adv', i), '+.3f')}   ratio {fmt(value_at(record, 'ratio', i), '.3f')}"
            f"   clipped {'–' if clipped is None else ('yes' if clipped else 'no')}",
            f"entropy {fmt(value_at(record, 'entropy', i), '.3f')}   logp {fmt(lp, '.3f')}"
            f"   sampler logp {fmt(value_at(record, 'logp_sampler', i), '.3f')}",
        ]
    )


def _mean(values: Iterable[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return sum(vs) / len(vs) if vs else None


def pictures_note(record: dict) -> str:
    """`` [2 pictures]`` after the question of a rollout whose prompt had pictures, for a view that cannot draw them
    (the terminal, the figure); "" for a text prompt."""
    n = len(record.get("images") or [])
    return f" [{n} picture{'s' if n != 1 else ''}]" if n else ""


def rollout_head(record: dict, quantity: str) -> str:
    reward = number(record.get("reward"))
    mean = _mean(token_values(record, quantity))
    return (
        f"step {record['step']} · prompt {record.get('prompt', '?')} · rollout {record.get('rollout', '?')} · "
        f"reward {'–' if reward is None else f'{reward:g}'} · advantage {record['advantage']:+.3f} · "
        f"{len(record['tokens'])} tokens · mean {quantity} {fmt(mean, quantity_of(quantity).fmt)}"
    )
