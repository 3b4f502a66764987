"""Reward functions used by the tests, importable as ``reward_fixtures:NAME``
(conftest.py puts tests/ on sys.path)."""

from __future__ import annotations


def always_raises(completions, records):
    """A broken reward function: raises on every call."""
    raise RuntimeError("reward server unavailable")


def constant_tenth(completions, records):
    """The same reward, 0.1, for every completion: no rollout is better than another."""
    return [0.1 for _ in completions]


def overflow_when_correct_muldiv(completions, records):
    """3e38 for a correct answer to a multiplication or division question, else 0: finite rewards
    whose per-token loss terms overflow float32 when summed over a completion, so the loss is
    non-finite on a rank that holds such a rollout and finite on one that does not."""
    from grpolab.rewards.builtin import accuracy_reward

    return [
        3e38 * ok * any(op in r["question"] for op in "*/")
        for ok, r in zip(accuracy_reward(completions, records), records)
    ]


def odd_code_sum(completions, records):
    """1 when the sum of the completion's character codes is odd, else 0: meaningless, but nearly every group has
    reward variance, so nearly every rollout has a nonzero advantage (a dense update, for tests that compare updates)."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def code_sum_mod4(completions, records):
    """1 when the sum of the completion's character codes is divisible by 4, else 0: a pass rate near 1/4, so with
    G = 4 about a third of the groups have no reward variance (all 0) and the rest have some (for --sampling tests)."""
    return [float(sum(map(ord, c)) % 4 == 0) for c in completions]


def digits_of_target(prompts, completions, target, bonus, **kwargs):
    """TRL form, two declared columns: the share of ``target``'s characters that the completion contains, plus
    ``bonus`` (a per-row column), so the reward depends on both columns of the row."""
    return [sum(ch in c for ch in t) / len(t) + b for c, t, b in zip(completions, target, bonus)]


def length_times_weight(completions, records):
    """grpolab form: the completion's length in characters times the row's ``weight`` column, over 100."""
    return [len(c) * r["weight"] / 100 for c, r in zip(completions, records)]


def needs_missing_column(prompts, completions, no_such_column, **kwargs):
    """TRL form, declaring a column that the test data does not have."""
    return [0.0 for _ in completions]


def always_one(completions, records):
    """1 for every completion: a reward that cannot tell a right answer from a wrong one."""
    return [1.0 for _ in completions]


def pays_for_length(completions, records):
    """The completion's length in characters over 50: a reward that pays for length, not for the answer."""
    return [len(c) / 50 for c in completions]


def mostly_one(completions, records):
    """1 unless the sum of the completion's character codes is divisible by 20 (about 5% of completions): a reward
    near its ceiling from the start, with a contrast in a third of groups of 8."""
    return [float(sum(map(ord, c)) % 20 != 0) for c in completions]


def strict_answer_tag(completions, records):
    """A parser that rejects every answer not written as '<answer>N</answer>' by raising (the built-in model writes
    '#### N'): the reward function fails on every completion."""
    out = []
    for c in completions:
        if "<answer>" not in c:
            raise ValueError(f"no <answer> tag in {c[-40:]!r}")
        out.append(float(c.split("<answer>")[1].split("</answer>")[0].strip() == "1"))
    return out


def names_the_colour(prompts, completions, answer, image, **kwargs):
    """1 when the completion holds the first letter of the colour the row's picture shows (``answer``), else 0.
    ``image`` is the row's image column as the data gave it (TRL passes every column): asserted to be there."""
    assert len(image) == len(completions), "the image column reaches the reward function, one per completion"
    return [float(a[0] in c) for c, a in zip(completions, answer)]


def contains_answer(completions, answer, **kwargs):
    """TRL's form: 1 when the completion holds the answer."""
    return [float(a in c) for c, a in zip(completions, answer)]


def parity(completions, records):
    """The completion's length modulo 2."""
    return [float(len(c) % 2) for c in completions]


PARITY_TRL_CALLS: list[tuple[list, list]] = []
"""What :func:`parity_trl` was called with, call by call (a test clears it first)."""


def parity_trl(prompts, completions, **kwargs):
    """TRL's form: the parity of the completion's code points; keeps what it was called with (the prompts as the
    reward model reads them too) in :data:`PARITY_TRL_CALLS`."""
    PARITY_TRL_CALLS.append((list(prompts), list(completions)))
    return [float(sum(map(ord, c)) % 2) for c in completions]
