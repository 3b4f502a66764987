"""The conditions that keep a GRPO run from learning, each a pure function of the run's metric rows.

Each check takes the rows logged so far (``metrics.jsonl``'s, oldest first), the few options of the run it needs
(:class:`RunFacts`) and, when the run logged them, its rollouts (``rollouts.jsonl``'s records); it returns a
:class:`Finding` or None. A check looks at the last :data:`WINDOW` training steps unless it says otherwise, so what
it reports is the run's state, not one noisy step. Every threshold is a named constant with the reason for its value.

Severities: ``error``, the run cannot learn as it is set up; ``warning``, it learns less or wrongly; ``info``, a
fact worth acting on that is not a fault (a saturated run has done its work). :func:`diagnose` runs every check and
orders the findings most serious first and, within a severity, causes before their symptoms (a truncation before
the equal rewards it causes).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from grpolab.probes.signals import series

WINDOW = 5
"""Training steps a check reads: one step's 8-32 groups are too few to tell a trend from noise, and five let the
first check in training come at step 5."""
MIN_STEPS = 3
"""No check before the run has this many training steps."""

SEVERITIES = ("error", "warning", "info")
LEVEL = {"error": 3, "warning": 2, "info": 1}
"""A finding's severity as the number logged in ``doctor/<name>`` (0: not found at that check)."""

