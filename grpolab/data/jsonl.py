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
    """Training questions drawn with replacement from a fixed list, keyed by ``(seed, step)``."""

    def __init__(self, records: list[dict], seed: int):
        self.records = records
        self.seed = seed

    def draw(self, step: int, n: int, stream: int = streams.DATA_DRAW, round: int = 0) -> list[dict]:
        """``n`` records of ``step``; ``round`` > 0: a further, independent draw of the same step (--sampling filter)."""
        rng = np.random.default_rng([stream, self.seed, step] + ([round] if round else []))
        return [self.records[i] for i in rng.integers(len(self.records), size=n)]

    def few_shot(self, n: int) -> list[dict]:
        """``n`` solved records for --few-shot, from their own stream (the same for every step)."""
        return self.draw(0, n, stream=streams.FEW_SHOT)
