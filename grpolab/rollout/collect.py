"""Collect a step's rollouts under a sampling mode (``grpolab.algo.group_budget`` says how many of which).

Rollout ``g`` of the step's prompt ``b`` always draws from the stream keyed
``(streams.ROLLOUT, seed, step, b, g)``, whatever the mode: prompts are numbered across the
step's rounds (round 1 holds 0..B-1, round 2 continues from B), and an adaptive prompt's
pilot is its rollouts 0..n0-1. So ``fixed`` draws exactly what it always drew, an
``adaptive`` group is a prefix of a longer fixed group, and nothing depends on the number
of processes: each rank samples a contiguous block of each round's prompts
(:meth:`World.split`) and the keep/allocate decisions are taken on the gathered rewards,
identically on every rank.

The collector is given its collaborators, not the trainer: the rollout service that draws and scores every
rollout (``grpolab.rollout.service``: a rollout engine, the task's environment, the reward), the task's prompt
sampler, the process world and the settings it needs. Each rollout is a single-turn completion, or an episode of an
environment whose later replies draw from ``(streams.TURN, *the rollout's key, turn)``. What a sampling call holds
is a :class:`grpolab.rollout.rows.Rows`.
"""

from __future__ import annotations

import dataclasses

import torch

from grpolab.algo.group_budget import allocate_group_sizes, next_round_size
from grpolab.algo.groups import has_variance, offsets, varies
from grpolab.common import distributed as dist_
from grpolab.common import streams
from grpolab.common.distributed import SINGLE, World
from grpolab.config.rollout import GenerationSection, GroupsSection
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.episodes import EpisodeFacts, max_return
from grpolab.rollout.rows import (
    Rows,
    entropy_sums,
    merge_logged,
    rollout_lengths,
    sequence_tokens,
    sum_counts,
    take_rows,
    truncated_flags,
)
from grpolab.rollout.service import RolloutService


@dataclasses.dataclass
class Groups:
    """This rank's groups that enter the update; the rows of group k are contiguous in ``rows``, in order."""

    prompt: list[int]  # the step's prompt index of each group (global, numbered across rounds)
    records: list[dict]
    sizes: list[int]
    rows: Rows


@dataclasses.dataclass
class Generated:
    """Every rollout generated in a step (all ranks), one entry per rollout in the order drawn: what the step's
    metrics read (``grpolab.training.books``)."""

    reward: list[float]
    accuracy: list[float]
    """The first reward function's value (``reward/accuracy``); an environment task without reward functions: the
    return as a share of the environment's ``max_return``."""
    format: list[float] | None
    """The format reward's value (None without one)."""
    components: dict[str, list[float | None]]
    """Each other reward component's values, by name (``reward/<name>``): further reward functions, ``env`` (an
    episode's return), ``overlong``; None where a function returned None (it does not apply)."""
    entropy_sum: list[float]
    """The sampler's entropies summed over each rollout's tokens; empty when the engine gives none (vLLM)."""
    length: list[int]
    truncated: list[bool]
    errors: int
    """(rollout, reward function) evaluations that raised or were non-finite."""
    counts: dict[str, float]
    """What reward functions counted, summed (the code reward's outcomes)."""
    episodes: EpisodeFacts | None = None
    zero_std: float = 0.0
    """The share of drawn groups whose rewards were all equal."""
    logged: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Scalars the reward functions logged (TRL's ``log_metric``), by name."""
    unscorable: list[bool] = dataclasses.field(default_factory=list)
    """Per rollout, whether every reward function returned None for it (empty: none did)."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    """Per rollout, its prompt's and completion's tokens (:func:`grpolab.rollout.rows.sequence_tokens`)."""

    @property
    def n(self) -> int:
        return len(self.reward)

    @classmethod
    def merge(cls, parts: list[Generated]) -> Generated:
        """Several calls' (or ranks') rollouts in one, in order: lists concatenated, errors and counts summed."""
        first = parts[0]
        return cls(
            [x for p in parts for x in p.reward],
            [x for p in parts for x in p.accuracy],
            None if first.format is None else [x for p in parts for x in p.format],
            {k: [x for p in parts for x in p.components[k]] for k in first.components},
            [x for p in parts for x in p.entropy_sum],
            [x for p in parts for x in p.length],
            [x for p in parts for x in p.truncated],
            sum(p.errors for p in parts),
            sum_counts([p.counts for p in parts]),
            None if first.episodes is None else EpisodeFacts.merge([p.episodes for p in parts]),
            logged=merge_logged([p.logged for p in parts]),
            unscorable=[u for p in parts for u in p.unscorable or [False] * p.n]
            if any(p.unscorable for p in parts)
            else [],
            tokens=[t for p in parts for t in p.tokens],
        )


def applied_values(values: torch.Tensor, skipped: torch.Tensor | None) -> list[float | None]:
    """A component's values, None where its function returned None."""
    out = values.tolist()
    return out if skipped is None else [None if s else v for v, s in zip(out, skipped.tolist())]


