"""Code rewards [RLVR essay, Sec. 1]: a program passes its test cases or fails.

:func:`code_reward` takes the program out of each completion (the last fenced code block, or the whole text),
runs it with its record's tests in the sandbox (:mod:`grpolab.sandbox`: never in this process) and gives the
fraction of tests passed, or 1/0 under ``mode="all"``. Records carry either

- ``tests``: Python statements run after the program, each an ``assert`` (a list; a string holding a JSON list;
  or one string, one test: a HumanEval ``def check(candidate): ...`` is called with ``entry_point``), or
- ``io``: ``[stdin, expected stdout]`` pairs (or ``{"input", "output"}`` objects); the program runs as a script
  once per pair and its printed output, trailing white space aside, must equal the expected one.

It is a TRL-form reward function (``code_reward(prompts, completions, tests, **kwargs)``), so it also serves
TRL's GRPOTrainer. Each call's outcomes are counted (``pop_counts``: the trainer logs them as ``reward/code_*``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Literal

from grpolab.config.rollout import SandboxSection
from grpolab.sandbox import Job, Limits, Outcome, Sandbox
from grpolab.sandbox.runner import STATUSES

# A fence, its info string, then the body up to the closing fence or the end of the text (a cut-off completion).
_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_program(completion: str) -> str:
    """The last non-empty fenced code block of ``completion`` (closed or not), or the whole text if it has none."""
    blocks = [b for b in _FENCE.findall(completion) if b.strip()]
    return blocks[-1] if blocks else completion


@dataclasses.dataclass(frozen=True)
class CodeRewardSettings:
    """How :func:`code_reward` scores and where its programs run."""

    mode: Literal["fraction", "all"] = "fraction"
    """fraction: the share of a program's tests it passes; all: 1 if it passes every one, else 0."""
    limits: Limits = Limits()
    workers: int = 0
    """Programs run at once (0 = one per CPU core)."""
    isolation: str = "auto"
    command: str = ""
    allow_network: bool = False

    @classmethod
    def of(cls, sandbox: SandboxSection) -> CodeRewardSettings:
        """The settings the ``--code-*`` and ``--sandbox*`` options give."""
        limits = Limits(
            timeout_s=sandbox.code_timeout, cpu_s=math.ceil(sandbox.code_timeout), memory_mb=sandbox.code_memory_mb
        )
        return cls(
            sandbox.code_reward,
            limits,
            sandbox.reward_workers,
            sandbox.sandbox,
            sandbox.sandbox_command,
            sandbox.code_allow_network,
        )


class _State:
    settings = CodeRewardSettings()
    sandbox: Sandbox | None = None
    counts: dict[str, float] = {}


def configure(settings: CodeRewardSettings) -> Sandbox:
    """Use ``settings`` from now on; starts (and returns) the sandbox, so that a machine where programs cannot be
    isolated says so at once (SandboxError) rather than at the first reward."""
    if _State.sandbox is not None:
        _State.sandbox.close()
    _State.settings, _State.sandbox = settings, None
    return sandbox()


def sandbox() -> Sandbox:
    """The sandbox the code reward runs in (made on first use from the current settings)."""
    if _State.sandbox is None:
        s = _State.settings
        _State.sandbox = Sandbox(s.limits, s.workers, s.isolation, s.command, s.allow_network)
    return _State.sandbox


def runs_programs(fn) -> bool:
    """Whether the reward function ``fn`` (as given, or adapted by ``grpolab.rewards.rewarder.from_trl``) is this one."""
    return getattr(fn, "pop_counts", None) is pop_counts


def configure_for(fns, sandbox: SandboxSection, log=print) -> None:
    """When any of the reward functions ``fns`` (None entries ignored) runs programs: configure the sandbox from
    the ``sandbox`` options (refuses here, in one line, if unsafe) and log how programs will run. Training and the
    gradient probes both call this before they score."""
    if any(runs_programs(fn) for fn in fns if fn is not None):
        log(configure(CodeRewardSettings.of(sandbox)).describe())


def pop_counts() -> dict[str, float]:
    """Outcomes since the last call: ``code_passed``, ``code_failed``, ``code_timeout``, ``code_memory``,
    ``code_crashed`` (programs) and ``code_s`` (their summed run time, seconds)."""
    counts, _State.counts = _State.counts, {}
    return counts


def _count(outcomes: list[Outcome]) -> None:
    counts = _State.counts
    for status in STATUSES:
        counts[f"code_{status}"] = counts.get(f"code_{status}", 0) + sum(o.status == status for o in outcomes)
    counts["code_s"] = counts.get("code_s", 0.0) + sum(o.seconds for o in outcomes)


def _tests_of(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return (value,)
        return tuple(map(str, parsed)) if isinstance(parsed, list) else (value,)
    return tuple(map(str, value))


def _io_of(value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        value = json.loads(value)
    pairs = [(p["input"], p["output"]) if isinstance(p, dict) else tuple(p) for p in value]
    return tuple((str(i), str(o)) for i, o in pairs)


def job_of(completion: Any, tests: Any = None, io: Any = None, entry_point: str | None = None) -> Job:
    """The sandbox job for one completion (a string, or TRL's ``[{"role": "assistant", "content": ...}]``)."""
    if isinstance(completion, list):
        completion = completion[-1]["content"]
    program = extract_program(completion)
    if tests is not None and not isinstance(tests, float):  # a missing CSV cell reads as NaN
        return Job(program, tests=_tests_of(tests), entry_point=entry_point or None)
    if io is not None:
        return Job(program, io=_io_of(io))
    raise ValueError("a record with neither a 'tests' nor an 'io' column: nothing to run the program against")


def code_reward(prompts: list, completions: list, tests: list | None = None, **kwargs) -> list[float]:
    """The fraction of its record's tests each completion's program passes (1/0 with ``mode="all"``).

    ``tests``: one entry per completion (see the module's docstring); ``io`` and ``entry_point`` arrive as keyword
    arguments the same way. Every program runs in the sandbox, ``workers`` at a time."""
    n = len(completions)
    columns = {"tests": tests, "io": kwargs.get("io"), "entry_point": kwargs.get("entry_point")}
    per_row = {k: (v if v is not None else [None] * n) for k, v in columns.items()}
    jobs = [job_of(c, t, i, e) for c, t, i, e in zip(completions, *per_row.values())]
    outcomes = sandbox().run(jobs)
    _count(outcomes)
    if _State.settings.mode == "all":
        return [float(o.status == "passed") for o in outcomes]
    return [o.fraction for o in outcomes]


code_reward.pop_counts = pop_counts
code_reward.columns = ()  # tests or io: either column will do (a record with neither is an error, counted)
