"""MATH-format records (``problem``, ``solution`` with ``\\boxed{...}``) and their answer check.

Equivalence of LaTeX answers (fractions, ``\\dfrac``, decimals, equivalent expressions) is the
math-verify library's job; this module only reads files and wires math-verify in as an
accuracy reward. Records come back in the shape every loader returns (``question``,
``answer``, ``ground_truth``) plus ``"format": "math"``, which tells the accuracy reward to
use math-verify instead of numeric equality.
"""

from __future__ import annotations

from pathlib import Path

from grpolab.data.answers import last_boxed, math_equal  # noqa: F401  (math_equal: re-exported)
from grpolab.data.jsonl import DataError, iter_json_objects


def math_record(where: str, obj: dict) -> dict:
    """A MATH row (``problem``, ``solution`` with ``\\boxed{...}``) as a task record; ``where`` names the row."""
    for key in ("problem", "solution"):
        if not isinstance(obj.get(key), str):
            raise DataError(f"{where}: field {key!r} missing or not a string")
    truth = last_boxed(obj["solution"])
    if truth is None or not truth.strip():
        raise DataError(f"{where}: the solution has no \\boxed{{...}} answer")
    return {
        "question": obj["problem"],
        "answer": obj["solution"],
        "ground_truth": truth,
        "category": str(obj.get("type", obj.get("category", "math"))),
        "format": "math",
    }


def load_math_jsonl(path: str | Path) -> list[dict]:
    records = [math_record(where, obj) for where, obj in iter_json_objects(path)]
    if not records:
        raise DataError(f"{path}: no records")
    return records
