"""The checks of the update: does the policy move (no_movement), does the update survive the weights' precision
(rounding), does it move too far (big_step), towards one answer or towards noise (entropy), does the update score the
policy that sampled (sampler_mismatch), and, when the run does not learn although its groups carry signal, which of
these the instruments point to (not_learning)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from grpolab.doctor.rows import (
    ACCURACIES,
    CEILING,
    MIN_STEPS,
    WINDOW,
    Finding,
    RunFacts,
    at_ceiling,
    held_out,
    held_out_rose,
    learned,
    mean,
    reward_rise,
    span,
    steps_of,
    training_rows,
    values,
    window,
)
from grpolab.doctor.signal import NO_SIGNAL_SHARE
from grpolab.probes.signals import series

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
"""Token entropy under this share of the start's, while the reward is below CEILING: the policy stopped exploring.
A warning when the reward has not risen (it stopped before it learned the task); info when it has (it settled on
the answers it learned, and will rarely sample the ones it still gets wrong); nothing at the ceiling, where a low
entropy is what learning looks like."""
ENTROPY_BLOWUP = 3.0
"""Token entropy above this multiple of the start's (and above ENTROPY_BLOWUP_FLOOR nats): the policy is drifting
towards noise."""
ENTROPY_BLOWUP_FLOOR = 1.0
"""See ENTROPY_BLOWUP: a start near 0 makes any rise a large multiple."""
UNMOVED_SHARE = 0.5
"""Of the sampled weights whose gradient was nonzero, the share a step left exactly as they were
(doctor/weights_unmoved_frac), as a mean over WINDOW steps, from which the update is rounding itself away: fp32
weights leave under 0.1% unmoved (0.003% on SmolLM2 at --lr 1e-6, 0.005-0.02% on the built-in model at 5e-5), plain
AdamW on bf16 weights 99.6% on SmolLM2 at 1e-6 and 98% at 1e-5 (docs/precision.md)."""
UNMOVED_SEVERE = 0.9
"""From this unmoved share the run cannot learn as it is set up: an error (a warning between UNMOVED_SHARE and it)."""
FLAT_SD = 0.25
"""not_learning: a training reward whose mean over the last WINDOW steps is within this many of the start's rollout
standard deviations of (or below) its mean over the first WINDOW is flat. Half of rows.RISE_SD, the rise that counts
as learning: a run in between is learning slowly, not standing still."""
FLAT_STEPS = 4 * WINDOW
"""not_learning: training steps before a run is called flat. A healthy built-in run of 4 x 4 rollouts a step rose
0.16 and 0.28 of its start's spread by steps 10 and 15 (noise that large at 16 rollouts), its 16-question evaluations
within each other's intervals; at 20 steps a flat run has had four windows to move."""
MISMATCH_STD = 0.01
"""Spread of the per-token log-ratio of trainer to sampler (engine/logratio_std) above which the sampler's
mismatch biases the update unless corrected: an fp32 copy stays under 1e-4, a bf16 one is 0.05-0.3
(docs/precision.md), where the uncorrected step gradient was 19-49% off the exact one."""


