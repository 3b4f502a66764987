"""Question/answer records from JSONL files, GSM8K style.

Each line is ``{"question": ..., "answer": ...}`` where the answer text ends
with ``#### <number>``. Records come back in the same shape as the built-in
task's: ``question``, ``answer``, ``ground_truth`` (the number after ``####``,
commas removed) and ``category`` (``"jsonl"`` unless the line gives one).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from grpolab.common import streams
from grpolab.data.answers import extract_final_number


class DataError(ValueError):
    """A data file that cannot be read as records; the message names the file and line."""


def iter_json_objects(path: str | Path):
    """``(where, obj)`` for each non-blank line of a JSONL file, ``where`` = ``"file:line"``;
    a line that is not a JSON object is a DataError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def gsm8k_record(where: str, obj: dict) -> dict:
    """A GSM8K row (``question``, ``answer`` ending in ``#### <number>``) as a task record; ``where`` names the row."""
    for key in ("question", "answer"):
        if not isinstance(obj.get(key), str):
            raise DataError(f"{where}: field {key!r} missing or not a string")
    if "####" not in obj["answer"]:
        raise DataError(f"{where}: answer does not end with '#### <number>'")
    truth = extract_final_number(obj["answer"].rsplit("####", 1)[1])
    if truth is None:
        raise DataError(f"{where}: no number after '####' in the answer")
    return {
        "question": obj["question"],
        "answer": obj["answer"],
        "ground_truth": truth,
        "category": str(obj.get("category", "jsonl")),
    }


def load_gsm8k_jsonl(path: str | Path) -> list[dict]:
    records = [gsm8k_record(where, obj) for where, obj in iter_json_objects(path)]
    if not records:
        raise DataError(f"{path}: no records")
    return records


class ListSampler:
    """Training records of a fixed list, ``n`` a step, in the order --data-order names:

    - ``replacement``: drawn with replacement, keyed by ``(stream, seed, step)``;
    - ``shuffle``: epochs, each a permutation keyed by ``(stream, seed, epoch)``, step s taking its epoch's chunk
      of n records (TRL's RepeatSampler with shuffle_dataset=True);
    - ``sequential``: epochs of the records in their order (shuffle_dataset=False).

    Steps count from 1; step s is chunk s - 1, in epoch (s - 1) // :meth:`steps_per_epoch` (of its own n: a step
    whose n differs, under --group-size-control rank, takes the chunk of that layout). An epoch's last, incomplete
    chunk is dropped, as TRL drops it. Every draw is a function of ``(seed, step)`` alone, so a
    resumed run draws what the uninterrupted one did. Rounds after the first (--sampling filter) and few-shot
    examples always draw with replacement.
    """

    def __init__(self, records: list[dict], seed: int, order: str = "replacement"):
        self.records = records
        self.seed = seed
        self.order = order

    def steps_per_epoch(self, n: int) -> int:
        """The full chunks of ``n`` records in one pass over the records (steps an epoch lasts)."""
        return len(self.records) // n

    def draw(self, step: int, n: int, stream: int = streams.DATA_DRAW, round: int = 0) -> list[dict]:
        """``n`` records of ``step``; ``round`` > 0: a further, independent draw of the same step (--sampling filter)."""
        if self.order == "replacement" or round:
            return self._with_replacement(step, n, stream, round)
        per_epoch = self.steps_per_epoch(n)
        if per_epoch == 0:
            raise DataError(
                f"--data-order {self.order}: {n} prompts per step but --data has only {len(self.records)} training "
                "records; use fewer prompts per step or --data-order replacement"
            )
        epoch, chunk = divmod(step - 1, per_epoch)
        if self.order == "shuffle":
            order = np.random.default_rng([stream, self.seed, epoch]).permutation(len(self.records))
        else:
            order = np.arange(len(self.records))
        return [self.records[i] for i in order[chunk * n : (chunk + 1) * n]]

    def _with_replacement(self, step: int, n: int, stream: int, round: int) -> list[dict]:
        rng = np.random.default_rng([stream, self.seed, step] + ([round] if round else []))
        return [self.records[i] for i in rng.integers(len(self.records), size=n)]

    def few_shot(self, n: int) -> list[dict]:
        """``n`` solved records for --few-shot, from their own stream (the same for every step)."""
        return self._with_replacement(0, n, streams.FEW_SHOT, 0)
