"""Collect a step's rollouts under a sampling mode (``grpolab.group_budget`` says how many of which).

Rollout ``g`` of the step's prompt ``b`` always draws from the stream keyed
``(streams.ROLLOUT, seed, step, b, g)``, whatever the mode: prompts are numbered across the
step's rounds (round 1 holds 0..B-1, round 2 continues from B), and an adaptive prompt's
pilot is its rollouts 0..n0-1. So ``fixed`` draws exactly what it always drew, an
``adaptive`` group is a prefix of a longer fixed group, and nothing depends on the number
of processes: each rank samples a contiguous block of each round's prompts
(:meth:`World.split`) and the keep/allocate decisions are taken on the gathered rewards,
identically on every rank.

The collector is given its collaborators, not the trainer: a rollout engine that generates
(``grpolab.engine``), the task's prompt sampler, the policy's prompt formatting and tokenizer,
the reward, the process world and the settings it needs. Any of them can be replaced, e.g. a
second rollout engine, or a stand-in engine in a test.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from grpolab import distributed as dist_
from grpolab import streams
from grpolab.distributed import SINGLE, World
from grpolab.engine import RolloutEngine, SamplingSettings
from grpolab.env.episodes import EpisodeRunner, episode_rows
from grpolab.group_budget import allocate_group_sizes, next_round_size
from grpolab.groups import has_variance, offsets, varies
from grpolab.policy import Policy
from grpolab.rewards import Rewarder, Scores
from grpolab.rollout import Batch, select


@dataclasses.dataclass(eq=False)
class Rows:
    """Sampled rollouts held by this rank, with their texts and scores, and the token rows of the update.

    A single-turn rollout is one token row. An episode (``episodes``) is one row, or one per segment when its
    environment shows each turn only its latest messages; an episode's rows are contiguous, in episode order.
    """

    batch: Batch | None
    """``[m, ...]`` token rows; with n = 0, None or (a rank that keeps no group) one stand-in row that carries no
    loss."""
    texts: list[str]
    """``[n]`` each rollout's completion (an episode's: its last reply)."""
    scores: Scores
    """``[n]``."""
    entropy: torch.Tensor | None = None
    """``[m, T]`` the sampling policy's entropy at each completion token (0 on padding), aligned with ``batch``."""
    logprobs: torch.Tensor | None = None
    """``[m, T]`` the sampler's log-prob of each completion token (0 on padding), aligned with ``batch``."""
    episodes: list | None = None
    """``[n]`` the rollouts' :class:`grpolab.env.episodes.Episode` (environment tasks); None: single-turn rollouts."""
    action: torch.Tensor | None = None
    """``[m, T]`` (episodes) 1 on the policy's own tokens, 0 on the environment's and on padding."""
    turn: torch.Tensor | None = None
    """``[m, T]`` (episodes) the turn of each of the policy's tokens, -1 elsewhere."""
    row_counts: list[int] | None = None
    """``[n]`` (episodes) token rows of each rollout."""

    @property
    def n(self) -> int:
        return len(self.texts)

    @property
    def counts(self) -> list[int]:
        """Token rows of each rollout (1 each for single-turn rollouts)."""
        return self.row_counts if self.row_counts is not None else [1] * self.n

    def rows_of(self, rollouts: list[int]) -> list[int]:
        """The token rows of ``rollouts``, in order."""
        if self.row_counts is None:
            return list(rollouts)
        start = offsets(self.row_counts)
        return [r for i in rollouts for r in range(start[i], start[i + 1])]

    @property
    def loss_tokens(self) -> torch.Tensor | None:
        """``[m, T]`` the tokens that are the policy's: ``action`` for episodes, else the completion mask."""
        if self.batch is None:
            return None
        return self.action if self.action is not None else self.batch.completion_mask


@dataclasses.dataclass
class Groups:
    """This rank's groups that enter the update; the rows of group k are contiguous in ``rows``, in order."""

    prompt: list[int]  # the step's prompt index of each group (global, numbered across rounds)
    records: list[dict]
    sizes: list[int]
    rows: Rows


