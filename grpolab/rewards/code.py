"""Code rewards [RLVR essay, Sec. 1]: a program passes its test cases or fails.

:func:`code_reward` takes the program out of each completion (the last fenced code block, or the whole text),
runs it with its record's tests in the sandbox (:mod:`grpolab.sandbox`: never in this process) and gives the
fraction of tests passed, or 1/0 under ``mode="all"``. Records carry either

- ``tests``: Python statements run after the program, each an ``assert`` (a list; a string holding a JSON list;
  or one string, one test: a HumanEval ``def check(candidate): ...`` is called with ``entry_point``), or
- ``io``: ``[stdin, expected stdout]`` pairs (or ``{"input", "output"}`` objects); the program runs as a script
  once per pair and its printed output, trailing white space aside, must equal the expected one.

A test ``assert EXPR == LITERAL`` and an io test are judged outside the program's interpreter, by value and type
(:mod:`grpolab.sandbox.verdict`); any other test's verdict is the harness's, which the program can forge (counted).

It is a TRL-form reward function (``code_reward(prompts, completions, tests, **kwargs)``), so it also serves
TRL's GRPOTrainer. Each call's outcomes are counted (``pop_counts``: the trainer logs them as ``reward/code_*``).
"""

from __future__ import annotations

import copy
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


class CodeReward:
    """The code reward with the sandbox its programs run in (started on first use, or by :meth:`start`), and the
    outcomes it counted since they were last taken (:meth:`pop_counts`).

    A TRL-form reward function: ``code_reward(prompts, completions, tests=..., **kwargs)``. A run's
    :class:`grpolab.rewards.rewarder.Rewarder` holds one of its own, made from the run's ``--code-*`` and
    ``--sandbox*`` options, and closes it with the run; :data:`code_reward` is one with the defaults, for use as a
    plain function (in TRL's GRPOTrainer, say)."""

    __name__ = "code_reward"
    columns = ()  # tests or io: either column will do (a record with neither is an error, counted)

    def __init__(self, settings: CodeRewardSettings | None = None):
        self.settings = settings or CodeRewardSettings()
        self._sandbox: Sandbox | None = None
        self.counts: dict[str, float] = {}

    def for_run(self, settings: CodeRewardSettings) -> CodeReward:
        """A copy of this reward (of its own class, a subclass's attributes kept) with ``settings`` and a sandbox of its
        own, not yet started: what a run scores with."""
        run = copy.copy(self)
        run.settings, run._sandbox, run.counts = settings, None, {}
        return run

    def sandbox(self) -> Sandbox:
        """The sandbox the programs run in (made on first use from the settings)."""
        if self._sandbox is None:
            s = self.settings
            self._sandbox = Sandbox(s.limits, s.workers, s.isolation, s.command, s.allow_network)
        return self._sandbox

    def start(self) -> str:
        """Start the sandbox now, so that a machine where programs cannot be isolated says so at once (a
        SandboxError) rather than at the first reward; returns how programs will run."""
        return self.sandbox().describe()

    def close(self) -> None:
        """Stop the sandbox's workers (a later call starts them again)."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def pop_counts(self) -> dict[str, float]:
        """Outcomes since the last call: ``code_passed``, ``code_failed``, ``code_timeout``, ``code_memory``,
        ``code_crashed``, ``code_forged`` (programs), ``code_judged_inside`` (their tests judged in the program's
        interpreter, whose verdict it can forge: neither ``assert EXPR == LITERAL`` nor io) and ``code_s`` (their
        summed run time, seconds)."""
        counts, self.counts = self.counts, {}
        return counts

    def _count(self, outcomes: list[Outcome]) -> None:
        for status in STATUSES:
            key = f"code_{status}"
            self.counts[key] = self.counts.get(key, 0) + sum(o.status == status for o in outcomes)
        inside = self.counts.get("code_judged_inside", 0)
        self.counts["code_judged_inside"] = inside + sum(o.judged_inside for o in outcomes)
        self.counts["code_s"] = self.counts.get("code_s", 0.0) + sum(o.seconds for o in outcomes)

    def __call__(self, prompts: list, completions: list, tests: list | None = None, **kwargs) -> list[float]:
        """The fraction of its record's tests each completion's program passes (1/0 with ``mode="all"``).

        ``tests``: one entry per completion (see the module's docstring); ``io`` and ``entry_point`` arrive as keyword
        arguments the same way. Every program runs in the sandbox, ``workers`` at a time."""
        n = len(completions)
        columns = {"tests": tests, "io": kwargs.get("io"), "entry_point": kwargs.get("entry_point")}
        per_row = {k: (v if v is not None else [None] * n) for k, v in columns.items()}
        jobs = [job_of(c, t, i, e) for c, t, i, e in zip(completions, *per_row.values())]
        outcomes = self.sandbox().run(jobs)
        self._count(outcomes)
        if self.settings.mode == "all":
            return [float(o.status == "passed") for o in outcomes]
        return [o.fraction for o in outcomes]


code_reward = CodeReward()
"""The code reward with the default settings, as ``--reward-fn grpolab.rewards:code_reward`` names it (a run scores
with its own :class:`CodeReward`, made from its options)."""
