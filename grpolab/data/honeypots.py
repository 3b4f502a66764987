"""Honeypots: prompts with no correct answer (docs/reward-hacking.md). A reward that pays on one pays for something
other than the answer, whatever the policy has learned so far: the checker has a loophole.

- :func:`arithmetic_twins`: the built-in task's own, an unanswerable twin of each of its held-out questions (an
  operand replaced by an unknown letter) whose ``ground_truth`` no number equals;
- :func:`read_honeypots`: a file of them, records in the data's own columns.
"""

from __future__ import annotations

import re
from pathlib import Path

from grpolab.data.dataset import load_records
from grpolab.data.jsonl import DataError

NO_ANSWER = "none"
"""The ground_truth of a built-in honeypot: no number equals it (and a strict check never pays on it)."""
_LAST_NUMBER = re.compile(r"\d+(?!.*\d)")
_UNKNOWNS = "xyzkqw"  # none of them a letter of NO_ANSWER: a copied unknown is no substring of it


def arithmetic_twins(records: list[dict], n: int) -> list[dict]:
    """The unanswerable twins of the first ``n`` built-in ``records``: the question's last operand replaced by a
    letter (``12+7-3`` -> ``12+7-x``), ``ground_truth`` :data:`NO_ANSWER`, no worked answer, category ``honeypot``."""
    out = []
    for i, r in enumerate(records[:n]):
        letter = _UNKNOWNS[i % len(_UNKNOWNS)]
        question = _LAST_NUMBER.sub(letter, r["question"], count=1)
        out.append({"question": question, "ground_truth": NO_ANSWER, "category": "honeypot"})
    return out


def read_honeypots(path: str | Path, n: int) -> list[dict]:
    """The first ``n`` records of the JSONL (or any --data) file ``path``, as they are (the columns the reward reads);
    each needs a ``prompt`` or a ``question``. A file that cannot be read is a DataError naming it."""
    try:
        records = load_records(path, "rows")
    except DataError as e:
        raise DataError(f"--honeypots: {e}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"--honeypots {path}: cannot be read ({type(e).__name__}: {e})") from None
    for i, r in enumerate(records[:n], 1):
        if not isinstance(r.get("prompt", r.get("question")), (str, list)):
            raise DataError(f"--honeypots {path}: record {i} has no 'prompt' or 'question'")
    return records[:n]