@dataclasses.dataclass
class StepRollouts:
    groups: Groups
    prompts: list[int]
    """Every group entering the update (all ranks), in prompt order: its prompt index ..."""
    rewards: list[list[float]]
    """... and its rollouts' rewards."""
    generated: dict
    """Every rollout generated this step (all ranks): per-rollout lists ``reward``, ``accuracy``, ``format``,
    ``length``, ``truncated``; ``errors`` (reward-function failures); ``counts`` (what reward functions counted,
    summed: the code reward's outcomes); ``zero_std`` (share of drawn groups
    whose rewards were all equal)."""
    rounds: int
    short: bool
    """filter: fewer than B groups with variance after the last round."""
    time_generate: float
    time_score: float

    @property
    def positions(self) -> dict[int, int]:
        """prompt index -> its group's place among the update's groups."""
        return {b: k for k, b in enumerate(self.prompts)}


def concat_batches(batches: list[Batch], pad_id: int) -> Batch:
    """Rows of several batches in one: prompts left-padded, completions right-padded to the widest."""
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    T = max(b.completion_ids.shape[1] for b in batches)

    def pad(t: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Batch(
        torch.cat([pad(b.prompt_ids, P, pad_id, True) for b in batches]),
        torch.cat([pad(b.prompt_mask, P, 0, True) for b in batches]),
        torch.cat([pad(b.completion_ids, T, pad_id, False) for b in batches]),
        torch.cat([pad(b.completion_mask, T, 0, False) for b in batches]),
    )


def concat_scores(parts: list[Scores]) -> Scores:
    if len(parts) == 1:
        return parts[0]
    names = parts[0].components
    return Scores(
        torch.cat([p.total for p in parts]),
        {k: torch.cat([p.components[k] for p in parts]) for k in names},
        sum(p.errors for p in parts),
        _sum_counts([p.counts for p in parts]),
    )


def _sum_counts(parts: list[dict]) -> dict:
    out: dict = {}
    for counts in parts:
        for k, v in counts.items():
            out[k] = out.get(k, 0) + v
    return out


def merge_generated(parts: list[dict]) -> dict:
    """Per-rollout lists concatenated; ``errors`` summed; ``counts`` (reward functions' own) summed key by key."""
    return {
        k: (
            sum(p[k] for p in parts)
            if k == "errors"
            else _sum_counts([p[k] for p in parts])
            if k == "counts"
            else [x for p in parts for x in p[k]]
        )
        for k in parts[0]
    }


def _token_values(parts: list[Rows], field: str, idx: torch.Tensor, T: int, width: int) -> torch.Tensor | None:
    """Per-token values ``field`` ``[n, width]`` of the rows ``idx`` of the parts' concatenation (padded to ``T``)."""
    live = [p for p in parts if p.n]
    if any(getattr(p, field) is None for p in live):
        return None
    values = torch.cat([torch.nn.functional.pad(getattr(p, field), (0, T - getattr(p, field).shape[1])) for p in live])
    return values[idx.cpu(), :width]  # select trims the all-padding columns on the right


def _stand_in(parts: list[Rows]) -> Rows:
    """What a rank that keeps no group holds: one of its rows (with no advantage), so that it joins the update's
    collectives, and no rollout."""
    live = [p for p in parts if p.n]
    empty = Scores(torch.zeros(0), {k: torch.zeros(0) for k in parts[0].scores.components}, 0)
    if not live:
        return Rows(None, [], empty)
    first = live[0]
    stand_in = select(first.batch, torch.zeros(1, dtype=torch.long, device=first.batch.prompt_ids.device))
    width = stand_in.completion_ids.shape[1]

    def row(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:1, :width]

    episodes = None if first.episodes is None else []
    return Rows(
        stand_in,
        [],
        empty,
        row(first.entropy),
        row(first.logprobs),
        episodes,
        row(first.action),
        row(first.turn),
        None if episodes is None else [],
    )


def take_rows(parts: list[Rows], order: list[tuple[int, int]], pad_id: int) -> Rows:
    """The rollouts ``order`` = [(part, rollout), ...] of several :class:`Rows`, with their token rows, in that
    order."""
    live = [i for i, p in enumerate(parts) if p.n]
    if len(live) == 1 and order == [(live[0], r) for r in range(parts[live[0]].n)]:
        return parts[live[0]]  # all rows of one sampling call, in order: the very tensors (fixed mode)
    if not order:
        return _stand_in(parts)
    live_parts = [p for p in parts if p.n]
    row_start = offsets([sum(p.counts) for p in parts])
    roll_start = offsets([p.n for p in parts])
    batch = concat_batches([p.batch for p in live_parts], pad_id)
    rows = [row_start[i] + r for i, k in order for r in parts[i].rows_of([k])]
    idx = torch.tensor(rows, device=batch.prompt_ids.device)
    picked = torch.tensor([roll_start[i] + k for i, k in order])  # rollouts
    scores = concat_scores([p.scores for p in parts])
    texts = [t for p in parts for t in p.texts]
    chosen = select(batch, idx)
    T, width = batch.completion_ids.shape[1], chosen.completion_ids.shape[1]
    episodes = None if parts[live[0]].episodes is None else [e for p in parts for e in p.episodes or []]
    return Rows(
        chosen,
        [texts[int(i)] for i in picked],
        Scores(scores.total[picked], {k: v[picked] for k, v in scores.components.items()}, scores.errors),
        _token_values(parts, "entropy", idx, T, width),
        _token_values(parts, "logprobs", idx, T, width),
        None if episodes is None else [episodes[int(i)] for i in picked],
        _token_values(parts, "action", idx, T, width),
        _token_values(parts, "turn", idx, T, width),
        None if episodes is None else [parts[i].counts[k] for i, k in order],
    )


def _policy_tokens(episode) -> int:
    return sum(sum(s.action) for s in episode.segments)


def rollout_lengths(rows: Rows) -> list[int]:
    """Each rollout's length: its completion's tokens, or the policy's tokens over an episode."""
    if rows.batch is None:
        return []
    if rows.episodes is None:
        return rows.batch.completion_mask.sum(1).tolist()
    return [_policy_tokens(e) for e in rows.episodes]


def _truncated(rows: Rows, eos_id: int) -> list[bool]:
    """Each rollout: cut at the token limit (no end-of-sequence token), or an episode cut by a limit."""
    if rows.batch is None:
        return []
    if rows.episodes is None:
        return (~(rows.batch.completion_ids == eos_id).any(dim=1)).tolist()  # no EOS in budget
    return [e.cut for e in rows.episodes]


def _entropy_sums(rows: Rows) -> list[float]:
    """Each rollout's sum of the sampler's entropies over its (policy) tokens."""
    if rows.episodes is None:
        return rows.entropy.sum(1).tolist()
    per_row = (rows.entropy * rows.action.to(rows.entropy.dtype)).sum(1).tolist()
    start = offsets(rows.counts)
    return [sum(per_row[start[i] : start[i + 1]]) for i in range(rows.n)]


def episode_facts(episodes: list) -> dict:
    """Per-episode lists for the ``env/*`` metrics: turns, the environment's reward at each turn, tool calls and
    errors (as the environment counted them), exceptions in ``step``."""
    return {
        "turns": [e.turns for e in episodes],
        "turn_rewards": [list(e.rewards) for e in episodes],
        "tool_calls": [e.counter("tool_calls") for e in episodes],
        "tool_errors": [e.counter("tool_errors") for e in episodes],
        "tool_truncated": [e.counter("tool_truncated") for e in episodes],
        "env_errors": [int(bool(e.error)) for e in episodes],
    }


def max_return(env) -> float:
    """The largest return of an environment's episode: its ``max_return`` (default 1)."""
    value = getattr(env, "max_return", None)
    return float(value) if value else 1.0


def episode_rows_of(episodes: list, multi_turn: bool, pad_id: int, device) -> Rows:
    """The :class:`Rows` of played episodes (scores still to come)."""
    rows = episode_rows(episodes, pad_id, device)
    texts = [e.text for e in episodes]
    empty = Scores(torch.zeros(0), {}, 0)
    if not multi_turn:  # single-turn rollouts: a row each, the completion mask is the policy's tokens
        return Rows(rows.batch, texts, empty, rows.entropy, rows.logprobs)
    return Rows(rows.batch, texts, empty, rows.entropy, rows.logprobs, episodes, rows.action, rows.turn, rows.rows)


@dataclasses.dataclass(frozen=True)
class CollectSettings:
    """What the collector needs of a run's configuration."""

    mode: str
    """--sampling: fixed, filter or adaptive (``grpolab.group_budget``)."""
    prompts_per_step: int
    group_size: int
    seed: int
    sampling: SamplingSettings
    max_sampling_rounds: int = 3
    pilot_size: int = 4
    max_group_size: int = 0
    """adaptive: the largest group; 0 = 4 G."""

    @classmethod
    def from_config(cls, cfg) -> CollectSettings:
        """From a resolved :class:`grpolab.config.TrainConfig`."""
        return cls(
            cfg.sampling,
            cfg.prompts_per_step,
            cfg.group_size,
            cfg.seed,
            SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p),
            cfg.max_sampling_rounds,
            cfg.pilot_size,
            cfg.max_group_size,
        )


