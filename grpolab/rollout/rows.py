"""The rollouts a step holds: :class:`Rows` (texts and scores per rollout, token rows for the update), how
several sampling calls' rows are put together (:func:`take_rows`), and the per-rollout facts the metrics read.

A single-turn rollout is one token row. An episode of an environment is one row, or one per sequence when it has
several (``grpolab.rollout.episodes``); an episode's rows are contiguous, in episode order.
"""

from __future__ import annotations

import dataclasses

import torch

from grpolab.algo.groups import offsets
from grpolab.common.batch import Batch, select
from grpolab.rewards.rewarder import Scores
from grpolab.rollout.episodes import episode_rows, policy_tokens


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
    """``[n]`` the rollouts' :class:`grpolab.rollout.episodes.Episode` (environment tasks); None: single-turn rollouts."""
    action: torch.Tensor | None = None
    """``[m, T]`` (episodes) 1 on the policy's own tokens, 0 on the environment's and on padding."""
    turn: torch.Tensor | None = None
    """``[m, T]`` (episodes) the turn of each of the policy's tokens, -1 elsewhere."""
    row_counts: list[int] | None = None
    """``[n]`` (episodes) token rows of each rollout."""
    final: torch.Tensor | None = None
    """``[n]`` (episodes) each episode's final reward: the reward functions' weighted sum on its final conversation,
    a reward of its last turn (``grpolab.env.credit.turn_rewards``)."""

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
    skipped = {k for p in parts for k in p.skipped}
    return Scores(
        torch.cat([p.total for p in parts]),
        {k: torch.cat([p.components[k] for p in parts]) for k in names},
        sum(p.errors for p in parts),
        sum_counts([p.counts for p in parts]),
        {k: torch.cat([p.skipped.get(k, torch.zeros(len(p.total), dtype=torch.bool)) for p in parts]) for k in skipped},
        [e for p in parts for e in (p.extra or [{}] * len(p.total))] if any(p.extra for p in parts) else [],
        merge_logged([p.logged for p in parts]),
        None
        if all(p.unscorable is None for p in parts)
        else torch.cat(
            [torch.zeros(len(p.total), dtype=torch.bool) if p.unscorable is None else p.unscorable for p in parts]
        ),  # fmt: skip
    )


def merge_logged(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Scalars reward functions logged (TRL's ``log_metric``) in several calls or ranks, each name's values joined in
    order."""
    return {k: [v for logged in parts for v in logged.get(k, [])] for k in dict.fromkeys(k for p in parts for k in p)}


def sum_counts(parts: list[dict]) -> dict:
    """What reward functions counted, summed key by key."""
    out: dict = {}
    for counts in parts:
        for k, v in counts.items():
            out[k] = out.get(k, 0) + v
    return out


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
        None if episodes is None else torch.zeros(0),
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
        scores.pick(picked)._replace(counts={}, logged={}),
        _token_values(parts, "entropy", idx, T, width),
        _token_values(parts, "logprobs", idx, T, width),
        None if episodes is None else [episodes[int(i)] for i in picked],
        _token_values(parts, "action", idx, T, width),
        _token_values(parts, "turn", idx, T, width),
        None if episodes is None else [parts[i].counts[k] for i, k in order],
        None if episodes is None else torch.cat([p.final for p in parts])[picked],
    )


def rollout_lengths(rows: Rows) -> list[int]:
    """Each rollout's length: its completion's tokens, or the policy's tokens over an episode."""
    if rows.batch is None:
        return []
    if rows.episodes is None:
        return rows.batch.completion_mask.sum(1).tolist()
    return [policy_tokens(e) for e in rows.episodes]


def sequence_tokens(rows: Rows) -> list[int]:
    """Each rollout's tokens, prompt and completion (an episode's: its whole conversation), as TRL counts the input
    tokens it has seen (``num_tokens``); empty without a batch."""
    if rows.batch is None:
        return []
    return (rows.batch.prompt_mask.sum(1) + rows.batch.completion_mask.sum(1)).tolist()


def truncated_flags(rows: Rows, eos_id: int) -> list[bool]:
    """Each rollout: cut at the token limit (no end-of-sequence token), or an episode cut by a limit."""
    if rows.batch is None:
        return []
    if rows.episodes is None:
        return (~(rows.batch.completion_ids == eos_id).any(dim=1)).tolist()  # no EOS in budget
    return [e.cut for e in rows.episodes]


def entropy_sums(rows: Rows) -> list[float]:
    """Each rollout's sum of the sampler's entropies over its (policy) tokens."""
    if rows.episodes is None:
        return rows.entropy.sum(1).tolist()
    per_row = (rows.entropy * rows.action.to(rows.entropy.dtype)).sum(1).tolist()
    start = offsets(rows.counts)
    return [sum(per_row[start[i] : start[i + 1]]) for i in range(rows.n)]


def episode_rows_of(episodes: list, multi_turn: bool, pad_id: int, device) -> Rows:
    """The :class:`Rows` of played episodes (scores still to come)."""
    rows = episode_rows(episodes, pad_id, device)
    texts = [e.text for e in episodes]
    empty = Scores(torch.zeros(0), {}, 0)
    if not multi_turn:  # single-turn rollouts: a row each, the completion mask is the policy's tokens
        return Rows(rows.batch, texts, empty, rows.entropy, rows.logprobs)
    return Rows(rows.batch, texts, empty, rows.entropy, rows.logprobs, episodes, rows.action, rows.turn, rows.rows)
