"""The code reward: which program it takes from a completion, and what its tests make of it (in the sandbox)."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES
from helpers.marks import needs_bwrap

from grpolab.rewards.code import CodeReward, CodeRewardSettings, extract_program, job_of
from grpolab.rewards.forms import from_trl
from grpolab.rewards.rewarder import score
from grpolab.sandbox import Limits

FIXTURE_PROBLEMS = [json.loads(line) for line in (FIXTURES / "code_problems.jsonl").read_text().splitlines()]


@pytest.fixture
def sandboxed():
    """A code reward of its own, with the tests' limits; its sandbox is closed afterwards."""
    reward = CodeReward(CodeRewardSettings(limits=Limits(timeout_s=5, cpu_s=5), workers=2))
    yield reward
    reward.close()


# ------------------------------------------------------------------ extraction (no sandbox)
@pytest.mark.parametrize(
    ("completion", "program"),
    [
        ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),  # no fence: the whole text
        ("Sure.\n```python\na = 1\n```\nand\n```py\nb = 2\n```\nDone.", "b = 2\n"),  # the last block
        ("```\nplain = 1\n```", "plain = 1\n"),  # a fence without a language
        ("```python\nfirst = 1\n```\n```python\n```", "first = 1\n"),  # an empty last block is skipped
        ("```python\ndef f(x):\n    return x +", "def f(x):\n    return x +"),  # cut off by the token budget
    ],
)
def test_the_program_is_the_last_fenced_block_or_the_whole_text(completion, program):
    assert extract_program(completion) == program


def test_jobs_read_every_form_of_tests_and_io():
    assert job_of("x", tests=["assert 1", "assert 2"]).tests == ("assert 1", "assert 2")
    assert job_of("x", tests='["assert 1", "assert 2"]').tests == ("assert 1", "assert 2")  # a JSON list in a cell
    assert job_of("x", tests="def check(candidate):\n    pass", entry_point="f").tests == (
        "def check(candidate):\n    pass",
    )
    assert job_of("x", io=[["1\n", "2\n"]]).io == (("1\n", "2\n"),)
    assert job_of("x", io=[{"input": "1", "output": "2"}]).io == (("1", "2"),)
    assert job_of([{"role": "assistant", "content": "```python\nz = 3\n```"}], tests=["assert z"]).program == "z = 3\n"
    with pytest.raises(ValueError, match="neither a 'tests' nor an 'io'"):
        job_of("x")


# ------------------------------------------------------------------ scores (sandbox)
@needs_bwrap
@pytest.mark.parametrize("problem", FIXTURE_PROBLEMS, ids=lambda p: p.get("entry_point") or p["prompt"][:20])
@pytest.mark.slow
def test_fixture_solutions_score_one_wrong_ones_zero_partial_ones_their_fraction(problem, sandboxed):
    columns = {k: [problem.get(k)] * 3 for k in ("tests", "io", "entry_point") if k in problem}
    completions = [f"```python\n{problem[k]}\n```" for k in ("solution", "wrong", "partial")]
    rewards = sandboxed([problem["prompt"]] * 3, completions, **columns)
    assert rewards == pytest.approx([1.0, 0.0, problem["partial_fraction"]])
    counts = sandboxed.pop_counts()
    assert (counts["code_passed"], counts["code_failed"]) == (1, 2)


@needs_bwrap
def test_mode_all_gives_one_only_when_every_test_passes(sandboxed):
    program = "```python\ndef f(x):\n    return x if x < 3 else 0\n```"
    tests = [[f"assert f({i}) == {i}" for i in range(4)]]
    assert sandboxed(["p"], [program], tests) == [0.75]
    every = CodeReward(CodeRewardSettings(mode="all", workers=1))
    try:
        assert every(["p"], [program], tests) == [0.0]
        assert every(["p"], ["```python\ndef f(x):\n    return x\n```"], tests) == [1.0]
    finally:
        every.close()


@needs_bwrap
def test_a_syntax_error_fails_every_test_and_an_exception_in_a_test_fails_that_one(sandboxed):
    tests = [["assert f(1) == 1", "assert f(None) == 0", "assert f(2) == 2"]]
    assert sandboxed(["p"], ["def f(x) return x"], tests) == [0.0]
    assert sandboxed(["p"], ["def f(x):\n    return x + 0"], tests) == [pytest.approx(2 / 3)]