def generated_of(service: RolloutService, rows: Rows) -> Generated:
    """This rank's rollouts ``rows`` of one sampling call through ``service``, as the metrics read them (every
    rank's are gathered)."""
    comp = rows.scores.components
    names = service.reward.names  # the first is the accuracy reward (grpolab.rewards.rewarder)
    others = {n: applied_values(comp[n], rows.scores.skipped.get(n)) for n in names if n not in ("accuracy", "format")}
    others |= {n: comp[n].tolist() for n in service.reward.details}  # a judge's criteria and failures
    if rows.episodes is not None:
        others["env"] = comp["env"].tolist()  # the environment's return
    return Generated(
        rows.scores.total.tolist(),
        _accuracy(service, rows).tolist(),
        comp["format"].tolist() if "format" in comp else None,
        others,
        entropy_sums(rows) if rows.entropy is not None and rows.batch is not None else [],
        rollout_lengths(rows),
        truncated_flags(rows, service.policy.eos_id),
        rows.scores.errors,
        rows.scores.counts,
        None if rows.episodes is None else EpisodeFacts.of(rows.episodes),
        logged=rows.scores.logged,
        unscorable=[] if rows.scores.unscorable is None else rows.scores.unscorable.tolist(),
        tokens=sequence_tokens(rows),
    )


def _accuracy(service: RolloutService, rows: Rows) -> torch.Tensor:
    """``[n]`` each rollout's accuracy: the first reward function's value; for an environment task without reward
    functions, the return as a share of the environment's ``max_return``."""
    names = service.reward.names
    if names:
        return rows.scores.components[names[0]]
    best = torch.tensor([max_return(e.env) for e in rows.episodes], dtype=torch.float32)
    return rows.scores.components["env"] / best


@dataclasses.dataclass
class StepRollouts:
    groups: Groups
    prompts: list[int]
    """Every group entering the update (all ranks), in prompt order: its prompt index ..."""
    rewards: list[list[float]]
    """... and its rollouts' rewards."""
    generated: Generated
    """Every rollout generated this step (all ranks)."""
    rounds: int
    short: bool
    """filter: fewer than B groups with variance after the last round."""
    time_generate: float
    time_score: float

    @property
    def positions(self) -> dict[int, int]:
        """prompt index -> its group's place among the update's groups."""
        return {b: k for k, b in enumerate(self.prompts)}


@dataclasses.dataclass(frozen=True)
class CollectSettings:
    """What the collector needs of a run's configuration."""

    mode: str
    """--sampling: fixed, filter or adaptive (``grpolab.algo.group_budget``)."""
    prompts_per_step: int
    group_size: int
    seed: int
    sampling: SamplingSettings
    max_sampling_rounds: int = 3
    pilot_size: int = 4
    max_group_size: int = 0
    """adaptive: the largest group; 0 = 4 G."""

    @classmethod
    def of(cls, groups: GroupsSection, generation: GenerationSection, seed: int) -> CollectSettings:
        """From a run's resolved ``groups`` and ``generation`` options."""
        return cls(
            groups.sampling,
            groups.prompts_per_step,
            groups.group_size,
            seed,
            SamplingSettings.of(generation),
            groups.max_sampling_rounds,
            groups.pilot_size,
            groups.max_group_size,
        )