def no_movement(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The policy does not move: a learning rate of 0, or (where they can show it) a ratio that stays at 1 across a
    step's epochs and a KL that stays at 0."""
    w = window(rows)
    if not w:
        return None
    if zero_lr(w):
        return Finding(
            "no_movement", "error", "No movement: the learning rate is 0",
            f"charts/lr 0 over {steps_of(w)}",
            f"--lr {larger_lr(facts, 10):g} (the built-in model trains at 5e-5, 100M-1B models at "
            "1e-6 to 1e-5)",
            ("charts/lr", "reward/mean"), span(w), 0.0,
        )  # fmt: skip
    signal = mean(w, "reward/frac_zero_std")
    if signal is not None and signal >= NO_SIGNAL_SHARE:
        return None  # the advantages are (mostly) 0: no_signal says why
    change = values(w, "doctor/weight_change")
    if len(change) == len(w) and all(v < NO_MOVE_CHANGE for v in change):
        return Finding(
            "no_movement", "error", "No movement: the update does not change the weights",
            f"doctor/weight_change at most {max(change):.2g} per step over {steps_of(w)} (threshold {NO_MOVE_CHANGE:g})",
            f"--lr {facts.lr * 100:g} (the built-in model trains at 5e-5, 100M-1B models at 1e-6 to 1e-5; bf16 "
            "weights cannot register steps much under 1e-3 of their size: --precision bf16-mixed)",
            ("doctor/weight_change", "charts/lr"), span(w), NO_MOVE_CHANGE,
        )  # fmt: skip
    ratio = values(w, "loss/ratio_mean")
    if facts.mu > 1 and len(ratio) == len(w) and all(abs(v - 1) < RATIO_FLAT for v in ratio):
        return Finding(
            "no_movement", "error", "No movement: the policy does not change between a step's epochs",
            f"|loss/ratio_mean - 1| < {RATIO_FLAT:g} over {steps_of(w)} with --mu {facts.mu}",
            f"--lr {facts.lr * 10:g} (and check that the optimizer updates the policy's parameters)",
            ("loss/ratio_mean",), span(w), RATIO_FLAT,
        )  # fmt: skip
    after = [r for r in w if r["step"] > facts.warmup_steps]
    kl = values(after, "loss/kl")
    if facts.beta > 0 and len(after) >= MIN_STEPS and len(kl) == len(after) and all(abs(v) < KL_FLOOR for v in kl):
        return Finding(
            "no_movement", "error", "No movement: the policy has not left its reference",
            f"loss/kl < {KL_FLOOR:g} over {steps_of(after)} with --beta {facts.beta:g}",
            f"--lr {facts.lr * 10:g}",
            ("loss/kl",), span(after), KL_FLOOR,
        )  # fmt: skip
    return None


def big_step(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Too big a step: a high clipped share, a ratio that drifts from 1, a KL growing without bound, a gradient-norm
    spike, or updates skipped for a non-finite loss."""
    w = window(rows)
    if not w:
        return None
    signs, severe = [], False
    clip = mean(w, "loss/clip_frac")
    if clip is not None and clip >= CLIP_HIGH:
        signs.append(f"loss/clip_frac {clip:.2f} (threshold {CLIP_HIGH})")
        severe |= clip >= CLIP_SEVERE
    ratio = mean(w, "loss/ratio_mean")
    if ratio is not None and abs(ratio - 1) >= RATIO_DRIFT:
        signs.append(f"loss/ratio_mean {ratio:.3f} (|r - 1| threshold {RATIO_DRIFT})")
    kl = series(training_rows(rows), "loss/kl")
    if len(kl) > WINDOW and kl[-1][1] >= KL_HIGH and kl[-1][1] >= KL_GROWTH * max(kl[-1 - WINDOW][1], 0.0):
        signs.append(f"loss/kl {kl[-1 - WINDOW][1]:.3g} -> {kl[-1][1]:.3g} in {WINDOW} steps (threshold {KL_HIGH})")
    norms = values(training_rows(rows), "grad/norm")
    if len(norms) > 2 * WINDOW:
        median = statistics.median(norms[:-WINDOW])
        peak = max(norms[-WINDOW:])
        if median > 0 and peak >= GRAD_SPIKE * median:
            signs.append(f"grad/norm {peak:.3g}, {peak / median:.0f}x the run's median (threshold {GRAD_SPIKE:g}x)")
    change = values(w, "doctor/weight_change")
    if change and max(change) >= BIG_CHANGE:
        signs.append(f"doctor/weight_change {max(change):.3f} in one step (threshold {BIG_CHANGE})")
        severe = True
    skipped = sum(values(w, "loss/skipped_updates"))
    if skipped:
        signs.append(f"{skipped:.0f} update(s) skipped for a non-finite loss (loss/skipped_updates)")
        severe = True
    if not signs:
        return None
    lower = f"--lr {facts.lr / 10:g}" + (" and --mu 1" if facts.mu > 1 else "")
    return Finding(
        "big_step", "error" if severe else "warning", "Too big a step: the update overshoots",
        "; ".join(signs) + f" over {steps_of(w)}",
        lower + " (a smaller step keeps the ratio near 1 and the clip rarely hit)",
        ("doctor/weight_change", "loss/clip_frac", "loss/ratio_mean", "loss/kl", "grad/norm"), span(w), None,
    )  # fmt: skip


def entropy(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The token entropy collapsed (below ENTROPY_COLLAPSE of its start while the reward is below its ceiling) or blew
    up (ENTROPY_BLOWUP times the start's), against the run's own first steps."""
    t = training_rows(rows)
    if len(t) < ENTROPY_START + MIN_STEPS:
        return None
    w = t[max(ENTROPY_START, len(t) - WINDOW) :]  # the last WINDOW steps after the start's
    start, now = mean(t[:ENTROPY_START], "policy/entropy"), mean(w, "policy/entropy")
    if start is None or now is None or start <= 0:
        return None
    keys = ("policy/entropy", "reward/mean")
    acc = mean(w, "reward/accuracy")
    if now <= ENTROPY_COLLAPSE * start and not at_ceiling(acc, facts):
        after = learned(rows)
        title = (
            "Entropy collapse after the reward rose: the policy has settled on its answers"
            if after
            else "Entropy collapse: the policy stopped exploring before it learned the task"
        )
        return Finding(
            "entropy", "info" if after else "warning", title,
            f"policy/entropy {now:.3g} over {steps_of(w)}, {now / start:.2f} of its start {start:.3g} (threshold "
            f"{ENTROPY_COLLAPSE}); reward/accuracy {acc if acc is not None else float('nan'):.2f} (< {CEILING})",
            "--clip-high 0.28 (clip-higher lets unlikely tokens grow) or --entropy-coef 0.001; a lower --lr"
            + ("; or stop here (saturation)" if after else ""),
            keys, span(w), ENTROPY_COLLAPSE * start,
        )  # fmt: skip
    if now >= ENTROPY_BLOWUP * start and now >= ENTROPY_BLOWUP_FLOOR:
        return Finding(
            "entropy", "warning", "Entropy blow-up: the policy is drifting towards noise",
            f"policy/entropy {now:.3g} over {steps_of(w)}, {now / start:.1f}x its start {start:.3g} (threshold "
            f"{ENTROPY_BLOWUP:g}x)",
            f"--lr {facts.lr / 10:g}; a lower --temperature; no --entropy-coef",
            keys, span(w), ENTROPY_BLOWUP * start,
        )  # fmt: skip
    return None


def sampler_mismatch(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The sampler's log-probs differ from the trainer's (engine/*) and nothing corrects it."""
    if facts.engine_correction != "none":
        return None
    w = window(rows)
    spread = mean(w, "engine/logratio_std")
    if spread is None or spread < MISMATCH_STD:
        return None
    worst = max(values(w, "engine/logprob_diff_max"), default=float("nan"))
    return Finding(
        "sampler_mismatch", "warning", "Sampler mismatch: the rollouts come from a policy the update does not score",
        f"engine/logratio_std {spread:.3g} over {steps_of(w)} (threshold {MISMATCH_STD}); largest token "
        f"|log-prob difference| {worst:.3g}; --engine-correction none",
        "--engine-correction sequence-truncate (reweights each rollout by its trainer/sampler ratio, capped)",
        ("engine/logratio_std", "engine/logprob_diff_max"), span(w), MISMATCH_STD,
    )  # fmt: skip


FP32_WEIGHTS = ("32-true", "64-true", "bf16-mixed", "16-mixed")
"""The precisions whose weights are fp32 or fp64: an update they round away is one too small for any weight
(no_movement's case, a learning rate to raise), not the precision's."""


def rounding(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Updates rounded away: most weights with a nonzero gradient end the step exactly as they were
    (doctor/weights_unmoved_frac over WINDOW steps at least UNMOVED_SHARE), the weights held in bf16 (bf16-true, or
    a run recorded before --precision) too coarse for the step's size."""
    w = window(rows)
    unmoved = values(w, "doctor/weights_unmoved_frac")
    if len(unmoved) < MIN_STEPS or facts.precision in FP32_WEIGHTS:
        return None
    share = statistics.fmean(unmoved)
    if share < UNMOVED_SHARE:
        return None
    if facts.compensation == "none":
        held = "bf16 weights stepped by plain AdamW"
    else:
        exact = mean(w, "doctor/weights_unmoved_exact_frac")
        kept = f"doctor/weights_unmoved_exact_frac {exact:.3f}" if exact is not None else "its compensation"
        held = (
            f"bf16 weights: Kahan summation keeps each update ({kept}), but the forward computes with the bf16 "
            "weights, which move only once the compensation reaches half a bf16 spacing"
        )
    fix = (
        "--precision bf16-mixed (fp32 master weights and optimizer state, the forward in bf16: every update "
        "registers)" + (", or --compensation kahan to keep bf16 weights" if facts.compensation == "none" else "")
    )
    return Finding(
        "rounding", "error" if share >= UNMOVED_SEVERE else "warning",
        "Updates rounded away: the weights' precision loses most of each step",
        f"doctor/weights_unmoved_frac {share:.3f} over {steps_of(w)} (threshold {UNMOVED_SHARE}): of the sampled "
        f"weights with a nonzero gradient, that share did not change ({held})",
        fix, ("doctor/weights_unmoved_frac", "doctor/weight_change"), span(w), UNMOVED_SHARE,
    )  # fmt: skip


def not_learning(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Not learning: after FLAT_STEPS training steps the training reward is flat (its rise under FLAT_SD start
    standard deviations), no held-out accuracy rose (neither sampled nor greedy: each evaluated one's last value lies
    within its first's 95% interval; one that rose beyond it is learning, whatever the other says), and yet most
    groups carry signal (reward/frac_zero_std under NO_SIGNAL_SHARE) and the reward is below its ceiling. The finding
    lists what the instruments point to (a warning): rounding, a standing policy, a sampler mismatch, a step the clip
    takes. With none of them it is info: a run that learns slowly looks the same for a while (the built-in demo's
    reward rose 0.06 of its spread in its first 50 steps, and it learns over 500)."""
    t = training_rows(rows)
    rise = reward_rise(rows)
    if len(t) < FLAT_STEPS or rise is None or rise[0] > FLAT_SD * rise[1]:
        return None
    w = t[-WINDOW:]
    zero, acc = mean(w, "reward/frac_zero_std"), mean(w, "reward/accuracy")
    if zero is None or zero >= NO_SIGNAL_SHARE or at_ceiling(acc, facts):
        return None
    if held_out_rose(rows):
        return None  # a held-out accuracy rose beyond its first interval: the run learns
    read = [key for key in ACCURACIES if held_out(rows, key) is not None]
    if not read:
        return None  # no held-out evaluation to say it is flat
    flat = []
    for key in read:  # each one read, named: all of them flat
        first, last = held_out(rows, key)
        flat.append(f"{key} {first[key]:.3f} at step {first['step']} -> {last[key]:.3f} at step {last['step']}")
    causes = _causes(w, facts)
    fix = causes[0][1] if causes else f"more steps, or --lr {larger_lr(facts, 3):g}"
    named = "; ".join(c for c, _ in causes) if causes else "none of the instruments points to a cause"
    title = "Not learning: the groups carry signal, but neither reward nor accuracy moves"
    if not causes:  # a slow start looks the same (the demo's first 50 steps): a fact, not yet a fault
        title = "Not learning yet: the groups carry signal, but neither reward nor accuracy has moved"
    return Finding(
        "not_learning", "warning" if causes else "info", title,
        f"reward/mean {mean(t[:WINDOW], 'reward/mean'):.3f} -> {mean(w, 'reward/mean'):.3f} (first and last {WINDOW} "
        f"steps; a rise under {FLAT_SD} of the start's sd {rise[1]:.3f}); {'; '.join(flat)} (each within its first "
        f"interval); reward/frac_zero_std {zero:.2f} (< {NO_SIGNAL_SHARE}). Candidate causes: {named}",
        fix, ("reward/mean", *read, "reward/frac_zero_std"), span(t), None,
    )  # fmt: skip


def zero_lr(w: Sequence[dict]) -> bool:
    """Every row of ``w`` logged a learning rate of 0 (``charts/lr``)."""
    return all(r.get("charts/lr") == 0 for r in w)


def larger_lr(facts: RunFacts, factor: float) -> float:
    """``factor`` times the run's learning rate; the built-in model's 5e-5 for a run at 0 (a control run)."""
    return facts.lr * factor if facts.lr > 0 else 5e-5


def _causes(w: Sequence[dict], facts: RunFacts) -> list[tuple[str, str]]:
    """(what an instrument shows, the change it suggests) for each reason a run with signal may not learn that the
    last WINDOW rows show, the likeliest first."""
    out = []
    if facts.lr <= 0 or zero_lr(w):  # a control run: nothing else is the cause
        return [("the learning rate is 0 (charts/lr)", f"--lr {larger_lr(facts, 10):g}")]
    unmoved = mean(w, "doctor/weights_unmoved_frac")
    if unmoved is not None and unmoved >= UNMOVED_SHARE:
        out.append((f"updates rounded away (doctor/weights_unmoved_frac {unmoved:.2f})", "--precision bf16-mixed"))
    change = mean(w, "doctor/weight_change")
    if change is not None and change < 10 * NO_MOVE_CHANGE:
        out.append((f"the weights barely move (doctor/weight_change {change:.2g} a step)", f"--lr {facts.lr * 10:g}"))
    spread = mean(w, "engine/logratio_std")
    if spread is not None and spread >= MISMATCH_STD and facts.engine_correction == "none":
        out.append((f"a sampler mismatch (engine/logratio_std {spread:.3g})", "--engine-correction sequence-truncate"))
    clip = mean(w, "loss/clip_frac")
    if clip is not None and clip >= CLIP_HIGH:
        out.append((f"the clip takes the step (loss/clip_frac {clip:.2f})", f"--lr {facts.lr / 10:g}"))
    return out
