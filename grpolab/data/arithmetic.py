"""The built-in task: synthetic integer arithmetic [U-statistic, Sec. 5.1].

Five categories, sampled uniformly:

==========  =====================================  ======================
category    question                               worked solution
==========  =====================================  ======================
add_sub_2   ``12+7-3``                             ``12+7=19`` / ``19-3=16``
add_sub_3   ``12+7-3+40``                          three lines, left to right
mul         ``23*7``                               ``20*7=140`` / ``3*7=21`` / ``140+21=161``
div         ``161/7``  (exact)                     ``161/7=23``
paren       ``45-(12+7)``                          ``12+7=19`` / ``45-19=26``
==========  =====================================  ======================

Every worked solution ends with a ``#### <answer>`` line, the GSM8K convention
that the rewards parse. A record is a plain dict::

    {"question": "12+7-3", "answer": "12+7=19\\n19-3=16\\n#### 16",
     "ground_truth": "16", "category": "add_sub_2"}

Three fixed sets come from fixed seeds: the held-out *test* set (evaluation),
the 500-question *probe* set of [U-statistic, Sec. 5.1] (used by the gradient probes), and
training draws, which come from a generator keyed by ``(seed, step)`` and
reject any question whose text is in the test set, so no training question can
equal a test question.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from grpolab.common import streams
from grpolab.config.task import CATEGORIES

TEST_SEED = 20_240_001  # fixed forever: changing it changes every reported accuracy
PROBE_SEED = 20_240_002  # the 500-question set of [U-statistic, Sec. 5.1]


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty of the generated questions."""

    max_operand: int = 99
    """Largest operand of additions and subtractions, the multiplicand and the quotient."""
    mul_max: int = 9
    """Largest multiplier and divisor (single digit by default)."""
    categories: tuple[str, ...] = CATEGORIES
    """Categories to sample from, uniformly."""

    def __post_init__(self) -> None:
        if self.max_operand < 10:
            raise ValueError(f"max_operand must be >= 10, got {self.max_operand}")
        if not 2 <= self.mul_max <= self.max_operand:
            raise ValueError(f"mul_max must be in [2, max_operand], got {self.mul_max}")
        unknown = set(self.categories) - set(CATEGORIES)
        if unknown or not self.categories:
            raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}, got {self.categories}")


def _add_sub_chain(rng: np.random.Generator, spec: ArithmeticSpec, n_ops: int) -> tuple[str, list[str], int]:
    operands = rng.integers(1, spec.max_operand + 1, size=n_ops + 1).tolist()
    ops = rng.choice(["+", "-"], size=n_ops).tolist()
    question = str(operands[0])
    lines = []
    acc = operands[0]
    for op, x in zip(ops, operands[1:]):
        question += f"{op}{x}"
        new = acc + x if op == "+" else acc - x
        lines.append(f"{acc}{op}{x}={new}")
        acc = new
    return question, lines, acc


def _mul(rng: np.random.Generator, spec: ArithmeticSpec) -> tuple[str, list[str], int]:
    a = int(rng.integers(2, spec.max_operand + 1))
    b = int(rng.integers(2, spec.mul_max + 1))
    product = a * b
    tens, units = a - a % 10, a % 10
    if tens == 0 or units == 0:
        lines = [f"{a}*{b}={product}"]
    else:  # split the multiplicand into tens and units: two easy products and a sum
        lines = [f"{tens}*{b}={tens * b}", f"{units}*{b}={units * b}", f"{tens * b}+{units * b}={product}"]
    return f"{a}*{b}", lines, product


def _div(rng: np.random.Generator, spec: ArithmeticSpec) -> tuple[str, list[str], int]:
    quotient = int(rng.integers(2, spec.max_operand + 1))
    divisor = int(rng.integers(2, spec.mul_max + 1))
    dividend = quotient * divisor
    return f"{dividend}/{divisor}", [f"{dividend}/{divisor}={quotient}"], quotient


def _paren(rng: np.random.Generator, spec: ArithmeticSpec) -> tuple[str, list[str], int]:
    a, b, c = rng.integers(1, spec.max_operand + 1, size=3).tolist()
    op_out, op_in = rng.choice(["+", "-"], size=2).tolist()
    inner = b + c if op_in == "+" else b - c
    result = a + inner if op_out == "+" else a - inner
    lines = [f"{b}{op_in}{c}={inner}", f"{a}{op_out}{inner}={result}"]
    return f"{a}{op_out}({b}{op_in}{c})", lines, result