class Collector:
    """Samples and scores a step's rollouts through the run's :class:`grpolab.rollout.service.RolloutService`.

    ``sampler`` draws the step's task records (``draw(step, n, round=...)``); ``world`` splits prompts over
    processes; ``status`` is told what is being done (a progress bar's status line).
    """

    def __init__(
        self,
        service: RolloutService,
        sampler,
        settings: CollectSettings,
        world: World = SINGLE,
        status=lambda text: None,
    ):
        self.service, self.sampler, self.settings, self.world, self.status = service, sampler, settings, world, status

    # ------------------------------------------------------------------ one sampling call
    def _generate(self, step: int, items: list[tuple[int, dict, range]]) -> tuple[Rows, float, float]:
        """Rollouts ``g in gs`` of prompts ``(b, record, gs)``; returns the rows and (generation, scoring) seconds."""
        return self.service.sample(*self._requests(step, items), self.settings.sampling)

    def _requests(self, step: int, items: list[tuple[int, dict, range]]) -> tuple[list[dict], list[tuple]]:
        """The records and rollout keys of rollouts ``g in gs`` of prompts ``(b, record, gs)``."""
        recs = [rec for _, rec, gs in items for _ in gs]
        seed = self.settings.seed
        keys = [(streams.ROLLOUT, seed, step, b, g) for b, _, gs in items for g in gs]  # global b: P-independent
        return recs, keys

    def prefetch(self, step: int) -> bool:
        """Ask the service to start drawing ``step``'s first sampling call now (the whole step under --sampling
        fixed; the first round or the pilot otherwise), as :meth:`collect` will ask for it; whether it started.
        The records come from the sampler's draw for ``step``, a function of the step alone."""
        s = self.settings
        n = s.pilot_size if s.mode == "adaptive" else s.group_size
        recs = self.sampler.draw(step, s.prompts_per_step)
        items = [(b, recs[b], range(n)) for b in self.world.split(s.prompts_per_step)]
        return self.service.prefetch(*self._requests(step, items), s.sampling)

    def _gather(self, local: Generated) -> Generated:
        """Every rank's rollouts, in rank order (= prompt order within a call)."""
        return Generated.merge(dist_.gather(local, self.world))

    # ------------------------------------------------------------------ the modes
    def collect(self, step: int) -> StepRollouts:
        mode = self.settings.mode
        return self._adaptive(step) if mode == "adaptive" else self._rounds(step, filtering=mode == "filter")

    def _rounds(self, step: int, filtering: bool) -> StepRollouts:
        """fixed (one round, every group kept) and filter (rounds until B groups with variance)."""
        s, world = self.settings, self.world
        B, G = s.prompts_per_step, s.group_size
        parts: list[Rows] = []
        mine_groups: list[tuple[int, dict, int, int]] = []  # (prompt, record, part, first row) of this rank's groups
        kept: list[tuple[int, list[float]]] = []  # (prompt, rewards) of every kept group, all ranks
        generated: Generated | None = None
        zero_groups = drawn = rounds = 0
        t_gen = t_score = 0.0
        while True:
            n = B if rounds == 0 else next_round_size(B, len(kept), drawn)
            if n == 0 or rounds == (s.max_sampling_rounds if filtering else 1):
                break
            recs = self.sampler.draw(step, n, round=rounds)  # round 0: the step's usual draw
            mine = world.split(n)
            self.status(f"step {step}: sampling {n * G} rollouts" + (f" (round {rounds + 1})" if rounds else ""))
            rows, tg, ts = self._generate(step, [(drawn + b, recs[b], range(G)) for b in mine])
            t_gen, t_score = t_gen + tg, t_score + ts
            parts.append(rows)
            mine_groups += [(drawn + b, recs[b], len(parts) - 1, i * G) for i, b in enumerate(mine)]
            whole = self._gather(generated_of(self.service, rows))
            generated = Generated.merge([generated, whole]) if generated else whole
            rewards = torch.tensor(whole.reward).view(n, G)  # [n, G], this round's, every rank's
            var = has_variance(rewards)
            zero_groups += int((~var).sum())
            kept += [(drawn + b, rewards[b].tolist()) for b in range(n) if var[b] or not filtering]
            drawn += n
            rounds += 1
        kept = kept[:B]
        keep_prompts = {b for b, _ in kept}
        order, prompt, records = [], [], []
        for b, rec, part, first in mine_groups:
            if b in keep_prompts:
                prompt.append(b)
                records.append(rec)
                order += [(part, first + g) for g in range(G)]
        rows = take_rows(parts, order, self.service.policy.pad_id)
        generated.zero_std = zero_groups / drawn
        return StepRollouts(
            Groups(prompt, records, [G] * len(prompt), rows),
            [b for b, _ in kept],
            [r for _, r in kept],
            generated,
            rounds,
            filtering and len(kept) < B,
            t_gen,
            t_score,
        )

    def _adaptive(self, step: int) -> StepRollouts:
        """A pilot of n0 rollouts per prompt, then the rest of the budget B G where it lowers the error most."""
        s, world = self.settings, self.world
        B, G, n0 = s.prompts_per_step, s.group_size, s.pilot_size
        recs = self.sampler.draw(step, B)
        mine = world.split(B)
        self.status(f"step {step}: sampling the pilot ({B * n0} rollouts)")
        pilot, tg1, ts1 = self._generate(step, [(b, recs[b], range(n0)) for b in mine])
        whole = self._gather(generated_of(self.service, pilot))
        pilot_rewards = torch.tensor(whole.reward).view(B, n0).tolist()
        sizes = allocate_group_sizes(pilot_rewards, B * G, s.max_group_size or 4 * G)
        self.status(f"step {step}: sampling {B * G - B * n0} more rollouts (groups of {min(sizes)}-{max(sizes)})")
        extra, tg2, ts2 = self._generate(step, [(b, recs[b], range(n0, sizes[b])) for b in mine])
        whole_extra = self._gather(generated_of(self.service, extra))
        # Every rank's extras in prompt order: prompt b's are the (sizes[b] - n0) after those of prompts < b.
        e_start = offsets([n - n0 for n in sizes])
        rewards = [pilot_rewards[b] + whole_extra.reward[e_start[b] : e_start[b + 1]] for b in range(B)]
        generated = Generated.merge([whole, whole_extra])
        generated.zero_std = sum(not varies(r) for r in rewards) / B
        # This rank's rows, group by group: its pilot rows (part 0), then its extra rows (part 1).
        mine_extra = offsets([sizes[b] - n0 for b in mine])
        order = []
        for i, b in enumerate(mine):
            order += [(0, i * n0 + g) for g in range(n0)] + [(1, mine_extra[i] + g) for g in range(sizes[b] - n0)]
        rows = take_rows([pilot, extra], order, self.service.policy.pad_id)
        groups = Groups(list(mine), [recs[b] for b in mine], [sizes[b] for b in mine], rows)
        return StepRollouts(groups, list(range(B)), rewards, generated, 2, False, tg1 + tg2, ts1 + ts2)
