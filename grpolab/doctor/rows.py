"""What every check of the doctor reads with: a finding, the run's options the checks need, and the metric rows
read over a window of steps (the rows are ``metrics.jsonl``'s, oldest first)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING
from grpolab.config.run import MachineSection
from grpolab.config.train import TrainConfig
from grpolab.rewards.model import model_name
from grpolab.rewards.rewarder import metric_names

WINDOW = 5
"""Training steps a check reads: one step's 8-32 groups are too few to tell a trend from noise, and five let the
first check in training come at step 5."""

MIN_STEPS = 3
"""No check before the run has this many training steps."""

SEVERITIES = ("error", "warning", "info")
LEVEL = {"error": 3, "warning": 2, "info": 1}
"""A finding's severity as the number logged in ``doctor/<name>`` (0: not found at that check)."""

RISE_SD = 0.5
"""The reward has risen when its mean over the last WINDOW steps exceeds its mean over the first by this many of the
start's rollout standard deviations (reward/std): scale-free, and well above the step-to-step noise of a window's
mean (about sd / sqrt(WINDOW * rollouts))."""
CEILING = 0.9
"""A mean first reward (reward/accuracy) at or above this over WINDOW steps is near its ceiling (for rewards in
[0, 1])."""


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """The options of a run that the checks read (from its config.json)."""

    max_new_tokens: int = 48
    group_size: int = 8
    lr: float = 5e-5
    warmup_steps: int = 0
    mu: int = 1
    beta: float = 0.0
    engine_correction: str = "none"
    answer_check: str = ""
    """'####' or 'boxed' when the run's accuracy is the built-in answer check; '' when a reward function replaces it
    or the task is an environment's."""
    reward_functions: int = 2
    """Functions scored per rollout (reward/errors counts their failures)."""
    reward_weights: tuple[float, ...] = ()
    components: tuple[str, ...] = ()
    """The reward/<name> keys of the functions after the first (their unweighted means), in order."""
    sampling: str = "fixed"
    precision: str = ""
    """--precision as the run resolved it ('' for a run recorded before it: see ``of``)."""
    compensation: str = ""
    """bf16-true's optimizer compensation ('kahan' or 'none')."""
    model_reward: str = ""
    """What model the run's reward comes from: 'reward model' (--reward-model), 'judge' (--judge) or '' (only
    functions: a verifier)."""
    unbounded: bool = False
    """The first reward component (reward/accuracy) is a reward model's score, a logit with no ceiling: the checks
    that read a ceiling of 1 in it (CEILING) do not apply."""

    @classmethod
    def of(cls, config: dict) -> RunFacts:
        """The facts of a run from its config.json, read as the config reads it (:meth:`TrainConfig.of_run`: an
        option the file does not hold has the value its run had)."""
        cfg = TrainConfig.of_run(config)
        reward, episodes = cfg.reward, cfg.episodes
        plain, models, judge = tuple(reward.reward_fn or ()), tuple(reward.reward_model or ()), reward.judge or ""
        fns = plain + models + ((judge,) if judge else ())  # functions first (a null in an old config.json: none)
        fmt = cfg.dataset.format
        check = "" if fns or episodes.multi_turn or fmt == "prompt" else ("boxed" if fmt == "math" else "####")
        short = [NOTHING.name_of(str(p)) for p in plain] + [model_name(m) for m in models]
        short += [Path(judge).stem] if judge else []
        names = tuple(metric_names(short))  # as the run named their metrics
        weights = tuple(reward.reward_weights or ()) or (1.0,) * len(fns)
        return cls(
            max_new_tokens=cfg.generation.max_new_tokens,
            group_size=cfg.groups.group_size,
            lr=float(cfg.optimizer.lr),
            warmup_steps=cfg.optimizer.warmup_steps,
            mu=cfg.objective.mu,
            beta=float(cfg.objective.beta),
            engine_correction=cfg.objective.engine_correction,
            answer_check=check,
            reward_functions=len(fns) if fns else 2,
            reward_weights=weights,
            components=names[1:],
            sampling=cfg.groups.sampling,
            model_reward="judge" if judge else "reward model" if models else "",
            unbounded=bool(models) and not plain,
            **_precision_of(cfg.machine),
        )


