"""Tests of grpolab.data.code_task (the generated code task) and of the hand-written problems in
tests/fixtures/code_problems.jsonl. The programs here are our own, so they run in this process (exec);
stdin/stdout problems run as scripts in a subprocess."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from helpers.paths import FIXTURES

from grpolab.data.code_task import (
    FAMILIES,
    HELD_OUT,
    INSTRUCTION,
    CodeTaskSpec,
    problem,
    problem_space,
    prompt_text,
    train_set,
    write_task,
)
from grpolab.data.code_task import test_set as held_out_set  # renamed: pytest would collect 'test_set'

FIXTURES = FIXTURES
KEYS = {"prompt", "tests", "entry_point", "solution", "category"}

# The reference with every return value changed (an int or a bool flipped by one, a str or a list extended).
_OFF_BY_ONE = """
_reference = {f}


def {f}(*args):
    out = _reference(*args)
    if isinstance(out, bool):
        return not out
    return out + {{int: 1, str: "x", list: [0]}}[type(out)]
"""

# family: a plausible mistake, made by rewriting the reference; the tests must catch it in every problem.
NEAR_MISSES = {
    "is_multiple": lambda s: s.replace("== 0", "== 1"),  # a remainder of one; the tests hold a multiple
    "replace_char": lambda s: re.sub(r"\('(.)', '(.)'\)", r"('\2', '\1')", s),  # the two characters swapped
    "clamp": lambda s: s.replace("max(", "min("),  # the lower bound lost; the tests hold an x below it
    "pad_left": lambda s: s.replace(".rjust(", ".ljust("),  # padded on the wrong side
    "truncate": lambda s: re.sub(r" \+ '[^']*'", "", s),  # the marker forgotten
    "sum_filtered": lambda s: re.sub(r"v ([<>])(=?) ", lambda m: f"v {m[1]}{'' if m[2] else '='} ", s),  # < vs <=
    "spread": lambda s: s.replace("if not nums:", "if False:"),  # the empty list not handled
}


def _problems(family: str, n: int = 300, seed: int = 0, spec: CodeTaskSpec | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [problem(rng, family, spec or CodeTaskSpec()) for _ in range(n)]


def _passes(program: str, test: str, entry_point: str) -> bool:
    """Whether ``test`` holds after ``program`` ran, in a fresh namespace. A HumanEval ``def check(candidate)``
    is called with the entry point."""
    namespace: dict = {}
    try:
        exec(program, namespace)
        exec(test, namespace)
        if test.lstrip().startswith("def check("):
            namespace["check"](namespace[entry_point])
    except Exception:
        return False
    return True


def _passed(program: str, rec: dict) -> list[bool]:
    return [_passes(program, t, rec["entry_point"]) for t in rec["tests"]]


def _expected(test: str):
    """The right-hand side of ``assert f(...) == value``."""
    (stmt,) = ast.parse(test).body
    assert isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Compare), test
    return ast.literal_eval(stmt.test.comparators[0])


# ---------------------------------------------------------------- generated problems


@pytest.mark.parametrize("family", FAMILIES)
def test_records_have_the_documented_keys_and_types(family):
    for rec in _problems(family, n=50):
        assert set(rec) == KEYS and rec["category"] == family
        (message,) = rec["prompt"]
        assert message["role"] == "user" and isinstance(message["content"], str)
        assert f"`{rec['entry_point']}(" in message["content"] and message["content"].endswith(INSTRUCTION)
        assert rec["solution"].startswith(f"def {rec['entry_point']}(")
        assert isinstance(rec["tests"], list) and len(rec["tests"]) == 5
        for test in rec["tests"]:
            assert test.startswith(f"assert {rec['entry_point']}(")
            _expected(test)  # one assert statement of a literal
        assert json.loads(json.dumps(rec)) == rec


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_reference_solution_passes_all_its_tests(family):
    for rec in _problems(family):
        assert all(_passed(rec["solution"], rec)), rec


@pytest.mark.parametrize("tests_per_problem", [2, 10])
def test_tests_per_problem(tests_per_problem):
    spec = CodeTaskSpec(tests_per_problem=tests_per_problem)
    for family in FAMILIES:
        for rec in _problems(family, n=30, spec=spec):
            assert len(rec["tests"]) == tests_per_problem and all(_passed(rec["solution"], rec)), rec


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_wrong_solutions_fail(family):
    for rec in _problems(family):
        f = rec["entry_point"]
        assert not any(_passed(f"def {f}(*args):\n    return None\n", rec)), rec
        assert not any(_passed(rec["solution"] + _OFF_BY_ONE.format(f=f), rec)), rec
        # the tests expect two values at least, so no constant function passes them all
        assert len({repr(_expected(t)) for t in rec["tests"]}) > 1, rec
        constant = f"def {f}(*args):\n    return {_expected(rec['tests'][0])!r}\n"
        assert not all(_passed(constant, rec)), rec


@pytest.mark.parametrize("family", sorted(NEAR_MISSES))
@pytest.mark.slow
def test_tests_catch_a_plausible_mistake_in_every_problem(family):
    for rec in _problems(family, seed=1):
        mistaken = NEAR_MISSES[family](rec["solution"])
        assert mistaken != rec["solution"], rec["solution"]
        assert not all(_passed(mistaken, rec)), (mistaken, rec)


@pytest.mark.parametrize("family", ["truncate", "replace_char", "sum_filtered"])
@pytest.mark.slow
def test_problem_space_counts_the_distinct_prompts(family):
    # The smallest families: 15000 draws reach every one of their ~800 prompts (coupon collector: ~6000).
    space = problem_space(CodeTaskSpec(families=(family,)))
    assert len({prompt_text(r) for r in _problems(family, n=15_000, seed=2)}) == space
    assert space >= 600  # so that 2000 training + 200 test problems leave room in every family


@pytest.mark.slow
def test_problem_space_bounds_every_family():
    for family in FAMILIES:
        space = problem_space(CodeTaskSpec(families=(family,)))
        assert len({prompt_text(r) for r in _problems(family, n=2000, seed=3)}) <= space
    assert problem_space() == sum(problem_space(CodeTaskSpec(families=(f,))) for f in FAMILIES)


# ---------------------------------------------------------------- held-out and training sets


def test_test_set_is_fixed_distinct_and_nested():
    a, b = held_out_set(200), held_out_set(200)
    assert a == b
    assert len({prompt_text(r) for r in a}) == 200
    assert held_out_set(50) == a[:50]
    assert set(Counter(r["category"] for r in a)) == set(FAMILIES)


def test_train_set_never_contains_a_held_out_prompt():
    held = {prompt_text(r) for r in held_out_set(HELD_OUT)}
    train = train_set(2000, seed=0)
    prompts = [prompt_text(r) for r in train]
    assert len(set(prompts)) == 2000 and not held & set(prompts)
    exclude = set(prompts[:100])  # an explicit exclude replaces the default
    assert not exclude & {prompt_text(r) for r in train_set(500, seed=0, exclude=exclude)}


def test_families_are_sampled_uniformly():
    # 2000 draws: a family's share has std sqrt(0.1 * 0.9 / 2000) = 0.0067, so 0.1 +- 0.03 is a 4.5-sigma band.
    counts = Counter(r["category"] for r in train_set(2000, seed=5))
    assert set(counts) == set(FAMILIES)
    for family in FAMILIES:
        assert 0.07 <= counts[family] / 2000 <= 0.13, (family, counts[family])


def test_seeds_decide_the_train_set():
    assert train_set(50, seed=1) == train_set(50, seed=1)
    assert [prompt_text(r) for r in train_set(50, seed=1)] != [prompt_text(r) for r in train_set(50, seed=2)]


def test_write_task_round_trips(tmp_path):
    train_path, test_path = write_task(tmp_path / "task", n_train=40, n_test=10, seed=3)
    assert (train_path.name, test_path.name) == ("train.jsonl", "test.jsonl")
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    test = [json.loads(line) for line in test_path.read_text().splitlines()]
    assert test == held_out_set(10)
    assert len(train) == 40 and all(set(r) == KEYS for r in train)
    assert not {prompt_text(r) for r in train} & {prompt_text(r) for r in held_out_set(HELD_OUT)}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(families=()), "non-empty subset"),
        (dict(families=("affine", "sorting")), "non-empty subset"),
        (dict(families=("affine", "affine")), "without repeats"),
        (dict(tests_per_problem=1), r"tests_per_problem must be in \[2, 10\]"),
        (dict(tests_per_problem=11), r"tests_per_problem must be in \[2, 10\]"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CodeTaskSpec(**kwargs)


def test_too_many_problems_is_an_error_that_says_how_many_exist():
    spec = CodeTaskSpec(families=("truncate",))
    with pytest.raises(ValueError, match="have 624 distinct problems"):
        held_out_set(625, spec)
    with pytest.raises(ValueError, match="424 of them once 200 held-out prompts are excluded"):
        train_set(425, seed=0, spec=spec)
    with pytest.raises(ValueError, match="unknown family"):
        problem(np.random.default_rng(0), "sorting")


# ---------------------------------------------------------------- hand-written fixtures


def _fixtures(kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (FIXTURES / "code_problems.jsonl").read_text().splitlines()]
    assert sum("io" in r for r in rows) >= 2 and sum("tests" in r for r in rows) >= 3
    return [r for r in rows if kind in r]


def _stdout_lines(text: str) -> list[str]:
    """Output as compared: trailing white space of every line, and trailing empty lines, ignored."""
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _io_passed(program: str, io: list[list[str]]) -> list[bool]:
    runs = [subprocess.run([sys.executable, "-c", program], input=i, capture_output=True, text=True) for i, _ in io]
    return [r.returncode == 0 and _stdout_lines(r.stdout) == _stdout_lines(o) for r, (_, o) in zip(runs, io)]


def _check_fixture(row: dict, passed) -> None:
    assert all(passed(row["solution"])), row["prompt"]
    assert not any(passed(row["wrong"])), row["prompt"]
    partial = passed(row["partial"])
    assert sum(partial) / len(partial) == row["partial_fraction"], row["prompt"]


@pytest.mark.parametrize("row", _fixtures("tests"), ids=lambda r: r["entry_point"])
def test_fixture_function_problems(row):
    _check_fixture(row, lambda program: _passed(program, row))


@pytest.mark.parametrize("row", _fixtures("io"), ids=lambda r: r["prompt"].split(" that ")[1][:30])
@pytest.mark.slow
def test_fixture_stdin_problems(row):
    _check_fixture(row, lambda program: _io_passed(program, row["io"]))
