"""LLM judges (--judge, --judge-model): the pure parts (the judge's file, the answer's parser, the rubric's mean, the
request's key, the cache's file) on hand values; a local judge on the built-in model, whose answers are not yes or no
(counted failures scoring --judge-failure-score, never a crash) and whose repeated requests the cache answers without
a call; the rewarder's per-rollout details and the doctor's reading of them. Fast tier: no SmolLM2, no server
(tests/e2e/test_judge_servers.py starts those)."""

from __future__ import annotations

import pytest

from grpolab.common.errors import ConfigError
from grpolab.config.rollout import RewardSection
from grpolab.doctor.conditions import diagnose
from grpolab.doctor.rows import RunFacts
from grpolab.rewards.judge import (
    FAILED_FRAC,
    JudgeCache,
    JudgeSettings,
    JudgeSpec,
    load_judge,
    parse_answer,
    question_text,
    read_judge,
    request_key,
    rubric_reward,
)
from grpolab.rewards.rewarder import Rewarder, reward_functions, score
from grpolab.rollout.placement import greedy_texts

RUBRIC = """
template = '''Question: {{ prompt }}
Reply: {{ completion }}
The right answer is {{ ground_truth }}. {{ criterion }} Answer yes or no.'''
system = "You grade replies."
max_tokens = 4

[[criteria]]
name = "correct"
text = "Is the reply's answer right?"
weight = 3

[[criteria]]
name = "short"
text = "Is the reply short?"
"""
RECORDS = [{"prompt": "2+3=", "ground_truth": "5"}, {"prompt": "7*6=", "ground_truth": "42"}] * 2
COMPLETIONS = ["#### 5", "#### 40", "5", "it is 42"]


