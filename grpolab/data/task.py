"""The held-out set and the training sampler a config describes (the built-in arithmetic task, or data files).

Shared by training and ``grpolab eval``, so that evaluating a run's checkpoint asks the very
questions (and puts the very few-shot examples before them) that the run's own evaluation did.
"""

from __future__ import annotations

from grpolab.data.arithmetic import ArithmeticSpec, TrainSampler, held_out_size, test_set
from grpolab.data.dataset import hold_out, load_records
from grpolab.data.jsonl import DataError, ListSampler
from grpolab.data.records import identity_of


def task_data(cfg, log=print):
    """``(held_out, sampler)`` for a :class:`grpolab.config.train.TrainConfig` (resolved: ``eval_questions`` and
    ``format`` set).

    Training questions never repeat a held-out one: records of --data that do are dropped (with a
    warning), --eval-fraction holds out whole prompts, and built-in draws exclude the whole 500-question
    test set.
    """
    if cfg.task == "arith-multiturn":  # the built-in dialogues (an environment's records)
        from grpolab.data.dialogues import dialogue_task

        held_out, sampler, _ = dialogue_task(
            cfg.stages, cfg.max_operand, cfg.dialogue_context, cfg.eval_questions, cfg.seed
        )
        return held_out, sampler
    spec = ArithmeticSpec(cfg.max_operand, cfg.mul_max, tuple(cfg.categories))
    if not cfg.data:  # the built-in task, evaluated on its test set or on --eval-data
        held = _held_out_size(spec, 0 if cfg.eval_data else cfg.eval_questions)
        # Exclude the full 500-question test set (half of a small task) even when evaluating on fewer of them.
        exclude = {r["question"] for r in test_set(held, spec)}
        if cfg.eval_data:
            held_out = load_records(cfg.eval_data, cfg.format, cfg.eval_split, cfg.prompt_column)
        else:
            held_out = test_set(cfg.eval_questions, spec)
        return held_out[: cfg.eval_questions], TrainSampler(cfg.seed, spec, exclude=exclude)
    train_records = load_records(cfg.data, cfg.format, cfg.data_split, cfg.prompt_column)
    if cfg.eval_data:
        held_out = load_records(cfg.eval_data, cfg.format, cfg.eval_split, cfg.prompt_column)
    elif cfg.eval_fraction:
        train_records, held_out = hold_out(train_records, cfg.eval_fraction, cfg.seed, cfg.format)
        if not held_out or not train_records:
            raise DataError(
                f"--eval-fraction {cfg.eval_fraction:g} of --data {cfg.data} leaves {len(train_records)} training and "
                f"{len(held_out)} held-out prompts; both need at least one"
            )
    else:
        _held_out_size(spec, cfg.eval_questions)
        held_out = test_set(cfg.eval_questions, spec)
    held_out = held_out[: cfg.eval_questions]
    test_q = {identity_of(r, cfg.format) for r in held_out}
    leaked = sum(identity_of(r, cfg.format) in test_q for r in train_records)
    if leaked:
        log(f"warning: {leaked} training record(s) in {cfg.data} repeat held-out questions; they are dropped")
        train_records = [r for r in train_records if identity_of(r, cfg.format) not in test_q]
    if not train_records:
        raise DataError(
            f"--data {cfg.data}: every record is also in --eval-data {cfg.eval_data}; nothing left to train on"
        )
    return held_out, ListSampler(train_records, cfg.seed)


def _held_out_size(spec, eval_questions: int) -> int:
    try:
        return held_out_size(spec, eval_questions)
    except ValueError as e:
        raise DataError(f"--eval-questions: {e}") from None


def few_shot_examples(sampler, k: int) -> list[dict]:
    """The ``k`` solved examples (question, answer) put before each question with --few-shot."""
    return [{"question": r["question"], "answer": r["answer"]} for r in sampler.few_shot(k)] if k else []