def _precision_of(machine: MachineSection) -> dict:
    """The run's precision and compensation; a run recorded before --precision names a --dtype (bfloat16: plain
    AdamW on bf16 weights), and one that names neither gives ('', '')."""
    try:
        machine = machine.folded()
    except (ConfigError, KeyError):  # a --dtype beside another --precision (or one no longer known): the precision
        pass
    if machine.precision == "auto":
        return {"precision": "", "compensation": ""}
    return {"precision": machine.precision, "compensation": machine.compensation}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One condition found in a run."""

    name: str
    """The condition's id: the check's name (``doctor/<name>`` in the metrics)."""
    severity: str
    """'error', 'warning' or 'info'."""
    title: str
    """One line naming it."""
    evidence: str
    """Which metric, over which steps, against what threshold."""
    fix: str
    """One concrete change: a flag and a value, or what to check."""
    keys: tuple[str, ...]
    """The metrics that show it (what the report plots for it)."""
    steps: tuple[int, int]
    """The steps the evidence covers."""
    threshold: float | None = None
    """The threshold the main metric crossed (drawn on the report's plot)."""
    example: dict | None = None
    """From the run's own samples, where one shows it (filled by :mod:`grpolab.doctor.examine`)."""
    first_step: int | None = None
    """The check step at which it was first found (filled when a run is replayed)."""
    ongoing: bool = True
    """Still found at the run's last check (filled when a run is replayed)."""
    last_step: int | None = None
    """The last check step at which it was found (filled when a run is replayed)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def when(self) -> str:
        """When a replayed run found it: "found at step 5" (and at every check since, the last included), or "found
        at steps 5-115, not at the last check"; "" for a finding that was not replayed."""
        if self.first_step is None:
            return ""
        if self.ongoing:
            return f"found at step {self.first_step}"
        last = self.last_step if self.last_step is not None else self.first_step
        found = f"step {last}" if last == self.first_step else f"steps {self.first_step}-{last}"
        return f"found at {found}, not at the last check"


def training_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows of training steps (an evaluation-only row, such as step 0's, has no reward/mean)."""
    return [r for r in rows if r.get("reward/mean") is not None]


def window(rows: Sequence[dict]) -> list[dict]:
    t = training_rows(rows)
    return t[-WINDOW:] if len(t) >= MIN_STEPS else []


def values(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def mean(rows: Sequence[dict], key: str) -> float | None:
    v = values(rows, key)
    return statistics.fmean(v) if v else None


def span(rows: Sequence[dict]) -> tuple[int, int]:
    return rows[0]["step"], rows[-1]["step"]


def steps_of(rows: Sequence[dict]) -> str:
    a, b = span(rows)
    return f"step {a}" if a == b else f"steps {a}-{b}"


def reward_rise(rows: Sequence[dict]) -> tuple[float, float] | None:
    """(rise, start sd): the mean reward over the last WINDOW training steps minus that over the first WINDOW, and the
    mean rollout standard deviation (reward/std) of the first WINDOW. None before 2 * WINDOW steps."""
    t = training_rows(rows)
    if len(t) < 2 * WINDOW:
        return None
    first, last = t[:WINDOW], t[-WINDOW:]
    return mean(last, "reward/mean") - mean(first, "reward/mean"), mean(first, "reward/std") or 0.0


def learned(rows: Sequence[dict], sds: float = RISE_SD) -> bool:
    """Has the training reward risen by ``sds`` start standard deviations (and by something)?"""
    rise = reward_rise(rows)
    return rise is not None and rise[0] > 0 and rise[0] >= sds * rise[1]


ACCURACIES = ("eval/accuracy_sampled", "eval/accuracy_greedy")
"""The held-out accuracies a check compares: sampled at the run's temperature (what the training reward measures)
first, then greedy."""


def at_ceiling(accuracy: float | None, facts: RunFacts) -> bool:
    """Whether a mean first reward (reward/accuracy) is near its ceiling: at or above CEILING, for a reward in [0, 1]
    (never for a reward model's logit: ``facts.unbounded``)."""
    return accuracy is not None and not facts.unbounded and accuracy >= CEILING


def held_out(rows: Sequence[dict], key: str = "eval/accuracy_greedy") -> tuple[dict, dict] | None:
    """The first and last rows with the held-out accuracy ``key``, when there are two."""
    evals = [r for r in rows if r.get(key) is not None]
    return (evals[0], evals[-1]) if len(evals) >= 2 else None


def held_out_rose(rows: Sequence[dict]) -> bool:
    """Did a held-out accuracy (sampled or greedy) rise beyond its first evaluation's 95% interval?"""
    for key in ACCURACIES:
        pair = held_out(rows, key)
        if pair is not None and pair[1][key] > pair[0].get(key + "_hi", pair[0][key]):
            return True
    return False
