"""Unit tests of grpolab.rewards: answer extraction, accuracy and format rewards, failure handling."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.data.answers import extract_final_number, numbers_equal
from grpolab.rewards.builtin import accuracy_reward, default_reward_fns, format_reward
from grpolab.rewards.forms import from_trl, load_reward_fn, reward_form
from grpolab.rewards.rewarder import reward_functions, score

# ---------------------------------------------------------------- extract_final_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12+7=19\n19-3=16\n#### 16", "16"),  # number after ####
        ("#### 16\nand then 99", "16"),  # after the *last* ####, not the last number
        ("#### 3\nretry\n#### 42", "42"),  # the last ####
        ("first 3, then 5, finally 11", "11"),  # no ####: the last number
        ("the total is 1,234 apples", "1234"),  # thousands commas removed
        ("#### 1,200", "1200"),
        ("so the answer is 16.", "16"),  # a trailing period is not a decimal point
        ("#### 16.", "16"),
        ("#### 2.5", "2.5"),
        ("the result is -7", "-7"),  # a leading minus is a sign
        ("#### -7", "-7"),
        ("12-5", "5"),  # '-' right after a digit is an operator
        ("(3+4)-2", "2"),  # and after ')'
        ("no digits here", None),
        ("", None),
        ("#### none", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


# ---------------------------------------------------------------- numbers_equal


@pytest.mark.parametrize(
    "a, b, equal",
    [
        ("16", "16.0", True),
        ("16", "16", True),
        ("-7", "-7.00", True),
        ("0.5", ".5", True),
        ("16", "17", False),
        ("1234", "1,234", False),  # callers strip commas first (extract_final_number does)
        (None, "16", False),
        ("16", None, False),
    ],
)
def test_numbers_equal(a, b, equal):
    assert numbers_equal(a, b) is equal


# ---------------------------------------------------------------- accuracy and format


def test_accuracy_reward():
    records = [
        {"ground_truth": "16"},
        {"ground_truth": "16"},
        {"ground_truth": "1200"},
        {"ground_truth": "-7"},
        {"ground_truth": 5},
    ]
    completions = ["#### 16.0", "#### 17", "total 1,200", "12-19=-7\n#### -7", "nothing"]
    assert accuracy_reward(completions, records) == [1.0, 0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "completion, ok",
    [
        ("#### 16", True),
        ("#### 16\n", True),
        ("12+4=16\n#### 16", True),
        ("12+4=16\n#### -16\n\n", True),
        ("#### 1,200", True),
        ("answer 16", False),
        ("#### 16 then more text", False),
        ("#### abc", False),
        ("#### 16\nmore text", False),
        ("", False),
    ],
)
def test_format_reward(completion, ok):
    assert format_reward([completion], [{}]) == [float(ok)]


@pytest.mark.parametrize(
    "completion, ok",
    [
        ("1/4 + 1/4 = 1/2, so the answer is $\\boxed{\\frac{1}{2}}$.", True),
        ("Nested: \\boxed{\\sqrt{x^{2} + \\{1\\}}}", True),
        ("**Answer:** **$\\boxed{7}$**", True),
        ("\\[\\boxed{7}\\]\n", True),
        ("\\(\\boxed{7}\\).", True),
        ("$$\\boxed{7}$$  \n\n", True),
        ("\\boxed{3} at first, then \\boxed{7}", True),  # the last box is the answer
        # the loopholes that paid 1 while "\\boxed{" anywhere was enough:
        ("\\boxed{", False),
        ("\\boxed{ asdf qwer zxcv", False),  # junk after an opening that never closes
        ("The answer is \\boxed{7}, or maybe 8; let me check again.", False),  # a box followed by more text
        ("\\boxed{7} \\boxed{", False),  # the last box is unclosed
        ("\\boxed{}", False),
        ("\\boxed{  }.", False),
        ("\\boxed{7}}", False),  # a stray brace after it
        ("no box at all: 7", False),
    ],
)
def test_format_reward_for_math_records_pays_only_a_final_closed_box(completion, ok):
    assert format_reward([completion], [{"format": "math"}]) == [float(ok)]
    assert format_reward([completion], [{}]) == [0.0]  # the arithmetic branch reads '####' only


# ---------------------------------------------------------------- score


def test_score_is_accuracy_plus_tenth_of_format():
    records = [{"ground_truth": "16"}] * 4
    completions = ["#### 16", "#### 15", "the answer is 16", "no idea"]
    # accuracy [1, 0, 1, 0], format [1, 1, 0, 0] -> total [1.1, 0.1, 1.0, 0.0]
    s = score(completions, records, default_reward_fns(0.1))
    torch.testing.assert_close(s.components["accuracy"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(s.components["format"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(s.total, torch.tensor([1.1, 0.1, 1.0, 0.0]))
    assert s.errors == 0


def test_score_weights_components():
    fns = [("a", lambda c, r: [1.0, 2.0], 0.5), ("b", lambda c, r: [10.0, 20.0], -2.0)]
    s = score(["x", "y"], [{}, {}], fns)
    # 0.5 * [1, 2] - 2 * [10, 20] = [-19.5, -39]
    torch.testing.assert_close(s.total, torch.tensor([-19.5, -39.0]))


def test_a_reward_fn_raising_for_one_completion_costs_only_that_rollout():
    def picky(completions, records):
        if "boom" in completions:
            raise RuntimeError("cannot parse")
        return [1.0 for _ in completions]

    comps = ["#### 1", "boom", "#### 3"]
    s = score(comps, [{}, {}, {}], [("picky", picky, 1.0)])
    assert s.total.tolist() == [1.0, 0.0, 1.0]
    assert s.errors == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_counted_and_replaced_by_zero(bad):
    s = score(["a", "b", "c"], [{}, {}, {}], [("f", lambda c, r: [0.5, bad, 0.25], 1.0)])
    assert s.total.tolist() == [0.5, 0.0, 0.25]
    assert s.components["f"].tolist() == [0.5, 0.0, 0.25]
    assert s.errors == 1
    assert torch.isfinite(s.total).all()


def test_wrong_number_of_values_falls_back_to_per_item_calls():
    calls = []

    def first_only(completions, records):  # returns one value whatever it is given
        calls.append(len(completions))
        return [float(len(completions[0]))]

    s = score(["a", "bb", "ccc"], [{}, {}, {}], [("f", first_only, 1.0)])
    assert s.total.tolist() == [1.0, 2.0, 3.0]
    assert s.errors == 0
    assert calls == [3, 1, 1, 1]


def test_errors_are_counted_per_function_and_rollout():
    def always(c, r):
        raise ValueError("down")

    s = score(["#### 1", "x"], [{"ground_truth": "1"}] * 2, [("bad", always, 1.0), ("format", format_reward, 0.1)])
    assert s.errors == 2  # both rollouts failed the first function
    torch.testing.assert_close(s.total, torch.tensor([0.1, 0.0]))


# ---------------------------------------------------------------- load_reward_fn


def test_load_reward_fn_imports_module_function():
    assert load_reward_fn("grpolab.rewards:accuracy_reward") is accuracy_reward
    fn = load_reward_fn("reward_fixtures:always_raises")  # tests/ is on sys.path (conftest.py)
    with pytest.raises(RuntimeError):
        fn(["x"], [{}])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("grpolab.rewards.rewarder", "module:function"),
        (":accuracy_reward", "module:function"),
        ("grpolab.rewards:", "module:function"),
        ("no_such_module_xyz:fn", "cannot load"),
        ("grpolab.rewards:no_such_fn", "cannot load"),
        ("grpolab.rewards:__all__", "not callable"),
    ],
)
def test_load_reward_fn_errors_clearly(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        load_reward_fn(spec)
    if message != "module:function":
        assert repr(spec) in str(info.value)


# ---------------------------------------------------------------- TRL's convention, several functions


def _ours(completions, records):
    return [1.0] * len(completions)


def _ours_other_names(texts, recs, extra=None):
    return [1.0] * len(texts)


def _trl_full(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def _trl_columns(prompts, completions, ground_truth):
    return [1.0] * len(completions)


def _trl_no_prompts(completions, **kwargs):
    return [1.0] * len(completions)


def _one_arg(completions):
    return [1.0] * len(completions)


def _three_required(a, b, c):
    return [1.0]


@pytest.mark.parametrize(
    "fn, form",
    [
        (_ours, "grpolab"),
        (_ours_other_names, "grpolab"),
        (accuracy_reward, "grpolab"),
        (lambda c, r: c, "grpolab"),
        (_trl_full, "trl"),
        (_trl_columns, "trl"),
        (_trl_no_prompts, "trl"),
    ],
)
def test_reward_form_is_read_from_the_signature(fn, form):
    assert reward_form(fn) == form


@pytest.mark.parametrize("fn", [_one_arg, _three_required])
def test_a_signature_fitting_neither_form_names_both(fn):
    with pytest.raises(ValueError, match=r"fn\(completions, records\).*fn\(prompts, completions, \*\*kwargs\)"):
        reward_form(fn)


def test_load_reward_fn_refuses_a_signature_fitting_neither_form(tmp_path):
    f = tmp_path / "bad_reward.py"
    f.write_text("def r(completions):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ValueError, match=r"--reward-fn .*bad_reward.py:r: its signature \(completions\) fits neither"):
        load_reward_fn(f"{f}:r")


def test_from_trl_passes_prompts_completions_and_record_fields_by_keyword():
    seen = {}

    def fn(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [len(c) for c in completions[:-1]] + [None]  # None: "does not apply" in TRL

    records = [{"question": "1+1", "ground_truth": "2"}, {"question": "2+3", "ground_truth": "5", "category": "add"}]
    values = from_trl(fn, prompt_of=lambda r: r["question"] + "\n", chat=False)(["two", "five!"], records)
    assert values == [3, None]  # kept: score() counts it 0 in the total and leaves it out of the function's mean
    assert seen == {
        "prompts": ["1+1\n", "2+3\n"],
        "completions": ["two", "five!"],
        "question": ["1+1", "2+3"],
        "ground_truth": ["2", "5"],
        "category": [None, "add"],
    }
    # chat runs: the prompt's messages, and the completion as one assistant message (TRL's conversational form)
    from_trl(fn, prompt_of=lambda r: [{"role": "user", "content": r["question"]}], chat=True)(["two"], records[:1])
    assert seen["prompts"] == [[{"role": "user", "content": "1+1"}]]
    assert seen["completions"] == [[{"role": "assistant", "content": "two"}]]


def test_several_functions_weighted_named_and_summed():
    fns = reward_functions(["grpolab.rewards:accuracy_reward", "grpolab.rewards:format_reward"], [2.0, 0.5], 0.1)
    assert [(name, w) for name, _, w in fns] == [("accuracy_reward", 2.0), ("format_reward", 0.5), ("format", 0.1)]
    completions, records = ["#### 4", "4 apples", "#### 5"], [{"ground_truth": "4"}] * 3
    s = score(completions, records, fns)
    acc, fmt = [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]
    expected = [2 * a + 0.5 * f + 0.1 * f for a, f in zip(acc, fmt)]
    torch.testing.assert_close(s.total, torch.tensor(expected))
    assert reward_functions([], [], 0.3) == default_reward_fns(0.3)


def test_reward_function_names_never_overwrite_builtin_metrics(tmp_path):
    f = tmp_path / "names.py"
    f.write_text(
        "def mean(completions, records):\n    return [0.0] * len(completions)\n"
        "def accuracy(completions, records):\n    return [0.0] * len(completions)\n"
    )
    names = [n for n, _, _ in reward_functions([f"{f}:accuracy", f"{f}:mean", f"{f}:accuracy"], [], 0.0)]
    assert names == ["accuracy", "mean_2", "accuracy_2", "format"]


def test_reward_weights_must_match_the_functions():
    with pytest.raises(ValueError, match="--reward-weights: 1 weight"):
        reward_functions(["grpolab.rewards:accuracy_reward", "grpolab.rewards:format_reward"], [1.0], 0.1)


def test_async_reward_functions_run_concurrently_within_a_step_and_fail_per_rollout():
    """Two async functions (TRL's form and grpolab's) each wait for the other to have started: only concurrent
    awaiting scores them. A third raises on one rollout: that rollout alone scores 0, counted."""
    import asyncio

    started: dict[str, asyncio.Event] = {}

    async def meet(me: str, other: str) -> None:
        started.setdefault(me, asyncio.Event()).set()
        await asyncio.wait_for(started.setdefault(other, asyncio.Event()).wait(), timeout=5)

    async def judge_a(prompts, completions, **kwargs):  # TRL's form; None means "does not apply": 0
        await meet("a", "b")
        return [float(len(c)) if c != "skip" else None for c in completions]

    async def judge_b(completions, records):
        await meet("b", "a")
        return [10.0 * r["k"] for r in records]

    async def flaky(completions, records):
        if "boom" in completions:
            raise RuntimeError("a judge that fails on one rollout")
        return [1.0] * len(completions)

    completions, records = ["ab", "skip", "boom"], [{"prompt": "p", "k": k} for k in (1, 2, 3)]
    fns = [("a", from_trl(judge_a, lambda r: r["prompt"], chat=False), 1.0), ("b", judge_b, 0.5), ("f", flaky, 1.0)]
    got = score(completions, records, fns)
    assert got.components["a"].tolist() == [2.0, 0.0, 4.0]
    assert got.components["b"].tolist() == [10.0, 20.0, 30.0]
    assert got.components["f"].tolist() == [1.0, 1.0, 0.0] and got.errors == 1
    assert got.total.tolist() == [8.0, 11.0, 19.0]
