"""Held-out accuracy: greedy, and sampled at a temperature over k samples per question."""

from __future__ import annotations

from collections import defaultdict

from grpolab.distributed import SINGLE, World, gather_concat
from grpolab.policy import Policy
from grpolab.rewards import accuracy_reward
from grpolab.rollout import sample

EVAL_STREAM = 3  # random-stream id for evaluation samples, distinct from training


def _generate(policy: Policy, records: list[dict], keys, temperature, max_new_tokens, batch_size) -> list[str]:
    texts: list[str] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        batch = sample(
            policy.model,
            [policy.prompt_ids(r) for r in chunk],
            keys[start : start + batch_size],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=1.0,
            eos_id=policy.eos_id,
            pad_id=policy.pad_id,
        )
        texts += policy.decode(batch.completion_ids, batch.completion_mask)
    return texts


def evaluate(
    policy: Policy,
    records: list[dict],
    *,
    samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    seed: int = 0,
    batch_size: int = 256,
    world: World = SINGLE,
) -> tuple[dict[str, float], list[dict]]:
    """Accuracy on ``records``.

    Returns ``(metrics, examples)``: ``eval/accuracy_greedy``,
    ``eval/accuracy_sampled`` (mean over ``samples`` draws per question at
    ``temperature``) and per-category greedy accuracy; ``examples`` holds each
    question with its greedy completion. Sampling keys depend on ``seed`` and
    the question index only, so the same policy always gets the same score, on one process or
    split over ``world`` (each rank answers a block of the questions; every rank gets the totals).
    """
    was_training = policy.model.training
    policy.model.eval()
    mine = world.split(len(records))
    own = [records[i] for i in mine]
    greedy_keys = [(EVAL_STREAM, seed, i) for i in mine]
    greedy = _generate(policy, own, greedy_keys, 0.0, max_new_tokens, batch_size)
    greedy, greedy_ok = gather_concat(greedy, world), gather_concat(accuracy_reward(greedy, own), world)
    metrics: dict[str, float] = {"eval/accuracy_greedy": sum(greedy_ok) / len(records)}
    if samples > 0:
        rep = [r for r in own for _ in range(samples)]
        keys = [(EVAL_STREAM, seed, i, j) for i in mine for j in range(samples)]
        sampled = _generate(policy, rep, keys, temperature, max_new_tokens, batch_size)
        sampled_ok = gather_concat(accuracy_reward(sampled, rep), world)
        metrics["eval/accuracy_sampled"] = sum(sampled_ok) / (len(records) * samples)
    by_cat: dict[str, list[float]] = defaultdict(list)
    for rec, ok in zip(records, greedy_ok):
        by_cat[rec.get("category", "all")].append(ok)
    for cat, oks in sorted(by_cat.items()):
        metrics[f"eval/greedy_{cat}"] = sum(oks) / len(oks)
    examples = [
        {"question": r["question"], "ground_truth": r["ground_truth"], "completion": c, "correct": bool(ok)}
        for r, c, ok in zip(records, greedy, greedy_ok)
    ]
    policy.model.train(was_training)
    return metrics, examples