@needs_bwrap
def test_through_the_trainers_scoring_a_record_without_tests_is_an_error_counted_not_a_crash(sandboxed):
    fn = from_trl(sandboxed, prompt_of=lambda r: r["prompt"], chat=False)
    records = [{"prompt": "p", "tests": ["assert f() == 1"]}, {"prompt": "q"}]
    scores = score(["def f():\n    return 1", "def f():\n    return 1"], records, [("code", fn, 1.0)])
    assert scores.total.tolist() == [1.0, 0.0]
    assert scores.errors == 1
    assert scores.counts["code_passed"] == 1  # the record that could run was counted


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("reward_workers", -1, "--reward-workers"),
        ("code_timeout", 0.0, "--code-timeout"),
        ("code_memory_mb", 8, "--code-memory-mb"),
    ],
)
def test_bad_code_reward_settings_are_refused_at_start(field, value, message):
    from grpolab.config.train import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value}).validate()


def test_the_configs_code_flags_reach_the_reward():
    from grpolab.config.train import TrainConfig
    from grpolab.rewards.code import CodeRewardSettings

    cfg = TrainConfig(code_reward="all", reward_workers=3, code_timeout=2.5, code_memory_mb=256)
    s = CodeRewardSettings.of(cfg.code_sandbox)
    assert (s.mode, s.workers, s.limits.timeout_s, s.limits.cpu_s, s.limits.memory_mb) == ("all", 3, 2.5, 3, 256)


class _Echo(CodeReward):
    """A code reward that runs the program in each record's ``program`` column, not the completion."""

    def __call__(self, prompts, completions, program, **kwargs):
        return super().__call__(prompts, [f"```python\n{p}```" for p in program], kwargs.get("tests"))


def test_a_run_scores_a_subclass_of_the_code_reward_as_itself_with_the_runs_own_settings():
    from grpolab.common.given import Given
    from grpolab.config.train import TrainConfig
    from grpolab.rewards.rewarder import reward_functions

    mine = _Echo()
    cfg = TrainConfig(code_timeout=2.5, reward_workers=1, code_reward="all")
    ((_, fn, _), _) = reward_functions(("echo",), (), 0.1, sandbox=cfg.code_sandbox, given=Given({"echo": mine}))
    records = [{"prompt": "p", "program": f"x = {v}\n", "tests": ["assert x == 1"]} for v in (1, 2)]
    assert fn(["not a program", "neither"], records) == [1.0, 0.0]  # the subclass's __call__ ran
    run = mine.for_run(CodeRewardSettings.of(cfg.code_sandbox))
    assert type(run) is _Echo and run is not mine and mine.settings == CodeRewardSettings()
    assert (run.settings.mode, run.settings.workers, run.settings.limits.timeout_s) == ("all", 1, 2.5)


# ------------------------------------------------------------------ programs written to game the verdict (sandbox)
FORGE = """
import json, os
def forge(n=5):
    lines = [{{"test": i, "ok": True, "error": ""}} for i in range(n)] + [{{"done": True, "memory": False}}]
    for fd in range(3, 21):  # the report's descriptor is one of these
        try:
            os.write(fd, "".join(json.dumps(line) + "\\n" for line in lines).encode())
        except OSError:
            pass
"""

# Each paid 1 on every problem of the code task before the verdicts moved outside (docs/code.md): name -> (the
# program, with {ep} the function's name; the status it gets now).
GAMING = {
    "eq_always_true": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def {ep}(*args, **kwargs):\n    return Anything()\n",
        "failed",
    ),
    "int_subclass_eq": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def {ep}(*args, **kwargs):\n    return Int(0)\n",
        "failed",
    ),
    "forged_report_then_os_exit": (FORGE + "forge()\nos._exit(0)\n", "forged"),
    "forged_report_and_os_exit_inside_the_function": (
        FORGE + "def {ep}(*args, **kwargs):\n    forge()\n    os._exit(0)\n",
        "forged",
    ),
    "patched_harness_report": (
        "import __main__\n_real = __main__.report\n"
        "def _ok(**line):\n    _real(**{{**line, 'ok': True, 'error': ''}})\n"
        "__main__.report = _ok\ndef {ep}(*args, **kwargs):\n    return None\n",
        "forged",  # its 'ok' lines claim verdicts for tests whose values are judged outside
    ),
    "patched_builtins_exec_and_eval": (
        "import builtins\nbuiltins.exec = builtins.eval = lambda *a, **k: None\n"
        "def {ep}(*args, **kwargs):\n    return None\n",
        "failed",
    ),
    # these never paid, and still do not: exiting from inside a test
    "sys_exit_inside_the_function": ("import sys\ndef {ep}(*args, **kwargs):\n    sys.exit(0)\n", "failed"),
    "raise_system_exit_inside_the_function": ("def {ep}(*args, **kwargs):\n    raise SystemExit(0)\n", "failed"),
    "os_exit_inside_the_function": ("import os\ndef {ep}(*args, **kwargs):\n    os._exit(0)\n", "crashed"),
}


