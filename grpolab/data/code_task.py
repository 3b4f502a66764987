"""A code task made by code: short Python functions to write, checked by generated tests.

Ten families, sampled uniformly, roughly from easiest to hardest for a small instruct model. Each has random
parameters, stated in its one-sentence description, so that its problems differ in their text:

============  ================================================  ===================================
family        the function returns (an example)                 an example test (``assert ...``)
============  ================================================  ===================================
affine        3 * x - 7                                         ``scale_and_shift(4) == 5``
is_multiple   True if n is a multiple of 12, else False         ``is_multiple(36) == True``
replace_char  s with every 'a' replaced by 'q'                  ``replace_char('bab') == 'bqb'``
clamp         x limited to the range [-5, 20]                   ``clamp(31) == 20``
pad_left      s padded on the left with '*' to length 6         ``pad_left('abc') == '***abc'``
truncate      s if at most 4 characters, else s[:4] + '...'     ``truncate('abcdef') == 'abcd...'``
count_chars   how many characters of s are 'a', 'e' or 'k'      ``count_chars('keep') == 3``
sum_filtered  the sum of the elements of nums greater than 10   ``sum_filtered([3, 11, 12]) == 23``
map_list      the list of 2 * v + 1 for each element v of nums  ``map_list([1, 5]) == [3, 11]``
spread        max(nums) - min(nums), or 7 if nums is empty      ``spread([]) == 7``
============  ================================================  ===================================

A record is a plain dict in the trainer's ``prompt`` format (every column but ``prompt`` reaches the rewards)::

    {"prompt": [{"role": "user", "content": "Write a Python function ... Reply with ..."}],
     "tests": ["assert scale_and_shift(4) == 5", ...], "entry_point": "scale_and_shift",
     "solution": "def scale_and_shift(x: int) -> int:\\n    return 3 * x - 7\\n", "category": "affine"}

Expected values come from plain Python in this module (no code is executed); the tests of every problem expect
at least two different values, so no constant function passes. The held-out set comes from ``TEST_SEED``;
training draws reject every prompt of the held-out set, so no training prompt equals a test prompt.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

TEST_SEED = 20_250_301  # fixed forever: changing it changes every reported pass rate
HELD_OUT = 200  # training never repeats a prompt of the first HELD_OUT test problems
INSTRUCTION = "Reply with the function in a ```python code block."
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_FILLS = "*-.#_0+=~@!$%&/|"  # no quote or backslash: repr() is the character itself
_MARKERS = ("...", "..", "~", "+", "*", "--", ">>", "!")
_OPS = {">": "greater than", ">=": "greater than or equal to", "<": "less than", "<=": "less than or equal to"}

Calls = list[tuple[tuple, object]]  # (arguments, expected value) per test
Drawn = tuple[str, list[str], Calls]  # what the function returns (in words), its body's lines, its tests


def _word(rng: np.random.Generator, length: int, alphabet: str = _LETTERS) -> str:
    return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=length))


def _plant(rng: np.random.Generator, s: str, chars: str, count: int) -> str:
    """``s`` with ``count`` characters drawn from ``chars`` inserted at random places."""
    out = list(s)
    for _ in range(count):
        out.insert(int(rng.integers(len(out) + 1)), chars[int(rng.integers(len(chars)))])
    return "".join(out)


def _linear(a: int, var: str, b: int) -> str:
    """``a * var + b`` as a person writes it: ``3 * x - 7``."""
    return f"{a} * {var} {'-' if b < 0 else '+'} {abs(b)}"


def _affine(rng, n) -> Drawn:
    a, b = int(rng.choice([*range(-9, 0), *range(2, 10)])), int(rng.integers(-99, 100))
    xs = rng.choice(np.arange(-50, 51), size=n, replace=False).tolist()
    return f"returns {_linear(a, 'x', b)}", [f"return {_linear(a, 'x', b)}"], [((x,), a * x + b) for x in xs]


def _is_multiple(rng, n) -> Drawn:
    k = int(rng.integers(2, 1000))
    hit = rng.permutation(n) < rng.integers(1, n)  # 1 to n-1 multiples, the rest not
    ms = rng.choice(np.arange(-30, 31), size=n, replace=False).tolist()
    xs = [k * m + (0 if h else int(rng.integers(1, k))) for m, h in zip(ms, hit)]
    what = f"returns True if n is a multiple of {k} and False otherwise"
    return what, [f"return n % {k} == 0"], [((x,), x % k == 0) for x in xs]


def _replace_char(rng, n) -> Drawn:
    old, new = (_LETTERS[i] for i in rng.choice(26, size=2, replace=False))
    strings = [_plant(rng, _word(rng, int(rng.integers(2, 9))), old, int(rng.integers(1, 4))) for _ in range(n)]
    what = f"returns s with every {old!r} replaced by {new!r}"
    return what, [f"return s.replace({old!r}, {new!r})"], [((s,), s.replace(old, new)) for s in strings]


def _clamp(rng, n) -> Drawn:
    lo = int(rng.integers(-50, 51))
    hi = lo + int(rng.integers(1, 61))
    xs = [lo - int(rng.integers(1, 30)), hi + int(rng.integers(1, 30)), *rng.integers(lo, hi + 1, size=n - 2).tolist()]
    what = f"returns x limited to the range [{lo}, {hi}]: {lo} if x < {lo}, {hi} if x > {hi}, else x"
    calls = [((x,), max(lo, min(hi, x))) for x in rng.permutation(xs).tolist()]
    return what, [f"return max({lo}, min({hi}, x))"], calls


def _pad_left(rng, n) -> Drawn:
    fill, width = _FILLS[int(rng.integers(len(_FILLS)))], int(rng.integers(4, 61))
    # one string at least is shorter than width, and not empty (so that ljust would differ)
    lengths = [int(rng.integers(max(1, width - 6), width)), *rng.integers(max(0, width - 6), width + 3, size=n - 1)]
    strings = [_word(rng, int(length)) for length in rng.permutation(lengths)]
    what = f"returns s padded on the left with {fill!r} characters to length {width} (s itself if already that long)"
    return what, [f"return s.rjust({width}, {fill!r})"], [((s,), s.rjust(width, fill)) for s in strings]


def _truncate(rng, n) -> Drawn:
    limit, marker = int(rng.integers(3, 81)), _MARKERS[int(rng.integers(len(_MARKERS)))]
    lengths = [int(rng.integers(limit + 1, limit + 6)), *rng.integers(max(0, limit - 3), limit + 6, size=n - 1)]
    strings = [_word(rng, int(length)) for length in rng.permutation(lengths)]  # one longer than limit at least
    what = f"returns s if it has at most {limit} characters, else its first {limit} characters followed by {marker!r}"
    body = [f"return s if len(s) <= {limit} else s[:{limit}] + {marker!r}"]
    return what, body, [((s,), s if len(s) <= limit else s[:limit] + marker) for s in strings]


def _count_chars(rng, n) -> Drawn:
    chars = "".join(sorted(_LETTERS[i] for i in rng.choice(26, size=int(rng.integers(1, 4)), replace=False)))
    others = "".join(c for c in _LETTERS if c not in chars)
    counts = rng.choice(n + 2, size=n, replace=False).tolist()
    strings = [_plant(rng, _word(rng, int(rng.integers(2, 9)), others), chars, c) for c in counts]
    if len(chars) == 1:
        what, body = f"returns the number of times the character {chars!r} occurs in s", f"return s.count({chars!r})"
    else:
        listed = ", ".join(map(repr, chars[:-1])) + f" or {chars[-1]!r}"
        what, body = f"returns how many characters of s are {listed}", f"return sum(c in {chars!r} for c in s)"
    return what, [body], [((s,), c) for s, c in zip(strings, counts)]


def _sum_filtered(rng, n) -> Drawn:
    op = list(_OPS)[int(rng.integers(len(_OPS)))]
    k = int(rng.choice([*range(-100, 0), *range(1, 101)]))  # k != 0, so that > and >= differ when k is in nums
    lists = [rng.integers(k - 15, k + 16, size=int(rng.integers(0, 8))).tolist() for _ in range(n)]
    lists[0].insert(int(rng.integers(len(lists[0]) + 1)), k)
    cmp = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}[op]
    what = f"returns the sum of the elements of nums that are {_OPS[op]} {k}"
    calls = [((xs,), sum(v for v in xs if cmp(v, k))) for xs in (lists[i] for i in rng.permutation(n))]
    return what, [f"return sum(v for v in nums if v {op} {k})"], calls


def _map_list(rng, n) -> Drawn:
    m, c = int(rng.choice([*range(-9, 0), *range(2, 10)])), int(rng.integers(-50, 51))
    lists = [rng.integers(-20, 21, size=int(rng.integers(0, 7))).tolist() for _ in range(n)]
    what = f"returns the list of {_linear(m, 'v', c)} for each element v of nums, in order"
    return what, [f"return [{_linear(m, 'v', c)} for v in nums]"], [((xs,), [m * v + c for v in xs]) for xs in lists]


def _spread(rng, n) -> Drawn:
    d = int(rng.integers(-999, 1000))
    lists = [[], *(rng.integers(-50, 51, size=int(rng.integers(1, 8))).tolist() for _ in range(n - 1))]
    what = f"returns the largest element of nums minus the smallest one, or {d} if nums is empty"
    body = ["if not nums:", f"    return {d}", "return max(nums) - min(nums)"]
    return what, body, [((xs,), max(xs) - min(xs) if xs else d) for xs in (lists[i] for i in rng.permutation(n))]


class _Family(NamedTuple):
    entry_point: str
    signature: str
    draw: Callable[[np.random.Generator, int], Drawn]
    space: int  # distinct descriptions: the product of the sizes of the parameter ranges in ``draw``


_FAMILIES = {
    "affine": _Family("scale_and_shift", "(x: int) -> int", _affine, 17 * 199),
    "is_multiple": _Family("is_multiple", "(n: int) -> bool", _is_multiple, 998),
    "replace_char": _Family("replace_char", "(s: str) -> str", _replace_char, 26 * 25),
    "clamp": _Family("clamp", "(x: int) -> int", _clamp, 101 * 60),
    "pad_left": _Family("pad_left", "(s: str) -> str", _pad_left, 16 * 57),
    "truncate": _Family("truncate", "(s: str) -> str", _truncate, 78 * 8),
    "count_chars": _Family("count_chars", "(s: str) -> int", _count_chars, 26 + 26 * 25 // 2 + 26 * 25 * 24 // 6),
    "sum_filtered": _Family("sum_filtered", "(nums: list[int]) -> int", _sum_filtered, 4 * 200),
    "map_list": _Family("map_list", "(nums: list[int]) -> list[int]", _map_list, 17 * 101),
    "spread": _Family("spread", "(nums: list[int]) -> int", _spread, 1999),
}
FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


@dataclasses.dataclass(frozen=True)
class CodeTaskSpec:
    """Which problems the task generates."""

    families: tuple[str, ...] = FAMILIES
    """Families to sample from, uniformly."""
    tests_per_problem: int = 5
    """Assert statements per problem (at least 2, so that every problem's tests expect two different values)."""

    def __post_init__(self) -> None:
        unknown = set(self.families) - set(FAMILIES)
        if unknown or not self.families or len(set(self.families)) != len(self.families):
            raise ValueError(f"families must be a non-empty subset of {FAMILIES} without repeats, got {self.families}")
        if not 2 <= self.tests_per_problem <= 10:
            raise ValueError(f"tests_per_problem must be in [2, 10], got {self.tests_per_problem}")


def problem_space(spec: CodeTaskSpec = CodeTaskSpec()) -> int:
    """How many distinct problems (prompt texts) ``spec`` can produce."""
    return sum(_FAMILIES[f].space for f in spec.families)


def prompt_text(record: dict) -> str:
    """The text of a record's (one-message) prompt: what makes two problems the same."""
    return record["prompt"][0]["content"]


def problem(rng: np.random.Generator, family: str, spec: CodeTaskSpec = CodeTaskSpec()) -> dict:
    """One problem of ``family``, its tests and its reference solution, drawn from ``rng``."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; families are {FAMILIES}")
    fam = _FAMILIES[family]
    while True:  # a constant function must fail: redraw the rare problem whose tests all expect one value
        what, body, calls = fam.draw(rng, spec.tests_per_problem)
        if len({repr(want) for _, want in calls}) > 1:
            break
    text = f"Write a Python function `{fam.entry_point}{fam.signature}` that {what}.\n\n{INSTRUCTION}"
    solution = f"def {fam.entry_point}{fam.signature}:\n" + "".join(f"    {line}\n" for line in body)
    tests = [f"assert {fam.entry_point}({', '.join(map(repr, args))}) == {want!r}" for args, want in calls]
    message = {"role": "user", "content": text}
    return dict(prompt=[message], tests=tests, entry_point=fam.entry_point, solution=solution, category=family)


def _draw_unique(rng: np.random.Generator, n: int, spec: CodeTaskSpec, exclude: set[str]) -> list[dict]:
    available = problem_space(spec) - len(exclude)
    if n > available:
        raise ValueError(
            f"{n} problems requested, but families {spec.families} have {problem_space(spec)} distinct problems"
            + (f", {available} of them once {len(exclude)} held-out prompts are excluded" if exclude else "")
        )
    seen, out = set(exclude), []
    for _ in range(10 * n + 1000):  # bounded: the last problems of a nearly full space come slowly (coupon collector)
        if len(out) == n:
            return out
        family = spec.families[int(rng.integers(len(spec.families)))]
        for _ in range(100):  # redraw within the family, so that a family with repeats keeps its share
            rec = problem(rng, family, spec)
            if prompt_text(rec) not in seen:
                seen.add(prompt_text(rec))
                out.append(rec)
                break
    raise RuntimeError(f"drew only {len(out)} of {n} distinct problems: ask for fewer than {problem_space(spec)}")


def test_set(n: int, spec: CodeTaskSpec = CodeTaskSpec()) -> list[dict]:
    """The fixed held-out set: ``n`` distinct problems from ``TEST_SEED`` (a smaller set is a prefix of a larger)."""
    return _draw_unique(np.random.default_rng(TEST_SEED), n, spec, set())


def train_set(n: int, seed: int, spec: CodeTaskSpec = CodeTaskSpec(), exclude: set[str] | None = None) -> list[dict]:
    """``n`` distinct training problems from ``seed``, none with a prompt text in ``exclude``
    (default: the prompts of ``test_set(HELD_OUT, spec)``)."""
    if exclude is None:
        exclude = {prompt_text(r) for r in test_set(HELD_OUT, spec)}
    return _draw_unique(np.random.default_rng(seed), n, spec, set(exclude))


def write_task(
    out_dir: str | Path, n_train: int, n_test: int, seed: int, spec: CodeTaskSpec = CodeTaskSpec()
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``; training excludes the prompts of the written
    test set and of ``test_set(HELD_OUT)``. Returns their paths."""
    held_out = test_set(max(n_test, HELD_OUT), spec)
    train = train_set(n_train, seed, spec, exclude={prompt_text(r) for r in held_out})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, records in zip(paths, (train, held_out[:n_test])):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


@dataclasses.dataclass
class CodeTaskConfig:
    """Write the generated code task as prompt-format data: train.jsonl and test.jsonl (held out), to train on with
    --data DIR/train.jsonl --eval-data DIR/test.jsonl --reward-fn grpolab.rewards:code_reward."""

    out: str = "data/code"
    """Directory to write train.jsonl and test.jsonl into."""
    train: int = 2000
    """Training problems (distinct; none is a held-out one)."""
    test: int = 200
    """Held-out problems (the same for every --seed: they come from a fixed seed)."""
    seed: int = 0
    """Seed of the training problems."""
    families: tuple[str, ...] = FAMILIES
    """Problem families, sampled uniformly."""
    tests_per_problem: int = 5
    """Assert statements per problem."""