class Collector:
    """Samples and scores a step's rollouts.

    ``engine`` generates; ``sampler`` draws the step's task records (``draw(step, n, round=...)``);
    ``policy`` formats a record as prompt token ids and decodes completions (its model is not used
    here); ``reward`` scores completions; ``world`` splits prompts over processes; ``status`` is told
    what is being done (a progress bar's status line).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        sampler,
        policy: Policy,
        reward: Rewarder,
        settings: CollectSettings,
        world: World = SINGLE,
        status=lambda text: None,
        runner: EpisodeRunner | None = None,
    ):
        """``runner``: plays each rollout as an episode of an environment (default: single-turn rollouts)."""
        self.sampler, self.policy, self.reward = sampler, policy, reward
        self.settings, self.world, self.status = settings, world, status
        self.runner = runner if runner is not None else EpisodeRunner(engine, policy)
        self.engine = engine

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine, the runner's (set one, and the runner generates with it)."""
        return self.runner.engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self.runner.engine = engine

    # ------------------------------------------------------------------ one sampling call
    def _generate(self, step: int, items: list[tuple[int, dict, range]]) -> tuple[Rows, float, float]:
        """Rollouts ``g in gs`` of prompts ``(b, record, gs)``; returns the rows and (generation, scoring) seconds."""
        recs = [rec for _, rec, gs in items for _ in gs]
        if not recs:
            empty = Rows(None, [], self.reward([], [], torch.zeros(0, dtype=torch.long)))
            return (dataclasses.replace(empty, episodes=[], row_counts=[]) if self.runner.multi_turn else empty), 0, 0
        t0 = time.perf_counter()
        seed = self.settings.seed
        keys = [(streams.ROLLOUT, seed, step, b, g) for b, _, gs in items for g in gs]  # global b: P-independent
        episodes = self.runner.play(recs, keys, self.settings.sampling)
        t1 = time.perf_counter()
        rows = episode_rows_of(episodes, self.runner.multi_turn, self.policy.pad_id, self.engine_device)
        rows.scores = self._score(rows, recs)
        return rows, t1 - t0, time.perf_counter() - t1

    @property
    def engine_device(self):
        return getattr(self.engine, "device", None) or next(self.policy.model.parameters()).device

    def _score(self, rows: Rows, recs: list[dict]) -> Scores:
        """The rollouts' rewards: the reward functions on each completion; an episode's also on its conversation,
        plus the environment's return (component ``env``)."""
        if rows.episodes is None:
            return self.reward(rows.texts, recs, rows.batch.completion_mask.sum(1).cpu())
        scores = self.final_scores(rows.episodes, recs)
        returns = torch.tensor([sum(e.rewards) for e in rows.episodes], dtype=torch.float32)
        return Scores(scores.total + returns, {"env": returns, **scores.components}, scores.errors, scores.counts)

    def final_scores(self, episodes: list, recs: list[dict] | None = None) -> Scores:
        """The reward functions on each episode's final conversation (its last reply the completion); each
        episode's ``final_reward`` is set to their weighted sum."""
        recs = [e.record for e in episodes] if recs is None else recs
        lengths = torch.tensor([_policy_tokens(e) for e in episodes])
        conversations = [(e.messages[: e.opening], e.messages[e.opening :]) for e in episodes]
        scores = self.reward([e.text for e in episodes], recs, lengths, conversations)
        for e, total in zip(episodes, scores.total.tolist()):
            e.final_reward = total
        return scores

    def _per_rollout(self, rows: Rows) -> dict:
        """Per-rollout lists for the step's metrics (every rank's are gathered)."""
        b = rows.batch
        comp = rows.scores.components
        names = self.reward.names  # the first is the accuracy reward (grpolab.rewards)
        out = {
            "reward": rows.scores.total.tolist(),
            "accuracy": self._accuracy(rows).tolist(),
            **({"format": comp["format"].tolist()} if "format" in comp else {}),
            **{f"reward/{n}": comp[n].tolist() for n in names if n not in ("accuracy", "format")},
            "entropy_sum": _entropy_sums(rows) if rows.entropy is not None and b is not None else [],
            "length": rollout_lengths(rows),
            "truncated": _truncated(rows, self.policy.eos_id),
            "errors": rows.scores.errors,
            "counts": rows.scores.counts,
        }
        if rows.episodes is not None:
            out["reward/env"] = comp["env"].tolist()  # the environment's return
            out.update(episode_facts(rows.episodes))
        return out

    def _accuracy(self, rows: Rows) -> torch.Tensor:
        """``[n]`` each rollout's accuracy: the first reward function's value; for an environment task without
        reward functions, the return as a share of the environment's ``max_return``."""
        names = self.reward.names
        if names:
            return rows.scores.components[names[0]]
        best = torch.tensor([max_return(e.env) for e in rows.episodes], dtype=torch.float32)
        return rows.scores.components["env"] / best

    def _gather(self, local: dict) -> dict:
        """Per-rollout lists of every rank, concatenated in rank order (= prompt order within a call)."""
        return merge_generated(dist_.gather(local, self.world))

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
        generated: dict = {}
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
            whole = self._gather(self._per_rollout(rows))
            generated = merge_generated([generated, whole]) if generated else whole
            rewards = torch.tensor(whole["reward"]).view(n, G)  # [n, G], this round's, every rank's
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
        rows = take_rows(parts, order, self.policy.pad_id)
        generated["zero_std"] = zero_groups / drawn
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
        whole = self._gather(self._per_rollout(pilot))
        pilot_rewards = torch.tensor(whole["reward"]).view(B, n0).tolist()
        sizes = allocate_group_sizes(pilot_rewards, B * G, s.max_group_size or 4 * G)
        self.status(f"step {step}: sampling {B * G - B * n0} more rollouts (groups of {min(sizes)}-{max(sizes)})")
        extra, tg2, ts2 = self._generate(step, [(b, recs[b], range(n0, sizes[b])) for b in mine])
        whole_extra = self._gather(self._per_rollout(extra))
        # Every rank's extras in prompt order: prompt b's are the (sizes[b] - n0) after those of prompts < b.
        e_start = offsets([n - n0 for n in sizes])
        rewards = [pilot_rewards[b] + whole_extra["reward"][e_start[b] : e_start[b + 1]] for b in range(B)]
        generated = merge_generated([whole, whole_extra])
        generated["zero_std"] = sum(not varies(r) for r in rewards) / B
        # This rank's rows, group by group: its pilot rows (part 0), then its extra rows (part 1).
        mine_extra = offsets([sizes[b] - n0 for b in mine])
        order = []
        for i, b in enumerate(mine):
            order += [(0, i * n0 + g) for g in range(n0)] + [(1, mine_extra[i] + g) for g in range(sizes[b] - n0)]
        rows = take_rows([pilot, extra], order, self.policy.pad_id)
        groups = Groups(list(mine), [recs[b] for b in mine], [sizes[b] for b in mine], rows)
        return StepRollouts(groups, list(range(B)), rewards, generated, 2, False, tg1 + tg2, ts1 + ts2)