def question_space(spec: ArithmeticSpec = ArithmeticSpec()) -> int:
    """How many distinct questions ``spec`` can produce (a question's text determines its operands)."""
    m, k = spec.max_operand, spec.mul_max
    sizes = {
        "add_sub_2": m**3 * 2**2,
        "add_sub_3": m**4 * 2**3,
        "mul": (m - 1) * (k - 1),
        "div": (m - 1) * (k - 1),
        "paren": m**3 * 2**2,
    }
    return sum(sizes[c] for c in spec.categories)


def held_out_size(spec: ArithmeticSpec, eval_questions: int) -> int:
    """Questions kept out of training: the first 500 of the test set (or ``eval_questions``, if more),
    but never more than half of a small task's questions, so that training has the other half."""
    held = min(max(500, eval_questions), question_space(spec) // 2)
    if eval_questions > held:
        raise ValueError(
            f"{eval_questions} held-out questions requested, but {spec.categories} with max_operand "
            f"{spec.max_operand}, mul_max {spec.mul_max} has {question_space(spec)} distinct questions: "
            f"at most {held} (half) can be held out"
        )
    return held


def make_question(rng: np.random.Generator, spec: ArithmeticSpec = ArithmeticSpec()) -> dict:
    """Draw one question of a uniformly chosen category."""
    category = spec.categories[int(rng.integers(len(spec.categories)))]
    if category == "add_sub_2":
        q, lines, ans = _add_sub_chain(rng, spec, 2)
    elif category == "add_sub_3":
        q, lines, ans = _add_sub_chain(rng, spec, 3)
    elif category == "mul":
        q, lines, ans = _mul(rng, spec)
    elif category == "div":
        q, lines, ans = _div(rng, spec)
    else:
        q, lines, ans = _paren(rng, spec)
    answer = "\n".join(lines + [f"#### {ans}"])
    return {"question": q, "answer": answer, "ground_truth": str(ans), "category": category}


def _draw_unique(rng: np.random.Generator, n: int, spec: ArithmeticSpec, exclude: set[str]) -> list[dict]:
    seen = set(exclude)
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct questions: the question space of {spec} is too small")
        rec = make_question(rng, spec)
        if rec["question"] not in seen:
            seen.add(rec["question"])
            out.append(rec)
    return out


def test_set(n: int = 500, spec: ArithmeticSpec = ArithmeticSpec()) -> list[dict]:
    """The fixed held-out evaluation set: ``n`` distinct questions from ``TEST_SEED``."""
    return _draw_unique(np.random.default_rng(TEST_SEED), n, spec, set())


def probe_set(n: int = 500, spec: ArithmeticSpec = ArithmeticSpec()) -> list[dict]:
    """The fixed 500-question set of [U-statistic, Sec. 5.1], used by the gradient probes."""
    return _draw_unique(np.random.default_rng(PROBE_SEED), n, spec, set())


class TrainSampler:
    """Training questions as a pure function of ``(seed, step)``.

    Keying every draw on the step (not on a running generator) makes a resumed
    run draw exactly what an uninterrupted run would have drawn, with no
    sampler state to checkpoint.
    """

    def __init__(self, seed: int, spec: ArithmeticSpec = ArithmeticSpec(), exclude: Iterable[str] = ()):
        self.seed = seed
        self.spec = spec
        self.exclude = set(exclude)

    def draw(self, step: int, n: int, stream: int = streams.TRAIN_DRAW, round: int = 0) -> list[dict]:
        """``n`` questions of ``step``; ``round`` > 0: a further, independent draw of the same step (--sampling filter)."""
        rng = np.random.default_rng([stream, self.seed, step] + ([round] if round else []))
        out = []
        while len(out) < n:
            rec = make_question(rng, self.spec)
            if rec["question"] not in self.exclude:  # never train on a test question
                out.append(rec)
        return out

    def few_shot(self, n: int) -> list[dict]:
        """``n`` solved training questions for --few-shot, from their own stream (the same for every step)."""
        return self.draw(0, n, stream=streams.FEW_SHOT)
