"""MATH-format records (``problem``, ``solution`` with ``\\boxed{...}``) and their answer check.

Equivalence of LaTeX answers (fractions, ``\\dfrac``, decimals, equivalent expressions) is the
math-verify library's job; this module only reads files and wires math-verify in as an
accuracy reward. Records come back in the shape every loader returns (``question``,
``answer``, ``ground_truth``) plus ``"format": "math"``, which tells the accuracy reward to
use math-verify instead of numeric equality.
"""

from __future__ import annotations

from pathlib import Path

from grpolab.data.jsonl import DataError, iter_json_objects


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (braces balanced), or None.

    Written by hand because the stored ground truth must be the exact LaTeX the
    solution boxes; math-verify parses it afterwards.
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def load_math_jsonl(path: str | Path) -> list[dict]:
    records = []
    for where, obj in iter_json_objects(path):
        for key in ("problem", "solution"):
            if not isinstance(obj.get(key), str):
                raise DataError(f"{where}: field {key!r} missing or not a string")
        truth = last_boxed(obj["solution"])
        if truth is None or not truth.strip():
            raise DataError(f"{where}: the solution has no \\boxed{{...}} answer")
        records.append({"question": obj["problem"], "answer": obj["solution"], "ground_truth": truth,
                        "category": str(obj.get("type", obj.get("category", "math"))), "format": "math"})
    if not records:
        raise DataError(f"{path}: no records")
    return records


def math_equal(completion: str, truth_latex: str) -> bool:
    """math-verify's equivalence of the completion's final answer and the boxed truth."""
    from math_verify import parse, verify

    gold = parse("$" + truth_latex + "$")
    return bool(gold) and bool(verify(gold, parse(completion)))
