"""The held-out set and the training sampler a config describes (the built-in arithmetic task, or data files).

Shared by training and ``grpolab eval``, so that evaluating a run's checkpoint asks the very
questions (and puts the very few-shot examples before them) that the run's own evaluation did.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grpolab.common import streams
from grpolab.common.given import NOTHING, Given
from grpolab.config.task import ArithmeticSection, DataSection, EpisodesSection
from grpolab.data.arithmetic import ArithmeticSpec, TrainSampler, held_out_size, test_set
from grpolab.data.dataset import data_format, hold_out, load_records
from grpolab.data.dialogues import dialogue_task
from grpolab.data.jsonl import DataError, ListSampler
from grpolab.data.records import identity_of

TASK_SEED = "task_seed"


class SeedSampler:
    """Records of an environment that samples its own task (``--format self``): ``{"task_seed": k}``, k drawn from
    ``(seed, step)`` as ``--data`` records are. Training seeds are even and the held-out ones (1, 3, 5, ...) odd, so no
    held-out task is trained on."""

    records: list[dict] = []

    def __init__(self, seed: int):
        self.seed = seed

    def draw(self, step: int, n: int, stream: int = streams.DATA_DRAW, round: int = 0) -> list[dict]:
        rng = np.random.default_rng([stream, self.seed, step] + ([round] if round else []))
        return [{TASK_SEED: 2 * int(k)} for k in rng.integers(2**30, size=n)]

    def few_shot(self, n: int) -> list[dict]:
        return self.draw(0, n, stream=streams.FEW_SHOT)


def task_data(
    data: DataSection,
    arithmetic: ArithmeticSection,
    episodes: EpisodesSection,
    eval_questions: int,
    seed: int,
    log=print,
    given: Given = NOTHING,
):
    """``(held_out, sampler)`` of a task: its records (``data``, resolved: no ``auto`` format), the built-in
    arithmetic (``arithmetic``) or the built-in dialogue (``episodes``); at most ``eval_questions`` held out.
    ``given``: rows given to the Python API in place of files.

    Training questions never repeat a held-out one: records of --data that do are dropped (with a
    warning), --eval-fraction holds out whole prompts, and built-in draws exclude the whole 500-question
    test set.
    """
    if data.format == "self":  # an environment that samples its own task: records are task seeds
        return [{TASK_SEED: 2 * i + 1} for i in range(eval_questions)], SeedSampler(seed)
    if episodes.task == "arith-multiturn":  # the built-in dialogues (an environment's records)
        held_out, sampler, _ = dialogue_task(
            episodes.stages, arithmetic.max_operand, episodes.dialogue_context, eval_questions, seed
        )
        return held_out, sampler
    spec = ArithmeticSpec(arithmetic.max_operand, arithmetic.mul_max, tuple(arithmetic.categories))
    if not data.data:  # the built-in task, evaluated on its test set or on --eval-data
        held = _held_out_size(spec, 0 if data.eval_data else eval_questions)
        # Exclude the full 500-question test set (half of a small task) even when evaluating on fewer of them.
        exclude = {r["question"] for r in test_set(held, spec)}
        if data.eval_data:
            held_out = load_records(
                data.eval_data, data.format, data.eval_split, data.prompt_column, given, data.source(held_out=True)
            )
        else:
            held_out = test_set(eval_questions, spec)
        return held_out[:eval_questions], TrainSampler(seed, spec, exclude=exclude)
    train_records, held_out = _data_records(data, spec, eval_questions, seed, given)
    held_out = held_out[:eval_questions]
    test_q = {identity_of(r, data.format) for r in held_out}
    leaked = sum(identity_of(r, data.format) in test_q for r in train_records)
    if leaked:
        log(f"warning: {leaked} training record(s) in {data.data} repeat held-out questions; they are dropped")
        train_records = [r for r in train_records if identity_of(r, data.format) not in test_q]
    if not train_records:
        raise DataError(
            f"--data {data.data}: every record is also in --eval-data {data.eval_data}; nothing left to train on"
        )
    return held_out, ListSampler(train_records, seed, data.data_order)


def _data_records(data: DataSection, spec: ArithmeticSpec, eval_questions: int, seed: int, given: Given):
    """``(train, held_out)`` records of --data: held out by --eval-data, --eval-fraction, or the built-in test set."""
    train_records = load_records(data.data, data.format, data.data_split, data.prompt_column, given, data.source())
    if data.eval_data:
        eval_ref = data.source(held_out=True)
        return train_records, load_records(data.eval_data, data.format, data.eval_split, data.prompt_column, given,
                                           eval_ref)  # fmt: skip
    if data.eval_fraction:
        train_records, held_out = hold_out(train_records, data.eval_fraction, seed, data.format)
        if not held_out or not train_records:
            raise DataError(
                f"--eval-fraction {data.eval_fraction:g} of --data {data.data} leaves {len(train_records)} training "
                f"and {len(held_out)} held-out prompts; both need at least one"
            )
        return train_records, held_out
    if data.format != "gsm8k":  # --eval-fraction 0: no held-out evaluation, as TRL without an eval_dataset
        return train_records, []
    _held_out_size(spec, eval_questions)
    return train_records, test_set(eval_questions, spec)


def resolve_format(data: DataSection, env: bool, given: Given = NOTHING, self_sampling: bool = False) -> DataSection:
    """``data`` with ``--format auto`` resolved: gsm8k for the built-in task, rows for an environment's (its
    ``reset`` reads the row as it is), self for an environment that samples its own task (``self_sampling``: a TRL-shape
    class and no data), else from the data's columns (:func:`grpolab.data.dataset.data_format`).
    ``--eval-fraction`` is 0 where it does not apply (no --data, or --eval-data given): config.json says so."""
    if data.eval_fraction and (data.eval_data or not data.data):
        data = dataclasses.replace(data, eval_fraction=0.0)
    if data.format != "auto":
        return data
    if not (data.data or data.eval_data):
        fmt = "self" if self_sampling else "gsm8k"
    elif env:
        fmt = "rows"
    else:
        path, split = (data.data, data.data_split) if data.data else (data.eval_data, data.eval_split)
        fmt = data_format(path, split, data.prompt_column, given, data.source(held_out=not data.data))
    return dataclasses.replace(data, format=fmt)


def _held_out_size(spec, eval_questions: int) -> int:
    try:
        return held_out_size(spec, eval_questions)
    except ValueError as e:
        raise DataError(f"--eval-questions: {e}") from None


def few_shot_examples(sampler, k: int) -> list[dict]:
    """The ``k`` solved examples (question, answer) put before each question with --few-shot."""
    return [{"question": r["question"], "answer": r["answer"]} for r in sampler.few_shot(k)] if k else []
