"""Tests of grpolab.data: the arithmetic generator (unit + statistical) and the JSONL loader."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import FIXTURES

from grpolab.data import ArithmeticSpec, DataError, ListSampler, TrainSampler, load_gsm8k_jsonl, make_question
from grpolab.data.arithmetic import CATEGORIES, held_out_size, probe_set, question_space
from grpolab.data.arithmetic import test_set as held_out_set  # renamed: pytest would collect 'test_set'

FIXTURES = FIXTURES
LINE = re.compile(r"^(-?\d+)([+\-*/])(-?\d+)=(-?\d+)$")  # one worked step: x op y=z


def _draws(n: int, seed: int = 0, spec: ArithmeticSpec | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [make_question(rng, spec or ArithmeticSpec()) for _ in range(n)]


def _python_value(question: str) -> int:
    """The question evaluated by Python, '/' as exact integer division."""
    assert re.fullmatch(r"[0-9+\-*/()]+", question), question
    for dividend, divisor in re.findall(r"(\d+)/(\d+)", question):
        assert int(dividend) % int(divisor) == 0, f"{question}: inexact division"
    return eval(question.replace("/", "//"), {"__builtins__": {}})  # noqa: S307 - digits and operators only


# ---------------------------------------------------------------- generator


def test_same_seed_same_questions_and_different_seed_different():
    assert _draws(50, seed=3) == _draws(50, seed=3)
    assert [r["question"] for r in _draws(50, seed=3)] != [r["question"] for r in _draws(50, seed=4)]


def test_categories_are_roughly_uniform():
    # 2000 draws: the share of each of 5 categories has std sqrt(0.2 * 0.8 / 2000) = 0.009,
    # so 0.2 +- 0.04 is a 4.5-sigma band.
    counts = Counter(r["category"] for r in _draws(2000, seed=11))
    assert set(counts) == set(CATEGORIES)
    for cat in CATEGORIES:
        assert 0.16 <= counts[cat] / 2000 <= 0.24, (cat, counts[cat])


def test_restricted_categories_only():
    spec = ArithmeticSpec(categories=("mul", "div"))
    assert {r["category"] for r in _draws(200, spec=spec)} == {"mul", "div"}


@pytest.mark.parametrize("spec", [ArithmeticSpec(), ArithmeticSpec(max_operand=20, mul_max=5)])
def test_ground_truth_is_pythons_value_and_worked_solution_is_true(spec):
    for rec in _draws(1500, seed=2, spec=spec):
        q, truth = rec["question"], rec["ground_truth"]
        assert set(rec) == {"question", "answer", "ground_truth", "category"}
        assert int(truth) == _python_value(q), rec
        lines = rec["answer"].split("\n")
        assert lines[-1] == f"#### {truth}", rec
        assert len(lines) >= 2
        for line in lines[:-1]:
            m = LINE.match(line)
            assert m, f"malformed step {line!r} in {rec}"
            x, op, y, z = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
            value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y and x % y == 0 else None}[op]
            assert value == z, f"false step {line!r} in {rec}"
        # the last worked step gives the answer
        assert LINE.match(lines[-2]).group(4) == truth


@pytest.mark.parametrize("spec", [ArithmeticSpec(), ArithmeticSpec(max_operand=20, mul_max=5)])
def test_operands_respect_max_operand_and_mul_max(spec):
    M, K = spec.max_operand, spec.mul_max
    for rec in _draws(1500, seed=5, spec=spec):
        q, cat = rec["question"], rec["category"]
        nums = [int(x) for x in re.findall(r"\d+", q)]
        if cat in ("add_sub_2", "add_sub_3", "paren"):
            assert len(nums) == {"add_sub_2": 3, "add_sub_3": 4, "paren": 3}[cat], q
            assert all(1 <= x <= M for x in nums), q
        elif cat == "mul":
            a, b = nums
            assert 2 <= a <= M and 2 <= b <= K, q
        else:  # div: divisor <= mul_max, quotient <= max_operand
            dividend, divisor = nums
            assert 2 <= divisor <= K and dividend % divisor == 0 and 2 <= dividend // divisor <= M, q


def test_spec_validation():
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticSpec(max_operand=5)
    with pytest.raises(ValueError, match="mul_max"):
        ArithmeticSpec(mul_max=1)
    with pytest.raises(ValueError, match="categories"):
        ArithmeticSpec(categories=("pow",))


def test_test_set_is_500_distinct_fixed_questions():
    ts = held_out_set()
    assert len(ts) == 500
    assert len({r["question"] for r in ts}) == 500
    assert ts == held_out_set()  # fixed forever (fixed seed)


def test_probe_set_is_500_distinct_questions_from_its_own_seed():
    ps = probe_set()
    assert len({r["question"] for r in ps}) == 500
    assert ps == probe_set()
    assert [r["question"] for r in ps[:20]] != [r["question"] for r in held_out_set()[:20]]


# ---------------------------------------------------------------- training sampler


def test_train_sampler_never_returns_a_test_question():
    test_q = {r["question"] for r in held_out_set()}
    guarded = TrainSampler(seed=0, exclude=test_q)
    unguarded = TrainSampler(seed=0)
    drawn = [r["question"] for step in range(150) for r in guarded.draw(step, 16)]
    assert len(drawn) == 2400
    assert not test_q.intersection(drawn)
    # The check has power: mul and div have only 98 * 8 = 784 questions each, so unguarded
    # draws of the same steps do hit the test set.
    leaked = sum(r["question"] in test_q for step in range(150) for r in unguarded.draw(step, 16))
    assert leaked > 10


def test_train_sampler_is_a_pure_function_of_seed_and_step():
    exclude = {r["question"] for r in held_out_set()}
    a = TrainSampler(seed=1, exclude=exclude)
    first = a.draw(7, 10)
    for step in (0, 3, 8, 7, 100):  # interleaved draws leave no state behind
        a.draw(step, 5)
    assert a.draw(7, 10) == first
    assert TrainSampler(seed=1, exclude=exclude).draw(7, 10) == first
    assert [r["question"] for r in a.draw(8, 10)] != [r["question"] for r in first]
    assert [r["question"] for r in TrainSampler(seed=2, exclude=exclude).draw(7, 10)] != [r["question"] for r in first]
    assert len(first) == 10


# ---------------------------------------------------------------- JSONL


def test_load_gsm8k_jsonl_fixture():
    recs = load_gsm8k_jsonl(FIXTURES / "gsm8k_small.jsonl")  # 5 records and a blank line
    assert [r["ground_truth"] for r in recs] == ["7", "1200", "-2", "2.5", "84"]
    assert recs[0]["question"] == "Tom has 3 apples and buys 4 more. How many apples does he have?"
    assert recs[1]["answer"] == "40*30=1200 pens.\n#### 1,200"
    assert [r["category"] for r in recs] == ["jsonl", "jsonl", "money", "jsonl", "jsonl"]
    assert all(set(r) == {"question", "answer", "ground_truth", "category"} for r in recs)


def test_list_sampler_is_keyed_by_seed_and_step():
    recs = load_gsm8k_jsonl(FIXTURES / "gsm8k_small.jsonl")
    s = ListSampler(recs, seed=0)
    assert s.draw(3, 20) == ListSampler(recs, seed=0).draw(3, 20)
    assert all(r in recs for r in s.draw(3, 20))
    assert len({r["question"] for r in s.draw(4, 50)}) == 5  # with replacement, 50 draws cover 5 records


def _write(tmp_path: Path, lines: list[str], name: str = "broken.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"question": "1+1", "answer": "1+1=2\n#### 2"})


@pytest.mark.parametrize(
    "bad_line, phrase",
    [
        ('{"question": "1+1", "answer": ', "not valid JSON"),
        (json.dumps({"question": "1+1"}), "'answer'"),
        (json.dumps({"answer": "#### 2"}), "'question'"),
        (json.dumps({"question": "1+1", "answer": "the answer is 2"}), "####"),
        (json.dumps({"question": "1+1", "answer": "#### two"}), "no number"),
        (json.dumps(["1+1", "2"]), "JSON object"),
    ],
)
def test_malformed_line_3_names_file_and_line(tmp_path, bad_line, phrase):
    path = _write(tmp_path, [GOOD, GOOD, bad_line, GOOD], name="my_data.jsonl")
    with pytest.raises(DataError) as info:
        load_gsm8k_jsonl(path)
    msg = str(info.value)
    assert "my_data.jsonl:3" in msg, msg
    assert phrase in msg, msg


def test_line_numbers_count_blank_lines(tmp_path):
    path = _write(tmp_path, [GOOD, "", "not json"])
    with pytest.raises(DataError, match=r"broken\.jsonl:3"):
        load_gsm8k_jsonl(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_gsm8k_jsonl(tmp_path / "nope.jsonl")
    empty = _write(tmp_path, [""], name="empty.jsonl")
    with pytest.raises(DataError, match="empty.jsonl"):
        load_gsm8k_jsonl(empty)


@pytest.mark.parametrize(
    "spec",
    [
        ArithmeticSpec(12, 4, ("mul", "div")),
        ArithmeticSpec(10, 3, ("add_sub_2",)),
        ArithmeticSpec(10, 5, ("paren", "mul")),
    ],
)
@pytest.mark.slow
def test_question_space_counts_what_the_generator_can_draw(spec):
    rng = np.random.default_rng(0)
    seen = {make_question(rng, spec)["question"] for _ in range(150_000)}
    assert len(seen) == question_space(spec)


def test_small_task_holds_out_half_and_trains_on_the_rest():
    spec = ArithmeticSpec(20, 5, ("mul",))  # 19 * 4 = 76 questions
    assert held_out_size(spec, 30) == 38
    with pytest.raises(ValueError, match="76 distinct questions: at most 38"):
        held_out_size(spec, 50)
    assert held_out_size(ArithmeticSpec(), 200) == 500  # the built-in task: the fixed 500
    test_q = {r["question"] for r in held_out_set(38, spec)}
    train_q = {r["question"] for r in TrainSampler(0, spec, exclude=test_q).draw(1, 400)}
    assert not train_q & test_q and len(train_q | test_q) == 76
