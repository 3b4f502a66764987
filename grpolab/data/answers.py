"""Reading the answer out of a text, and comparing answers: the one place data loaders and rewards share.

A leaf module (it imports nothing from grpolab), so that the loaders (which read the ground
truth from a solution) and the rewards (which read the answer from a completion) use the same
parsing without importing each other.
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number: optional sign (a '-' right after a digit or ')' is an operator, not a sign),
# digits with optional thousands commas, optional decimals. A trailing period is not part of it.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\d[\d,]*(?:\.\d+)?")


def _clean(num: str) -> str:
    return num.replace(",", "")


def extract_final_number(text: str) -> str | None:
    """The answer a completion gives: the number after the last ``####``, else the
    last number in the text; commas removed. ``None`` when there is none."""
    if "####" in text:
        m = _NUMBER.search(text.rsplit("####", 1)[1])
        return _clean(m.group()) if m else None
    found = _NUMBER.findall(text)
    return _clean(found[-1]) if found else None


_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


def answer_spans(text: str) -> tuple[tuple[int, int] | None, list[tuple[int, int]]]:
    """Where a completion's final answer lies: ``(answer, markers)``, character ranges ``[start, end)`` of ``text``.

    The answer is what the rewards read: the number after the last ``####`` (as
    :func:`extract_final_number`), else the contents of the last ``\\boxed{...}``, else the last
    fenced code block, else the last number. ``markers`` are the format's own characters around it:
    ``####`` and the space before the number, ``\\boxed{`` and its ``}``, the fence lines.
    ``(None, [])`` when the text holds no answer.
    """
    if "####" in text:
        p = text.rfind("####")
        m = _NUMBER.search(text, p + 4)
        if m is None:
            return None, [(p, p + 4)]
        return (m.start(), m.end()), [(p, m.start())]
    start = text.rfind("\\boxed{")
    inner = last_boxed(text) if start >= 0 else None
    if inner is not None:
        a = start + len("\\boxed{")
        return (a, a + len(inner)), [(start, a), (a + len(inner), a + len(inner) + 1)]
    fences = list(_FENCE.finditer(text))
    if fences:
        m = fences[-1]
        return (m.start(1), m.end(1)), [(m.start(), m.start(1)), (m.end(1), m.end())]
    found = list(_NUMBER.finditer(text))
    return ((found[-1].start(), found[-1].end()) if found else None), []


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Exact numeric equality of two decimal strings (``"16"`` == ``"16.0"``)."""
    if a is None or b is None:
        return False
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a.strip() == b.strip()


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


def math_equal(completion: str, truth_latex: str) -> bool:
    """math-verify's equivalence of the completion's final answer and the boxed truth."""
    from math_verify import parse, verify

    gold = parse("$" + truth_latex + "$")
    return bool(gold) and bool(verify(gold, parse(completion)))
