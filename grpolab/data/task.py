"""The held-out set and the training sampler a config describes (built-in arithmetic or JSONL files).

Shared by training and ``grpolab eval``, so that evaluating a run's checkpoint asks the very
questions (and puts the very few-shot examples before them) that the run's own evaluation did.
"""

from __future__ import annotations

from grpolab.data.arithmetic import ArithmeticSpec, TrainSampler, held_out_size, test_set
from grpolab.data.jsonl import DataError, ListSampler, load_gsm8k_jsonl
from grpolab.data.math_format import load_math_jsonl


def task_data(cfg, log=print):
    """``(held_out, sampler)`` for a :class:`grpolab.config.TrainConfig` (resolved: ``eval_questions`` set).

    Training questions never repeat a held-out one: JSONL records that do are dropped (with a
    warning), and built-in draws exclude the whole 500-question test set.
    """
    spec = ArithmeticSpec(cfg.max_operand, cfg.mul_max, tuple(cfg.categories))
    load = load_math_jsonl if cfg.format == "math" else load_gsm8k_jsonl
    if not cfg.eval_data:
        try:
            held = held_out_size(spec, cfg.eval_questions)
        except ValueError as e:
            raise DataError(f"--eval-questions: {e}") from None
    held_out = load(cfg.eval_data)[: cfg.eval_questions] if cfg.eval_data else test_set(cfg.eval_questions, spec)
    if cfg.data:
        train_records = load(cfg.data)
        test_q = {r["question"] for r in held_out}
        leaked = sum(r["question"] in test_q for r in train_records)
        if leaked:
            log(f"warning: {leaked} training record(s) in {cfg.data} repeat held-out questions; they are dropped")
            train_records = [r for r in train_records if r["question"] not in test_q]
        if not train_records:
            raise DataError(
                f"--data {cfg.data}: every record is also in --eval-data {cfg.eval_data}; nothing left to train on"
            )
        return held_out, ListSampler(train_records, cfg.seed)
    # Exclude the full 500-question test set (half of a small task) even when evaluating on fewer of them.
    exclude = {r["question"] for r in test_set(held, spec)}
    return held_out, TrainSampler(cfg.seed, spec, exclude=exclude)


def few_shot_examples(sampler, k: int) -> list[dict]:
    """The ``k`` solved examples (question, answer) put before each question with --few-shot."""
    return [{"question": r["question"], "answer": r["answer"]} for r in sampler.few_shot(k)] if k else []