def _file(tmp_path, text: str, name: str = "grader.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the pure parts


def test_the_judge_file_reads_a_rubric_and_a_plain_template(tmp_path):
    spec = read_judge(_file(tmp_path, RUBRIC))
    assert spec.name == "grader" and spec.system == "You grade replies." and spec.max_tokens == 4
    assert [(c.name, c.weight) for c in spec.criteria] == [("correct", 3.0), ("short", 1.0)]
    plain = read_judge(_file(tmp_path, "Is {{ completion }} right for {{ prompt }}? yes or no", "plain.txt"))
    assert (plain.name, plain.answer, plain.criteria) == ("plain", "yes-no", ())


@pytest.mark.parametrize(
    "text, says",
    [
        ("template = 'x' \nscore = 1", "unknown key"),
        ("system = 'x'", "needs template"),
        ("template = '{{ criterion }}'", "no \\[\\[criteria\\]\\]"),
        ("template = '{{ completion }}'\n[[criteria]]\ntext = 'a'", "must use \\{\\{ criterion \\}\\}"),
        ("template = '{{ completion '", "does not parse"),
        ("template = 'x'\nanswer = 'grade'", "answer must be one of"),
        ("template = 'x'\nanswer = 'number'\nrange = [5, 1]", "high > low"),
        ("template = [", "not valid TOML"),
        ("template = 'x'\nrange = [1, 2, 3]", "range must be \\[low, high\\], got"),
        ("template = 'x'\nrange = ['a', 'b']", "range must be a number, got 'a'"),
        ("template = 'x'\nmax_tokens = 'eight'", "max_tokens must be an integer, got 'eight'"),
        ("template = 'x'\nmax_tokens = 4.5", "max_tokens must be an integer"),
        (
            "template = '{{ criterion }}'\n[[criteria]]\ntext = 'a'\nweight = 'heavy'",
            "criteria.0..weight must be a number",
        ),
    ],
)
def test_a_malformed_judge_file_is_one_line(tmp_path, text, says):
    with pytest.raises(ConfigError, match=says) as e:
        read_judge(_file(tmp_path, text))
    assert "\n" not in str(e.value)


def test_answers_parse_to_scores_or_to_a_failure():
    yes_no = JudgeSpec(template="")
    assert [parse_answer(a, yes_no) for a in ("Yes.", "no, it is not", "The answer: YES", "yesterday", "")] == [
        1.0,
        0.0,
        1.0,
        None,
        None,
    ]
    number = JudgeSpec(template="", answer="number", low=0, high=10)
    got = [parse_answer(a, number) for a in ("7", "Score: 2.5/10", "11", "none", "-1")]
    assert got == [0.7, 0.25, None, None, None]


def test_a_rubric_is_the_weighted_mean_of_its_criteria():
    assert rubric_reward([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [3.0, 1.0]) == [0.75, 0.25, 1.0]


def test_the_request_key_is_the_content():
    m = [{"role": "user", "content": "a"}]
    assert request_key("m", m, 4) == request_key("m", [dict(m[0])], 4)
    assert len({request_key("m", m, 4), request_key("n", m, 4), request_key("m", m, 5)}) == 3
    assert request_key("m", m, 4) != request_key("m", [{"role": "user", "content": "b"}], 4)
    assert question_text([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]) == "q"


def test_the_cache_file_is_read_back_and_a_torn_line_is_counted(tmp_path):
    path = tmp_path / "cache.jsonl"
    JudgeCache(path).put({"k1": "yes", "k2": "no"})
    with path.open("a") as f:
        f.write('{"key": "k3", "ans')  # a run killed while writing
    again = JudgeCache(path)
    assert (again.get("k1"), again.get("k2"), again.get("k3"), again.torn) == ("yes", "no", None, 1)


# ---------------------------------------------------------------- a real local judge: the built-in model


@pytest.fixture(scope="module")
def builtin_judge_file(tmp_path_factory):
    return str(_file(tmp_path_factory.mktemp("judge"), RUBRIC))


def _builtin_judge(path, **over):
    settings = JudgeSettings(model="builtin", **over)
    return load_judge(path, settings, prompt_of=lambda r: r["prompt"], greedy=greedy_texts)


def test_malformed_answers_are_counted_failures_scored_as_told(builtin_judge_file):
    """The built-in arithmetic model answers a grading question with arithmetic, never yes or no: every request is
    a counted failure scoring --judge-failure-score, and the rollouts' failed share is 1."""
    judge = _builtin_judge(builtin_judge_file, failure_score=0.25)
    got = judge(COMPLETIONS, RECORDS)
    answers = [judge.cache.get(k) for k, _ in judge._requests(COMPLETIONS, RECORDS)]
    assert all(a is not None and parse_answer(a, judge.spec) is None for a in answers), answers
    assert list(got) == [0.25] * 4
    assert got.details[FAILED_FRAC] == [1.0] * 4 and got.details["grader/correct"] == [0.25] * 4
    assert judge.pop_counts() == {
        "judge_requests": 8.0,
        "judge_cache_hits": 0.0,
        "judge_failed": 8.0,
        "judge_unanswered": 0.0,
    }


def test_the_cache_answers_a_repeated_request_without_a_call(builtin_judge_file, tmp_path):
    judge = _builtin_judge(builtin_judge_file, cache=str(tmp_path / "answers.jsonl"))
    calls = []
    generate = judge.backend.generate
    judge.backend.generate = lambda *a, **k: calls.append(len(a[0])) or generate(*a, **k)
    first = judge(COMPLETIONS, RECORDS)
    # COMPLETIONS x RECORDS hold no repeated pair: 8 requests, 8 rows sent to the engine
    assert calls == [8] and judge.pop_counts()["judge_cache_hits"] == 0
    again = judge(COMPLETIONS[:2], RECORDS[:2])
    assert calls == [8] and list(again) == list(first)[:2]
    assert judge.pop_counts() == {
        "judge_requests": 4.0,
        "judge_cache_hits": 4.0,
        "judge_failed": 4.0,
        "judge_unanswered": 0.0,
    }
    # a later run reads the file: no call either
    later = _builtin_judge(builtin_judge_file, cache=str(tmp_path / "answers.jsonl"))
    later.backend.generate = None  # any call would raise
    assert list(later(COMPLETIONS, RECORDS)) == list(first)


def test_the_rewarder_logs_the_judges_details_beside_its_reward(builtin_judge_file):
    def exact(completions, records):
        return [float(c.split()[-1] == r["ground_truth"]) for c, r in zip(completions, records)]

    fns = reward_functions(
        ("exact",), (1.0, 2.0), 0.0, judge=builtin_judge_file, judge_settings=JudgeSettings(model="builtin"),
        given=_given(exact), prompt_of=lambda r: r["prompt"], greedy=greedy_texts,
    )  # fmt: skip
    rewarder = Rewarder(fns)
    assert [n for n, _, _ in fns] == ["exact", "grader", "format"]
    assert rewarder.details == ["grader/correct", "grader/short", FAILED_FRAC]
    s = score(COMPLETIONS, RECORDS, fns)
    assert s.components["exact"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert s.components[FAILED_FRAC].tolist() == [1.0] * 4  # the details: not weighted into the total
    assert s.total.tolist() == [1.0, 0.0, 1.0, 1.0] and s.counts["judge_failed"] == 8


def _given(fn):
    from grpolab.common.given import Given

    return Given({"exact": fn})


def test_judge_options_are_checked():
    with pytest.raises(ConfigError, match="--judge: needs --judge-model"):
        RewardSection(judge="j.toml").validate()
    with pytest.raises(ConfigError, match="--judge-model: answers a --judge"):
        RewardSection(judge_model="http://localhost:1/v1").validate()
    with pytest.raises(ConfigError, match="--judge-concurrency: must be >= 1"):
        RewardSection(judge="j.toml", judge_model="m", judge_concurrency=0).validate()


def test_a_judge_column_the_data_lacks_is_named(builtin_judge_file):
    from grpolab.rewards.forms import check_columns

    fns = reward_functions(
        (), (), 0.0, judge=builtin_judge_file, judge_settings=JudgeSettings(model="builtin"), greedy=greedy_texts
    )
    with pytest.raises(ConfigError, match="--judge grader declares the column.s. 'ground_truth'"):
        check_columns(fns, [{"prompt": "q"}], "--data d.jsonl")


# ---------------------------------------------------------------- the doctor


def _rows(failed: float, steps: int = 8) -> list[dict]:
    return [
        {
            "step": s,
            "reward/mean": 0.5,
            "reward/std": 0.3,
            "reward/accuracy": 0.5,
            "sampling/rollouts": 64,
            "reward/judge_failed_frac": failed,
            "reward/errors": 0,
        }  # fmt: skip
        for s in range(1, steps + 1)
    ]


def test_the_doctor_reads_the_judges_failures():
    facts = RunFacts(model_reward="judge")
    assert not [f for f in diagnose(_rows(0.01), facts) if f.name == "judge_failures"]
    (found,) = [f for f in diagnose(_rows(0.2), facts) if f.name == "judge_failures"]
    assert found.severity == "warning" and "20%" in found.title and "reward/judge_failed_frac 0.200" in found.evidence
    (severe,) = [f for f in diagnose(_rows(0.8), facts) if f.name == "judge_failures"]
    assert severe.severity == "error"


def test_the_doctor_names_a_model_rewards_hacking_sign():
    rows = [{"step": s, "reward/mean": 0.1 * s, "reward/std": 0.2, "sampling/rollouts": 64} for s in range(1, 11)]
    rows[0] = {**rows[0], "eval/accuracy_sampled": 0.4, "eval/accuracy_sampled_hi": 0.5}
    rows[-1] = {**rows[-1], "eval/accuracy_sampled": 0.38, "eval/accuracy_sampled_hi": 0.48}
    for kind in ("reward model", "judge"):
        (f,) = [f for f in diagnose(rows, RunFacts(model_reward=kind)) if f.name == "reward_hacking"]
        assert f.title == f"Reward hacking signs: the {kind}'s score rises while the held-out verifier is flat"
    (plain,) = [f for f in diagnose(rows, RunFacts()) if f.name == "reward_hacking"]
    assert plain.title == "Reward hacking signs: the reward rises for something other than the task"


def test_run_facts_name_the_judges_metric():
    facts = RunFacts.of({"reward_fn": ["mod:exact"], "judge": "dir/grader.toml", "reward_weights": [1, 2]})
    assert (facts.components, facts.model_reward, facts.reward_functions) == (("grader",), "judge", 2)
