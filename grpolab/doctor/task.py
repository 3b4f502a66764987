"""The checks of the reward against the task: does the reward rise for something the task does not ask for
(reward_hacking), and did the held-out accuracy fall (eval_drop)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from grpolab.doctor.hacking import KEYS, alarms
from grpolab.doctor.rows import (
    ACCURACIES,
    WINDOW,
    Finding,
    RunFacts,
    held_out,
    held_out_rose,
    learned,
    mean,
    reward_rise,
    span,
    training_rows,
    values,
)

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


def reward_hacking(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Signs that the reward pays for something other than the task: the training reward up while the held-out
    accuracy is flat or down; the completions' length rising with the reward; one reward component carrying the
    rise; the completions of a group becoming identical. None while the held-out accuracy rises beyond its first
    interval: then the reward and the task agree. Before any of those, the early signs (:mod:`grpolab.doctor.hacking`:
    gradients aligned across prompts, one trick winning everywhere, a paid honeypot, a failed audit) fire whatever
    the held-out accuracy does: they point at the checker."""
    early = alarms(rows)
    if early:
        return _early_finding(rows, early)
    if held_out_rose(rows):
        return None
    t = training_rows(rows)
    signs, keys = [], []
    rise = reward_rise(rows)
    key = next((k for k in ACCURACIES if held_out(rows, k) is not None), None)  # sampled, as the reward is
    if rise is not None and rise[0] > 0 and rise[0] >= HACK_RISE_SD * rise[1] and key is not None:
        first, last = held_out(rows, key)
        if last[key] <= first[key]:
            signs.append(
                f"training reward/mean +{rise[0]:.3f} (threshold {HACK_RISE_SD:g} start sd = {rise[1]:.3f}) while "
                f"{key} went {first[key]:.3f} -> {last[key]:.3f} (steps {first['step']}-{last['step']})"
            )
            keys += ["reward/mean", key]
    if len(t) >= 2 * WINDOW and learned(rows):
        l0, l1 = mean(t[:WINDOW], "completion/len_mean"), mean(t[-WINDOW:], "completion/len_mean")
        corr = _correlation(values(t, "completion/len_mean"), values(t, "reward/mean"))
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
    if facts.model_reward and "reward/mean" in keys[:1]:  # a model's score up, the verifier's held-out flat
        title = f"Reward hacking signs: the {facts.model_reward}'s score rises while the held-out verifier is flat"
        fix = (
            f"read the completions the {facts.model_reward} scores highest (rollouts.jsonl) against the task: it pays "
            "for something the verifier does not; add the verifier to the reward (--reward-fn, --reward-weights), "
            "retrain the reward model with those completions as rejected, or keep the checkpoint of the best "
            "held-out step"
        )
    else:
        title = "Reward hacking signs: the reward rises for something other than the task"
        fix = (
            "read the highest-reward completions (rollouts.jsonl) against the task; pay only for a verified answer "
            "(a length or format term small beside the accuracy reward: --reward-weights), and watch the held-out "
            "accuracy (--eval-every)"
        )
    return Finding(
        "reward_hacking", "warning", title, "; ".join(signs), fix,
        tuple(dict.fromkeys(keys or ["reward/mean"])), span(t[-WINDOW:]) if t else (0, 0),
    )  # fmt: skip


def _early_finding(rows: Sequence[dict], early: list) -> Finding:
    """The reward_hacking finding of the early signs that alarm: they name the sign and its step; the fix points at
    the checker."""
    t = training_rows(rows)
    names = ", ".join(a.sign for a in early)
    fix = (
        "read the completions that carry the sign (grpolab doctor RUN shows them; hacking.jsonl keeps them) against "
        "the task, then fix the checker so they do not pay: compare the parsed final answer exactly (no substring, "
        "no answer anywhere in the text), pay a format or length term far below the answer (--reward-weights), "
        "decide a program's verdict outside it; or run with --audit-reward as a second, stricter check"
    )
    return Finding(
        "reward_hacking", "warning", f"Early signs of reward hacking ({names}): the checker pays for something the task "
        "does not ask", "; ".join(a.describe() for a in early), fix,
        tuple(KEYS[a.sign] for a in early), span(t[-WINDOW:]) if t else (early[0].step, early[0].step),
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
    total = mean(last, "reward/mean") - mean(first, "reward/mean")
    acc = (mean(last, "reward/accuracy") or 0.0) - (mean(first, "reward/accuracy") or 0.0)
    if total <= 0 or acc > 0:
        return None
    for name, weight in zip(facts.components, facts.reward_weights[1:]):
        key = f"reward/{name}"
        a, b = mean(first, key), mean(last, key)
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
    """A held-out accuracy (sampled or greedy) fell: its last evaluation's interval lies wholly below its first's."""
    for key in ACCURACIES:
        pair = held_out(rows, key)
        if pair is None:
            continue
        first, last = pair
        hi, lo = last.get(key + "_hi"), first.get(key + "_lo")
        if hi is None or lo is None or hi >= lo:
            continue
        return Finding(
            "eval_drop", "warning", "The held-out accuracy fell",
            f"{key} {first[key]:.3f} [{lo:.3f}, {first[key + '_hi']:.3f}] at step {first['step']} -> {last[key]:.3f} "
            f"[{last[key + '_lo']:.3f}, {hi:.3f}] at step {last['step']} (95% intervals apart)",
            f"go back to an earlier checkpoint (grpolab eval --model RUN --step N) and train with --lr {facts.lr / 10:g} "
            "or --beta 0.04 (a KL to the reference keeps the policy near its start)",
            (key,), (first["step"], last["step"]),
        )  # fmt: skip
    return None