# ---------------------------------------------------------------- thresholds (each with why)
NO_SIGNAL_SHARE = 0.75
"""Share of groups with equal rewards (reward/frac_zero_std) above which the update is mostly empty: at a pass rate
p a group of G is all equal with probability p^G + (1-p)^G, under 0.06 for p in [0.3, 0.7] and G = 8; 0.75 means
at most a quarter of the rollouts carry an advantage."""
CONSTANT_STD = 1e-6
"""A reward whose spread over every rollout of a step (reward/std) stays below this is constant: float rounding."""
RIGHT_SHARE = 0.5
"""With equal rewards in most groups, a mean first reward (reward/accuracy) at or above this says they are mostly
all right; below, mostly all wrong."""
CONTRAST_CHANCE = 0.5
"""The group size recommended for a no-signal run gives a group a contrast (reward variance) with at least this
probability at the run's pass rate: 1 - p^G - (1-p)^G >= 0.5."""
MAX_GROUP = 64
"""The largest group size the doctor recommends; past it, the data's difficulty is the thing to change."""
RISE_SD = 0.5
"""The reward has risen when its mean over the last WINDOW steps exceeds its mean over the first by this many of the
start's rollout standard deviations (reward/std): scale-free, and well above the step-to-step noise of a window's
mean (about sd / sqrt(WINDOW * rollouts))."""
TRUNC_SHARE = 0.2
"""Share of completions stopped by --max-new-tokens (completion/truncated_frac) from which truncation is a warning:
one in five completions scored before it could answer."""
TRUNC_SEVERE = 0.8
"""Above this share, truncation is an error: most completions never reach an answer (TRL's old 256-token default cut
97-99% of reasoning completions)."""
TRUNC_GAP = 0.1
"""How much lower (in the first reward, for rewards in [0, 1]) the cut completions must score than the rest for a
share under TRUNC_SEVERE to be a warning: cut completions that score like the rest were cut after they went wrong
(a ramble on a short-answer task), and a longer limit would not raise the reward. Measured per step in training
(doctor/truncated_reward_gap), else from the logged rollouts; unknown: a warning."""
TRUNC_GAP_SHARE = 0.05
"""Under TRUNC_SHARE, from this share on, cut completions scoring TRUNC_GAP below the rest are reported as info."""
ERROR_SHARE = 0.5
"""Reward-function evaluations that raised or gave a non-finite value (reward/errors), as a share of all: above it
most rollouts are scored 0 for the function's fault, not the completion's."""
FORMAT_FLOOR = 0.1
"""With the built-in answer check: a share of well-formed answers (reward/format) and of right ones
(reward/accuracy) both at or below this says the check almost never finds an answer to compare."""
NO_MOVE_CHANGE = 1e-6
"""A relative weight change per step (doctor/weight_change) below this at every step of WINDOW: at that rate a
thousand steps move the weights by 0.1%. The built-in model's default --lr 5e-5 moves them 2e-4 to 5e-4 a step;
SmolLM2 at --lr 1e-5 2e-5 to 3e-5 (docs/doctor.md); the first step of a warm-up moves nothing (its learning rate is
0, as in transformers' schedules)."""
BIG_CHANGE = 0.03
"""A step that changes the weights by 3% (doctor/weight_change) is too big: the built-in model at --lr 1e-3 (20x its
default) moves 0.4-0.9% a step and still trains; at --lr 1e-2 it moves 6-9% and its answers are gone in two steps."""
RATIO_FLAT = 1e-7
"""With --mu > 1: a mean importance ratio within this of 1 (float rounding) over WINDOW steps says the policy did not
move between the step's epochs."""
KL_FLOOR = 1e-8
"""With --beta > 0: a KL to the reference below this (float rounding) after warm-up says the policy has not moved
from where it started."""
CLIP_HIGH = 0.2
"""Clipped share of tokens (loss/clip_frac) above which the step is too big: PPO-style runs clip a few percent; a
fifth of the tokens at the clip means most of the update is the clip's, not the gradient's."""
CLIP_SEVERE = 0.4
"""Above this clipped share (or with updates skipped for a non-finite loss) a too-big step is an error."""
RATIO_DRIFT = 0.1
"""|loss/ratio_mean - 1| above this: the policy moved 10% in probability per token within one step's epochs."""
KL_HIGH = 0.1
"""A KL to the reference above this (nats per token) that is also KL_GROWTH times what it was WINDOW steps before is
growing without bound."""
KL_GROWTH = 4.0
"""See KL_HIGH."""
GRAD_SPIKE = 10.0
"""A gradient norm this many times the median of the run's earlier ones is a spike (the pre-clip norm)."""
ENTROPY_START = 2
"""The run's starting entropy: the mean over its first this many steps (few: an overshooting update changes the
entropy within steps; the built-in model's step-to-step spread is about 5%)."""
ENTROPY_COLLAPSE = 0.1
"""Token entropy under this share of the start's, while the reward is below CEILING: the policy stopped exploring
before it learned the task (with the reward at its ceiling, a low entropy is what learning looks like)."""
ENTROPY_BLOWUP = 3.0
"""Token entropy above this multiple of the start's (and above ENTROPY_BLOWUP_FLOOR nats): the policy is drifting
towards noise."""
ENTROPY_BLOWUP_FLOOR = 1.0
"""See ENTROPY_BLOWUP: a start near 0 makes any rise a large multiple."""
MISMATCH_STD = 0.01
"""Spread of the per-token log-ratio of trainer to sampler (engine/logratio_std) above which the sampler's
mismatch biases the update unless corrected: an fp32 copy stays under 1e-4, a bf16 one is 0.05-0.3
(docs/precision.md), where the uncorrected step gradient was 19-49% off the exact one."""
CEILING = 0.9
"""A mean first reward (reward/accuracy) at or above this over WINDOW steps is near its ceiling (for rewards in
[0, 1])."""
RANK_FALL = 0.5
"""Saturation: the effective rank (probe/eff_rank) has gone this share of the way from its early value to 1, the
floor of any effective rank. On the last-letter runs of docs/foundations.md the rank's half-way fall came about 9
steps before the held-out accuracy saturated."""
RANK_POINTS = 2
"""Probes averaged for the rank's early and current values (each probe's mean over its groups)."""
HACK_RISE_SD = 1.0
"""Reward hacking: a training reward risen by this many start standard deviations (twice RISE_SD: the sign needs a
clear rise) while the held-out accuracy did not rise at all."""
LENGTH_DRIFT = 1.5
"""Completions this many times longer over the last WINDOW steps than over the first ..."""
LENGTH_CORR = 0.8
"""... with a correlation between mean length and mean reward over the steps at least this: the reward pays for
length."""
COMPONENT_SHARE = 0.8
"""One reward component (weighted) carrying this share of the reward's rise while the first (accuracy) reward did
not rise."""
IDENTICAL_SHARE = 0.5
"""With rollouts logged: at least this share of a step's groups with every completion identical (and the held-out
accuracy not rising): the policy collapsed to one answer per prompt."""


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """The options of a run that the checks read (from its config.json)."""

    max_new_tokens: int = 48
    group_size: int = 8
    lr: float = 5e-5
    warmup_steps: int = 0
    mu: int = 1
    beta: float = 0.0
    engine_correction: str = "none"
    answer_check: str = ""
    """'####' or 'boxed' when the run's accuracy is the built-in answer check; '' when a reward function replaces it
    or the task is an environment's."""
    reward_functions: int = 2
    """Functions scored per rollout (reward/errors counts their failures)."""
    reward_weights: tuple[float, ...] = ()
    components: tuple[str, ...] = ()
    """The reward/<name> keys of the functions after the first (their unweighted means), in order."""
    sampling: str = "fixed"

    @classmethod
    def of(cls, config: dict) -> RunFacts:
        fns = tuple(config.get("reward_fn") or ())
        fmt = config.get("format", "")
        multi = bool(config.get("env") or config.get("tools") or config.get("task") == "arith-multiturn")
        check = "" if fns or multi or fmt == "prompt" else ("boxed" if fmt == "math" else "####")
        names = tuple(_function_name(p) for p in fns)
        weights = tuple(config.get("reward_weights") or ()) or (1.0,) * len(fns)
        return cls(
            max_new_tokens=int(config.get("max_new_tokens", 48)),
            group_size=int(config.get("group_size", 8)),
            lr=float(config.get("lr", 5e-5)),
            warmup_steps=int(config.get("warmup_steps", 0)),
            mu=int(config.get("mu", 1)),
            beta=float(config.get("beta", 0.0)),
            engine_correction=str(config.get("engine_correction", "none")),
            answer_check=check,
            reward_functions=len(fns) if fns else 2,
            reward_weights=weights,
            components=names[1:],
            sampling=str(config.get("sampling", "fixed")),
        )