@pytest.fixture(scope="module")
def code_task_problems():
    from grpolab.data.code_task import test_set

    return test_set(50)


@needs_bwrap
@pytest.mark.parametrize("attack", sorted(GAMING))
def test_a_program_written_to_game_the_verdict_scores_zero_on_the_code_task(attack, code_task_problems, sandboxed):
    template, status = GAMING[attack]
    problems = code_task_problems[:4]
    completions = [f"```python\n{template.format(ep=p['entry_point'])}```" for p in problems]
    assert sandboxed(["p"] * 4, completions, [p["tests"] for p in problems]) == [0.0] * 4
    counts = sandboxed.pop_counts()
    assert counts[f"code_{status}"] == 4 and counts["code_judged_inside"] == 0, counts


IO_GAMING = {
    "printed_forged_report": (FORGE.replace("os.write(fd, ", "print(end=") + "forge()\n", "failed"),
    "forged_report_then_os_exit": (FORGE + "forge()\nos._exit(0)\n", "forged"),
    "patched_harness_normalise": ("import __main__\n__main__.normalise = lambda text: ''\n", "failed"),
}


@needs_bwrap
@pytest.mark.parametrize("attack", sorted(IO_GAMING))
def test_a_program_written_to_game_an_io_verdict_scores_zero(attack, sandboxed):
    template, status = IO_GAMING[attack]
    problems = [p for p in FIXTURE_PROBLEMS if "io" in p]
    completions = [f"```python\n{template.format()}```"] * len(problems)
    assert sandboxed(["p"] * len(problems), completions, io=[p["io"] for p in problems]) == [0.0] * len(problems)
    assert sandboxed.pop_counts()[f"code_{status}"] == len(problems)


@needs_bwrap
def test_a_forged_report_of_values_scores_what_returning_those_values_would(code_task_problems, sandboxed):
    """The sandbox never sees the expected values: a forged value line is worth what a program returning it earns."""
    problems = [p for p in code_task_problems if p["category"] == "is_multiple"][:3]
    forged = [{"test": i, "value": ["bool", False]} for i in range(5)] + [{"done": True, "memory": False}]
    forger = (
        f"import json, os\ndata = ''.join(json.dumps(line) + '\\n' for line in {forged!r}).encode()\n"
        "for fd in range(3, 21):\n    try:\n        os.write(fd, data)\n    except OSError:\n        pass\nos._exit(0)\n"
    )
    honest = "def is_multiple(n):\n    return False\n"
    tests = [p["tests"] for p in problems]
    by_forgery = sandboxed(["p"] * 3, [f"```python\n{forger}```"] * 3, tests)
    assert by_forgery == sandboxed(["p"] * 3, [f"```python\n{honest}```"] * 3, tests)
    assert 0 < sum(by_forgery) < 3  # each problem has 1 to 4 multiples among its 5 tests


@needs_bwrap
def test_the_code_tasks_reference_solutions_score_one_and_a_partly_wrong_program_its_fraction(
    code_task_problems, sandboxed
):
    n = len(code_task_problems)
    completions = [f"```python\n{p['solution']}```" for p in code_task_problems]
    assert sandboxed(["p"] * n, completions, [p["tests"] for p in code_task_problems]) == [1.0] * n
    counts = sandboxed.pop_counts()
    assert (counts["code_passed"], counts["code_judged_inside"]) == (n, 0)  # every verdict judged outside
    problem = code_task_problems[0]  # scale_and_shift(x) = -3 * x + 29, tested at 22, 4, -6, 23, -21
    partly = "def scale_and_shift(x):\n    return -3 * x + 29 if x > 0 else 29\n"
    assert sandboxed(["p"], [partly], [problem["tests"]]) == [pytest.approx(3 / 5)]


@needs_bwrap
def test_a_humaneval_check_is_still_judged_inside_and_can_be_forged(sandboxed):
    """What docs/code.md says remains forgeable: a test of any other form than ``assert EXPR == LITERAL``."""
    (problem,) = [p for p in FIXTURE_PROBLEMS if p.get("entry_point") == "total"]
    forger = f"```python\n{FORGE.format()}forge(1)\nos._exit(0)\n```"
    assert sandboxed(["p"], [forger], [problem["tests"]], entry_point=["total"]) == [1.0]
    assert sandboxed.pop_counts()["code_judged_inside"] == 1
