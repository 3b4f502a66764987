"""Honeypots: the built-in task's unanswerable twins, and a file of them."""

from __future__ import annotations

import json

import pytest

from grpolab.data import arithmetic
from grpolab.data.honeypots import NO_ANSWER, arithmetic_twins, read_honeypots
from grpolab.data.jsonl import DataError
from grpolab.rewards.builtin import accuracy_reward


def test_twins_have_an_unknown_and_no_answer_a_number_can_match():
    held = arithmetic.test_set(40)
    twins = arithmetic_twins(held, 32)
    assert len(twins) == 32 and all(t["ground_truth"] == NO_ANSWER for t in twins)
    for twin, original in zip(twins, held):
        assert twin["question"] != original["question"] and any(c.isalpha() for c in twin["question"])
    completions = [r["answer"] for r in held[:32]] + ["#### 0", "#### none", ""]
    records = twins + twins[:3]
    assert accuracy_reward(completions, records) == [0.0] * len(completions)


def test_a_file_is_read_as_it_is(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "ground_truth": "x"}) for i in range(5)))
    assert [r["question"] for r in read_honeypots(path, 3)] == ["q0", "q1", "q2"]


@pytest.mark.parametrize(
    "text, says",
    [(None, "no such file"), ("{not json\n", "not valid JSON"), ('{"answer": 3}\n', "no 'prompt' or 'question'")],
)
def test_a_file_that_cannot_be_read_is_one_clear_error(tmp_path, text, says):
    path = tmp_path / "h.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DataError, match=says) as e:
        read_honeypots(path, 8)
    assert "--honeypots" in str(e.value)