def _function_name(path: str) -> str:
    return str(path).rsplit(":", 1)[-1].rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One condition found in a run."""

    name: str
    """The condition's id: the check's name (``doctor/<name>`` in the metrics)."""
    severity: str
    """'error', 'warning' or 'info'."""
    title: str
    """One line naming it."""
    evidence: str
    """Which metric, over which steps, against what threshold."""
    fix: str
    """One concrete change: a flag and a value, or what to check."""
    keys: tuple[str, ...]
    """The metrics that show it (what the report plots for it)."""
    steps: tuple[int, int]
    """The steps the evidence covers."""
    threshold: float | None = None
    """The threshold the main metric crossed (drawn on the report's plot)."""
    example: dict | None = None
    """From the run's own samples, where one shows it (filled by :mod:`grpolab.doctor.examine`)."""
    first_step: int | None = None
    """The check step at which it was first found (filled when a run is replayed)."""
    ongoing: bool = True
    """Still found at the run's last check (filled when a run is replayed)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- reading rows


def training_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows of training steps (an evaluation-only row, such as step 0's, has no reward/mean)."""
    return [r for r in rows if r.get("reward/mean") is not None]


def _window(rows: Sequence[dict]) -> list[dict]:
    t = training_rows(rows)
    return t[-WINDOW:] if len(t) >= MIN_STEPS else []


def _values(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def _mean(rows: Sequence[dict], key: str) -> float | None:
    v = _values(rows, key)
    return statistics.fmean(v) if v else None


def _span(rows: Sequence[dict]) -> tuple[int, int]:
    return rows[0]["step"], rows[-1]["step"]


def _steps(rows: Sequence[dict]) -> str:
    a, b = _span(rows)
    return f"step {a}" if a == b else f"steps {a}-{b}"


def reward_rise(rows: Sequence[dict]) -> tuple[float, float] | None:
    """(rise, start sd): the mean reward over the last WINDOW training steps minus that over the first WINDOW, and the
    mean rollout standard deviation (reward/std) of the first WINDOW. None before 2 * WINDOW steps."""
    t = training_rows(rows)
    if len(t) < 2 * WINDOW:
        return None
    first, last = t[:WINDOW], t[-WINDOW:]
    return _mean(last, "reward/mean") - _mean(first, "reward/mean"), _mean(first, "reward/std") or 0.0


def learned(rows: Sequence[dict], sds: float = RISE_SD) -> bool:
    """Has the training reward risen by ``sds`` start standard deviations (and by something)?"""
    rise = reward_rise(rows)
    return rise is not None and rise[0] > 0 and rise[0] >= sds * rise[1]


def held_out(rows: Sequence[dict]) -> tuple[dict, dict] | None:
    """The first and last rows with a greedy held-out accuracy, when there are two."""
    evals = [r for r in rows if r.get("eval/accuracy_greedy") is not None]
    return (evals[0], evals[-1]) if len(evals) >= 2 else None


def held_out_rose(rows: Sequence[dict]) -> bool:
    """Did the held-out greedy accuracy rise beyond its first evaluation's 95% interval?"""
    pair = held_out(rows)
    if pair is None:
        return False
    first, last = pair
    return last["eval/accuracy_greedy"] > first.get("eval/accuracy_greedy_hi", first["eval/accuracy_greedy"])


def contrast_group_size(p: float, current: int) -> int | None:
    """The smallest power-of-two group size above ``current`` (at most MAX_GROUP) whose groups hold a contrast with
    probability CONTRAST_CHANCE at pass rate ``p``: 1 - p^G - (1-p)^G. None if none does."""
    g = 2 ** math.ceil(math.log2(max(current, 1) + 1))
    while g <= MAX_GROUP:
        if 1 - p**g - (1 - p) ** g >= CONTRAST_CHANCE:
            return g
        g *= 2
    return None


# ---------------------------------------------------------------- the checks


def no_signal(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Most groups have equal rewards (all right, all wrong, or a constant reward): little or no advantage to learn
    from. A run whose reward rose before its groups ran out of contrast is saturation's case, not this one."""
    w = _window(rows)
    zero = _mean(w, "reward/frac_zero_std")
    fixed = constant_accuracy(w)
    if fixed is not None and not learned(rows):
        return _task_blind(w, fixed)
    if zero is None or zero < NO_SIGNAL_SHARE or learned(rows):
        return None
    p = _mean(w, "reward/accuracy")
    p = 0.0 if p is None else min(max(p, 0.0), 1.0)
    evidence = f"reward/frac_zero_std {zero:.2f} over {_steps(w)} (threshold {NO_SIGNAL_SHARE})"
    keys = ("reward/frac_zero_std", "reward/mean")
    if all(r.get("reward/std") is not None and r["reward/std"] < CONSTANT_STD for r in w):
        value = _mean(w, "reward/mean")
        return Finding(
            "no_signal", "error", f"No signal: every completion gets the same reward, {value:.3g}",
            f"{evidence}; reward/std < {CONSTANT_STD:g} at every step",
            "check the reward function on a right and a wrong completion (a TRL-form function gets the columns it "
            "names as keyword lists); if it is right, every answer is wrong: easier data or --few-shot 2",
            keys, _span(w), NO_SIGNAL_SHARE,
        )  # fmt: skip
    g = contrast_group_size(p, facts.group_size)
    bigger = (
        f"--group-size {g} (a group then holds a contrast with probability >= {CONTRAST_CHANCE:g} at pass rate {p:.2f})"
        if g
        else None
    )
    adaptive = "--sampling adaptive (draws more rollouts only for the groups with no contrast yet)"
    if p >= RIGHT_SHARE:
        title, data = "No signal: most groups are all right", "harder data (drop the prompts the policy always solves)"
    else:
        title, data = "No signal: most groups are all wrong", "easier data, --few-shot 2, or a supervised warm start"
    fixes = [f for f in (bigger, adaptive if facts.sampling != "adaptive" else None, data) if f]
    return Finding(
        "no_signal", "error", title, f"{evidence}; reward/accuracy {p:.2f}",
        "; or ".join(fixes), keys, _span(w), NO_SIGNAL_SHARE,
    )  # fmt: skip


def constant_accuracy(w: Sequence[dict]) -> float | None:
    """0 or 1 when the first reward function (reward/accuracy) gave that same value to every rollout of every step of
    ``w`` (its mean is exactly 0 or 1: rewards in [0, 1]); None otherwise."""
    acc = [r.get("reward/accuracy") for r in w]
    if not w or any(a is None for a in acc) or len(set(acc)) != 1 or acc[0] not in (0, 1):
        return None
    return float(acc[0])


def _task_blind(w: Sequence[dict], value: float) -> Finding:
    """no_signal's finding for a first reward that is the same for every rollout (other terms may still vary)."""
    others = _mean(w, "reward/std") or 0.0
    rest = (
        f"; the total reward still varies (reward/std {others:.3g}): the update learns the other terms (format), not "
        "the task"
        if others >= CONSTANT_STD
        else ""
    )
    if value == 1:
        title, fix = (
            "No signal: the first reward function gives every completion 1",
            "check the reward function on a wrong completion: it should score 0; if it does, the data is too easy "
            "(harder data)",
        )
    else:
        title, fix = (
            "No signal: the first reward function gives every completion 0",
            "check the reward function on a right completion; if it pays, every answer is wrong: easier data, "
            "--few-shot 2, or a supervised warm start",
        )
    return Finding(
        "no_signal", "error", title,
        f"reward/accuracy exactly {value:g} at every step of {_steps(w)}{rest}",
        fix, ("reward/accuracy", "reward/frac_zero_std"), _span(w),
    )  # fmt: skip


def truncation(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Completions stopped by --max-new-tokens: an error when most are; a warning when TRUNC_SHARE are and they score
    TRUNC_GAP below the rest (or their scores are unknown); info when they score like the rest, or when fewer are cut
    but those score lower."""
    w = _window(rows)
    share = _mean(w, "completion/truncated_frac")
    if share is None or share < TRUNC_GAP_SHARE:
        return None
    gap = _mean(w, "doctor/truncated_reward_gap")
    if gap is None:
        gap = truncated_gap([r for r in rollouts if r["step"] <= w[-1]["step"]], facts.max_new_tokens)
    if share >= TRUNC_SEVERE:
        severity = "error"
    elif share >= TRUNC_SHARE:
        severity = "warning" if gap is None or gap >= TRUNC_GAP else "info"
    elif gap is not None and gap >= TRUNC_GAP:
        severity = "info"
    else:
        return None
    length = recommended_length(facts.max_new_tokens, share)
    evidence = (
        f"completion/truncated_frac {share:.2f} over {_steps(w)} (threshold {TRUNC_SHARE}; --max-new-tokens "
        f"{facts.max_new_tokens})"
    )
    if gap is not None:
        evidence += f"; the cut completions score {gap:.2f} below the rest (threshold {TRUNC_GAP})"
    return Finding(
        "truncation", severity,
        f"Truncation: {100 * share:.0f}% of completions stop at --max-new-tokens {facts.max_new_tokens}",
        evidence,
        f"--max-new-tokens {length} (completions cut before their answer are scored as wrong; "
        "--mask-truncated leaves them out of the loss)",
        ("completion/truncated_frac", "doctor/truncated_reward_gap", "completion/len_mean"), _span(w), TRUNC_SHARE,
    )  # fmt: skip


def recommended_length(max_new_tokens: int, share: float) -> int:
    """A power of two at least twice ``max_new_tokens`` (four times when at least TRUNC_SEVERE of completions are cut:
    their length is unknown beyond the limit)."""
    factor = 4 if share >= TRUNC_SEVERE else 2
    return 2 ** math.ceil(math.log2(max(max_new_tokens, 1) * factor))


def truncated_gap(rollouts: Sequence[dict], max_new_tokens: int) -> float | None:
    """From logged rollouts (their total reward): the mean reward of those that ended before ``max_new_tokens`` minus
    that of those cut by it (``tokens >= max_new_tokens``), over the last WINDOW logged steps; None unless both kinds
    are there."""
    steps = set(sorted({r["step"] for r in rollouts})[-WINDOW:])
    last = [r for r in rollouts if r["step"] in steps and "tokens" in r]
    cut = [r["reward"] for r in last if r["tokens"] >= max_new_tokens]
    rest = [r["reward"] for r in last if r["tokens"] < max_new_tokens]
    if not cut or not rest:
        return None
    return statistics.fmean(rest) - statistics.fmean(cut)


def reward_blind(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The reward never sees an answer: reward-function errors dominate, or the built-in answer check finds almost no
    well-formed answer."""
    w = _window(rows)
    if not w:
        return None
    errors = sum(_values(w, "reward/errors"))
    scored = sum(_values(w, "sampling/rollouts")) * max(facts.reward_functions, 1)
    if scored and errors / scored >= ERROR_SHARE:
        return Finding(
            "reward_blind", "error",
            f"The reward never sees an answer: the reward function failed on {100 * errors / scored:.0f}% of "
            "rollouts",
            f"reward/errors {errors:.0f} of {scored:.0f} evaluations over {_steps(w)} (threshold {ERROR_SHARE})",
            "fix the reward function's exception (the run's log names it at the first failure); a failed "
            "evaluation scores 0",
            ("reward/errors", "reward/mean"), _span(w), ERROR_SHARE,
        )  # fmt: skip
    fmt, acc = _mean(w, "reward/format"), _mean(w, "reward/accuracy")
    if not facts.answer_check or fmt is None or fmt > FORMAT_FLOOR or (acc or 0.0) > FORMAT_FLOOR:
        return None
    want = "a \\boxed{...} answer" if facts.answer_check == "boxed" else "a final line '#### <number>'"
    return Finding(
        "reward_blind", "error",
        f"The reward never sees an answer: {100 * (1 - fmt):.0f}% of completions have no well-formed answer",
        f"reward/format {fmt:.2f} and reward/accuracy {acc or 0.0:.2f} over {_steps(w)} (threshold {FORMAT_FLOOR})",
        f"make the prompt ask for {want} (--system-prompt, --few-shot 2), or give a --reward-fn that reads the "
        "answer in the form the model writes",
        ("reward/format", "reward/accuracy"), _span(w), FORMAT_FLOOR,
    )  # fmt: skip


def no_movement(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The policy does not move: a learning rate of 0, or (where they can show it) a ratio that stays at 1 across a
    step's epochs and a KL that stays at 0."""
    w = _window(rows)
    if not w:
        return None
    if all(r.get("charts/lr") == 0 for r in w):
        return Finding(
            "no_movement", "error", "No movement: the learning rate is 0",
            f"charts/lr 0 over {_steps(w)}",
            f"--lr {5e-5 if facts.lr <= 0 else facts.lr * 10:g} (the built-in model trains at 5e-5, 100M-1B models at "
            "1e-6 to 1e-5)",
            ("charts/lr", "reward/mean"), _span(w), 0.0,
        )  # fmt: skip
    signal = _mean(w, "reward/frac_zero_std")
    if signal is not None and signal >= NO_SIGNAL_SHARE:
        return None  # the advantages are (mostly) 0: no_signal says why
    change = _values(w, "doctor/weight_change")
    if len(change) == len(w) and all(v < NO_MOVE_CHANGE for v in change):
        return Finding(
            "no_movement", "error", "No movement: the update does not change the weights",
            f"doctor/weight_change at most {max(change):.2g} per step over {_steps(w)} (threshold {NO_MOVE_CHANGE:g})",
            f"--lr {facts.lr * 100:g} (the built-in model trains at 5e-5, 100M-1B models at 1e-6 to 1e-5; bf16 "
            "weights cannot register steps much under 1e-3 of their size: --dtype float32)",
            ("doctor/weight_change", "charts/lr"), _span(w), NO_MOVE_CHANGE,
        )  # fmt: skip
    ratio = _values(w, "loss/ratio_mean")
    if facts.mu > 1 and len(ratio) == len(w) and all(abs(v - 1) < RATIO_FLAT for v in ratio):
        return Finding(
            "no_movement", "error", "No movement: the policy does not change between a step's epochs",
            f"|loss/ratio_mean - 1| < {RATIO_FLAT:g} over {_steps(w)} with --mu {facts.mu}",
            f"--lr {facts.lr * 10:g} (and check that the optimizer updates the policy's parameters)",
            ("loss/ratio_mean",), _span(w), RATIO_FLAT,
        )  # fmt: skip
    after = [r for r in w if r["step"] > facts.warmup_steps]
    kl = _values(after, "loss/kl")
    if facts.beta > 0 and len(after) >= MIN_STEPS and len(kl) == len(after) and all(abs(v) < KL_FLOOR for v in kl):
        return Finding(
            "no_movement", "error", "No movement: the policy has not left its reference",
            f"loss/kl < {KL_FLOOR:g} over {_steps(after)} with --beta {facts.beta:g}",
            f"--lr {facts.lr * 10:g}",
            ("loss/kl",), _span(after), KL_FLOOR,
        )  # fmt: skip
    return None


def big_step(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Too big a step: a high clipped share, a ratio that drifts from 1, a KL growing without bound, a gradient-norm
    spike, or updates skipped for a non-finite loss."""
    w = _window(rows)
    if not w:
        return None
    signs, severe = [], False
    clip = _mean(w, "loss/clip_frac")
    if clip is not None and clip >= CLIP_HIGH:
        signs.append(f"loss/clip_frac {clip:.2f} (threshold {CLIP_HIGH})")
        severe |= clip >= CLIP_SEVERE
    ratio = _mean(w, "loss/ratio_mean")
    if ratio is not None and abs(ratio - 1) >= RATIO_DRIFT:
        signs.append(f"loss/ratio_mean {ratio:.3f} (|r - 1| threshold {RATIO_DRIFT})")
    kl = series(training_rows(rows), "loss/kl")
    if len(kl) > WINDOW and kl[-1][1] >= KL_HIGH and kl[-1][1] >= KL_GROWTH * max(kl[-1 - WINDOW][1], 0.0):
        signs.append(f"loss/kl {kl[-1 - WINDOW][1]:.3g} -> {kl[-1][1]:.3g} in {WINDOW} steps (threshold {KL_HIGH})")
    norms = _values(training_rows(rows), "grad/norm")
    if len(norms) > 2 * WINDOW:
        median = statistics.median(norms[:-WINDOW])
        peak = max(norms[-WINDOW:])
        if median > 0 and peak >= GRAD_SPIKE * median:
            signs.append(f"grad/norm {peak:.3g}, {peak / median:.0f}x the run's median (threshold {GRAD_SPIKE:g}x)")
    change = _values(w, "doctor/weight_change")
    if change and max(change) >= BIG_CHANGE:
        signs.append(f"doctor/weight_change {max(change):.3f} in one step (threshold {BIG_CHANGE})")
        severe = True
    skipped = sum(_values(w, "loss/skipped_updates"))
    if skipped:
        signs.append(f"{skipped:.0f} update(s) skipped for a non-finite loss (loss/skipped_updates)")
        severe = True
    if not signs:
        return None
    lower = f"--lr {facts.lr / 10:g}" + (" and --mu 1" if facts.mu > 1 else "")
    return Finding(
        "big_step", "error" if severe else "warning", "Too big a step: the update overshoots",
        "; ".join(signs) + f" over {_steps(w)}",
        lower + " (a smaller step keeps the ratio near 1 and the clip rarely hit)",
        ("doctor/weight_change", "loss/clip_frac", "loss/ratio_mean", "loss/kl", "grad/norm"), _span(w), None,
    )  # fmt: skip


def entropy(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The token entropy collapsed (below ENTROPY_COLLAPSE of its start while the reward is below its ceiling) or blew
    up (ENTROPY_BLOWUP times the start's), against the run's own first steps."""
    t = training_rows(rows)
    if len(t) < ENTROPY_START + MIN_STEPS:
        return None
    w = t[max(ENTROPY_START, len(t) - WINDOW) :]  # the last WINDOW steps after the start's
    start, now = _mean(t[:ENTROPY_START], "policy/entropy"), _mean(w, "policy/entropy")
    if start is None or now is None or start <= 0:
        return None
    keys = ("policy/entropy", "reward/mean")
    acc = _mean(w, "reward/accuracy")
    if now <= ENTROPY_COLLAPSE * start and (acc is None or acc < CEILING):
        return Finding(
            "entropy", "warning", "Entropy collapse: the policy stopped exploring before it learned the task",
            f"policy/entropy {now:.3g} over {_steps(w)}, {now / start:.2f} of its start {start:.3g} (threshold "
            f"{ENTROPY_COLLAPSE}); reward/accuracy {acc if acc is not None else float('nan'):.2f} (< {CEILING})",
            "--clip-high 0.28 (clip-higher lets unlikely tokens grow) or --entropy-coef 0.001; a lower --lr",
            keys, _span(w), ENTROPY_COLLAPSE * start,
        )  # fmt: skip
    if now >= ENTROPY_BLOWUP * start and now >= ENTROPY_BLOWUP_FLOOR:
        return Finding(
            "entropy", "warning", "Entropy blow-up: the policy is drifting towards noise",
            f"policy/entropy {now:.3g} over {_steps(w)}, {now / start:.1f}x its start {start:.3g} (threshold "
            f"{ENTROPY_BLOWUP:g}x)",
            f"--lr {facts.lr / 10:g}; a lower --temperature; no --entropy-coef",
            keys, _span(w), ENTROPY_BLOWUP * start,
        )  # fmt: skip
    return None


def sampler_mismatch(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The sampler's log-probs differ from the trainer's (engine/*) and nothing corrects it."""
    if facts.engine_correction != "none":
        return None
    w = _window(rows)
    spread = _mean(w, "engine/logratio_std")
    if spread is None or spread < MISMATCH_STD:
        return None
    worst = max(_values(w, "engine/logprob_diff_max"), default=float("nan"))
    return Finding(
        "sampler_mismatch", "warning", "Sampler mismatch: the rollouts come from a policy the update does not score",
        f"engine/logratio_std {spread:.3g} over {_steps(w)} (threshold {MISMATCH_STD}); largest token "
        f"|log-prob difference| {worst:.3g}; --engine-correction none",
        "--engine-correction sequence-truncate (reweights each rollout by its trainer/sampler ratio, capped)",
        ("engine/logratio_std", "engine/logprob_diff_max"), _span(w), MISMATCH_STD,
    )  # fmt: skip


def saturation(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The run has taken most of what this data gives: the effective rank has fallen RANK_FALL of the way to 1, or the
    reward sits near its ceiling, or the groups ran out of contrast after the reward rose."""
    w = _window(rows)
    signs, keys, threshold = [], [], None
    rank = series(rows, "probe/eff_rank")
    if len(rank) >= 2 * RANK_POINTS:
        early = statistics.fmean(v for _, v in rank[:RANK_POINTS])
        now = statistics.fmean(v for _, v in rank[-RANK_POINTS:])
        threshold = 1 + (1 - RANK_FALL) * (early - 1)
        if early > 1 and now <= threshold:
            signs.append(
                f"probe/eff_rank {now:.2f} at steps {rank[-RANK_POINTS][0]}-{rank[-1][0]}, down from {early:.2f} at "
                f"steps {rank[0][0]}-{rank[RANK_POINTS - 1][0]} (threshold {threshold:.2f}: {RANK_FALL:g} of the way "
                "to 1)"
            )
            keys.append("probe/eff_rank")
    acc = _mean(w, "reward/accuracy")
    if acc is not None and acc >= CEILING and constant_accuracy(w) is None:
        signs.append(f"reward/accuracy {acc:.2f} over {_steps(w)} (ceiling {CEILING})")
        keys.append("reward/accuracy")
    zero = _mean(w, "reward/frac_zero_std")
    if zero is not None and zero >= NO_SIGNAL_SHARE and learned(rows):
        signs.append(f"reward/frac_zero_std {zero:.2f} after the reward rose (threshold {NO_SIGNAL_SHARE})")
        keys.append("reward/frac_zero_std")
    if not signs:
        return None
    return Finding(
        "saturation", "info", "Saturation: more steps on this data will buy little",
        "; ".join(signs),
        "evaluate now (grpolab eval --model RUN) and stop, or move to harder data; the effective rank's half-way fall "
        "came about 9 steps before the held-out accuracy saturated on the last-letter runs of docs/foundations.md",
        tuple(keys), _span(w) if w else (rank[0][0], rank[-1][0]), threshold if keys[0] == "probe/eff_rank" else None,
    )  # fmt: skip


def reward_hacking(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Signs that the reward pays for something other than the task: the training reward up while the held-out
    accuracy is flat or down; the completions' length rising with the reward; one reward component carrying the
    rise; the completions of a group becoming identical. None while the held-out accuracy rises beyond its first
    interval: then the reward and the task agree."""
    if held_out_rose(rows):
        return None
    t = training_rows(rows)
    signs, keys = [], []
    rise = reward_rise(rows)
    pair = held_out(rows)
    if rise is not None and rise[0] > 0 and rise[0] >= HACK_RISE_SD * rise[1] and pair is not None:
        first, last = pair
        if last["eval/accuracy_greedy"] <= first["eval/accuracy_greedy"]:
            signs.append(
                f"training reward/mean +{rise[0]:.3f} (threshold {HACK_RISE_SD:g} start sd = {rise[1]:.3f}) while "
                f"eval/accuracy_greedy went {first['eval/accuracy_greedy']:.3f} -> {last['eval/accuracy_greedy']:.3f} "
                f"(steps {first['step']}-{last['step']})"
            )
            keys += ["reward/mean", "eval/accuracy_greedy"]
    if len(t) >= 2 * WINDOW and learned(rows):
        l0, l1 = _mean(t[:WINDOW], "completion/len_mean"), _mean(t[-WINDOW:], "completion/len_mean")
        corr = _correlation(_values(t, "completion/len_mean"), _values(t, "reward/mean"))
        if l0 and l1 and l1 >= LENGTH_DRIFT * l0 and corr is not None and corr >= LENGTH_CORR:
            signs.append(
                f"completion/len_mean {l0:.1f} -> {l1:.1f} tokens (threshold {LENGTH_DRIFT:g}x), correlation with "
                f"reward/mean {corr:.2f} (threshold {LENGTH_CORR})"
            )
            keys += ["completion/len_mean", "reward/mean"]
    carrier = _carrying_component(t, facts)
    if carrier:
        signs.append(carrier[0])
        keys += carrier[1]
    same = identical_groups(rollouts) if learned(rows) else None
    if same is not None and same[1] >= IDENTICAL_SHARE:
        signs.append(f"{100 * same[1]:.0f}% of step {same[0]}'s groups have identical completions (threshold "
                     f"{IDENTICAL_SHARE})")  # fmt: skip
    if not signs:
        return None
    return Finding(
        "reward_hacking", "warning", "Reward hacking signs: the reward rises for something other than the task",
        "; ".join(signs),
        "read the highest-reward completions (rollouts.jsonl) against the task; pay only for a verified answer "
        "(a length or format term small beside the accuracy reward: --reward-weights), and watch the held-out "
        "accuracy (--eval-every)",
        tuple(dict.fromkeys(keys or ["reward/mean"])), _span(t[-WINDOW:]) if t else (0, 0),
    )  # fmt: skip


def _correlation(x: list[float], y: list[float]) -> float | None:
    if len(x) != len(y) or len(x) < 3 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return None
    return statistics.correlation(x, y)


def _carrying_component(t: list[dict], facts: RunFacts) -> tuple[str, list[str]] | None:
    """One reward component after the first whose weighted rise is COMPONENT_SHARE of the reward's, while the first
    (accuracy) reward did not rise."""
    if len(t) < 2 * WINDOW or not facts.components:
        return None
    first, last = t[:WINDOW], t[-WINDOW:]
    total = _mean(last, "reward/mean") - _mean(first, "reward/mean")
    acc = (_mean(last, "reward/accuracy") or 0.0) - (_mean(first, "reward/accuracy") or 0.0)
    if total <= 0 or acc > 0:
        return None
    for name, weight in zip(facts.components, facts.reward_weights[1:]):
        key = f"reward/{name}"
        a, b = _mean(first, key), _mean(last, key)
        if a is not None and b is not None and weight * (b - a) >= COMPONENT_SHARE * total:
            share = weight * (b - a) / total
            return (
                f"{key} carries {100 * share:.0f}% of the reward's rise (threshold {COMPONENT_SHARE}) while "
                f"reward/accuracy changed {acc:+.3f}",
                [key, "reward/accuracy"],
            )
    return None


def identical_groups(rollouts: Sequence[dict]) -> tuple[int, float] | None:
    """(step, share): the share of the last logged step's groups whose completions are all identical (groups of 2
    or more). None without rollouts."""
    if not rollouts:
        return None
    step = max(r["step"] for r in rollouts)
    groups: dict[int, set[str]] = {}
    sizes: dict[int, int] = {}
    for r in rollouts:
        if r["step"] == step:
            groups.setdefault(r["prompt"], set()).add(r["completion"])
            sizes[r["prompt"]] = sizes.get(r["prompt"], 0) + 1
    counted = [p for p in groups if sizes[p] >= 2]
    if not counted:
        return None
    return step, sum(len(groups[p]) == 1 for p in counted) / len(counted)


def eval_drop(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The held-out greedy accuracy fell: its last evaluation's interval lies wholly below its first's."""
    pair = held_out(rows)
    if pair is None:
        return None
    first, last = pair
    hi, lo = last.get("eval/accuracy_greedy_hi"), first.get("eval/accuracy_greedy_lo")
    if hi is None or lo is None or hi >= lo:
        return None
    return Finding(
        "eval_drop", "warning", "The held-out accuracy fell",
        f"eval/accuracy_greedy {first['eval/accuracy_greedy']:.3f} [{lo:.3f}, {first['eval/accuracy_greedy_hi']:.3f}] "
        f"at step {first['step']} -> {last['eval/accuracy_greedy']:.3f} [{last['eval/accuracy_greedy_lo']:.3f}, "
        f"{hi:.3f}] at step {last['step']} (95% intervals apart)",
        f"go back to an earlier checkpoint (grpolab eval --model RUN --step N) and train with --lr {facts.lr / 10:g} or "
        "--beta 0.04 (a KL to the reference keeps the policy near its start)",
        ("eval/accuracy_greedy",), (first["step"], last["step"]),
    )  # fmt: skip


CHECKS: tuple[Callable[..., Finding | None], ...] = (
    big_step,
    entropy,
    reward_hacking,
    truncation,
    reward_blind,
    sampler_mismatch,
    no_movement,
    no_signal,
    eval_drop,
    saturation,
)
"""Every check, causes before their symptoms (an order in which each comes before what it EXPLAINS): the order of
findings of one severity."""
NAMES = tuple(c.__name__ for c in CHECKS)

EXPLAINS = {
    "big_step": {"truncation", "reward_blind", "entropy", "no_signal", "eval_drop", "reward_hacking"},
    "entropy": {"truncation", "reward_blind", "no_signal", "eval_drop"},
    "reward_hacking": {"truncation", "eval_drop"},
    "truncation": {"reward_blind", "no_signal"},
    "reward_blind": {"no_signal"},
}
"""Conditions that cause others: an overshooting step breaks the policy's answers (cut, malformed, all wrong), a
reward that pays for length runs completions into the limit, a cut completion has no answer to check, a reward that
finds no answer gives every rollout the same 0. A cause found no later than its effect is listed with the effect's
severity (the cause of an error is one), before it."""


def order(findings: Sequence[Finding]) -> list[Finding]:
    """Most serious first: by severity, a cause taking the gravest severity among the findings it explains (found at
    the same check or later), then causes before symptoms (CHECKS' order)."""
    by_name = {f.name: f for f in findings}

    def rank(f: Finding) -> int:
        effects = [
            by_name[n]
            for n in EXPLAINS.get(f.name, ())
            if n in by_name and (f.first_step or 0) <= (by_name[n].first_step or 0)
        ]
        return min(SEVERITIES.index(g.severity) for g in [f, *effects])

    return sorted(findings, key=lambda f: (rank(f), NAMES.index(f.name)))


def explained(f: Finding, findings: Sequence[Finding]) -> list[str]:
    """The findings ``f`` explains (see EXPLAINS)."""
    return [
        g.name for g in findings
        if g.name in EXPLAINS.get(f.name, ()) and (f.first_step or 0) <= (g.first_step or 0)
    ]  # fmt: skip


def diagnose(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> list[Finding]:
    """Every condition the rows show, most serious first (:func:`order`)."""
    return order([f for check in CHECKS if (f := check(rows, facts, rollouts)) is not None])
