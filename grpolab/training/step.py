"""What one training step produced, as typed records: its advantages and its result, and the interface of what
watches a step (the probes, the token-credit records, the rollout logs: ``grpolab.training.observers``)."""

from __future__ import annotations

import dataclasses

import torch

from grpolab.rollout.collect import StepRollouts


@dataclasses.dataclass
class Advantages:
    """A step's credit, this rank's rollouts."""

    rollout: torch.Tensor
    """``[n]`` each rollout's advantage (an episode's: its first turn's), group by group."""
    token: torch.Tensor | None = None
    """``[m, T]`` (episodes) each of the policy's tokens' advantage, its turn's under --advantage; None for
    single-turn rollouts, whose tokens all take their rollout's [Foundations, Thm 3.1]."""
    turns: list[torch.Tensor] | None = None
    """(episodes) each rollout's advantage at each of its turns (``[H_i]``)."""


@dataclasses.dataclass
class StepResult:
    """One step: its rollouts and credit, then what the update and the observers made of them."""

    step: int
    collected: StepRollouts
    """The rollouts the step drew and scored (``grpolab.rollout.collect``)."""
    advantages: Advantages
    weights_version: int | None = None
    """--max-staleness: the weight sync whose weights drew the step's rollouts (0: the starting weights); None when
    they are the current ones."""
    watch: list[int] | None = None
    """Rollouts (this rank's) whose tokens the update keeps per token (--log-token-credit)."""
    update: dict = dataclasses.field(default_factory=dict)
    """The update's metrics (``loss/*``, ``grad/*``, ``charts/lr``, ``engine/*``)."""
    metrics: dict = dataclasses.field(default_factory=dict)
    """Every metric of the step, as metrics.jsonl holds it (the observers add theirs)."""
    samples: list[dict] = dataclasses.field(default_factory=list)
    """The first completion of the first --log-samples prompts (samples.jsonl)."""
    rollouts: list[dict] | None = None
    """Every rollout of the step, in (prompt, rollout) order, with --log-rollouts (rollouts.jsonl)."""
    token_credit: list[dict] | None = None
    """The rollouts recorded token by token, with --log-token-credit (rank 0's; token_credit.jsonl)."""
    probe: list[dict] | None = None
    """Each group the spectrum probe measured, with --probe-every (probe.jsonl)."""
    hacking: list[dict] | None = None
    """The evidence of the hacking signs measured at the step: the rollouts that carry each (hacking.jsonl)."""
    engine_events: list[dict] | None = None
    """What an engine that draws elsewhere did since the last step (generator workers: each draw, weight
    broadcast, join and loss; generators.jsonl)."""


class StepObserver:
    """Watches each step. ``watch`` names the rollouts whose per-token values the update should keep; then
    ``before_update`` sees the result on the policy that sampled, ``after_update`` once the weights moved. Each
    writes what it measured into the result (its metrics, records). Every rank calls the same observers in the same
    order, so those that gather over ranks stay in step."""

    def watch(self, result: StepResult) -> list[int] | None:
        return None

    def before_update(self, result: StepResult) -> None:
        """The policy still holds the weights that sampled ``result``'s rollouts."""

    def after_update(self, result: StepResult) -> None:
        """The update has run (``result.update``)."""
