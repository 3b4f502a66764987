"""An update's passes: which rows run, in how many minibatches (one optimizer step each) and forward/backward
passes (within --micro-batch-tokens), padded so that every rank runs as many passes as the busiest."""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpolab.common import distributed as dist_
from grpolab.common.distributed import World


class MicroBatchPlan(NamedTuple):
    """The forward/backward passes of an update."""

    rows: torch.Tensor
    """``[a]`` the rows that run: those that can carry gradient."""
    chunks: list[torch.Tensor]
    """Row indices of each pass; the passes after the first ``real`` are padding passes."""
    real: int
    """Passes over real rows. Padding passes run one row with its loss times 0, so that every rank runs as many
    passes as the busiest one (DDP and FSDP pair up their collectives pass by pass) and adds nothing."""


def rows_advantages(adv: torch.Tensor, idx: torch.Tensor, T: int) -> torch.Tensor:
    """The advantages of rows ``idx``: ``[k]`` of per-row ones, or ``[k, T]`` of per-token ones (cut or padded to
    ``T`` columns, the width of the rows' selected batch)."""
    if adv.dim() == 1:
        return adv[idx]
    a = adv[idx.to(adv.device)]
    return a[:, :T] if a.shape[1] >= T else torch.nn.functional.pad(a, (0, T - a.shape[1]))


def token_budget_chunks(
    rows: torch.Tensor, prompt_lens: torch.Tensor, completion_lens: torch.Tensor, budget: int, packed: bool = False
) -> list[torch.Tensor]:
    """``rows`` in passes of at most ``budget`` tokens each (--micro-batch-tokens).

    A pass over k rows is padded to its longest prompt plus its longest completion (:func:`grpolab.rollout.sampler.select`),
    so it costs k x (max prompt + max completion) tokens; ``packed`` (--packing): the sum of its rows' lengths. Rows
    are taken longest first, so that rows of like length share a pass and little of it is padding, and each is added
    to the current pass while the pass stays within the budget; a row longer than the budget runs alone. The loss's normalisers are the whole step's, so any partition
    gives the whole batch's gradient (to float rounding).
    """
    order = sorted(rows.tolist(), key=lambda r: -int(prompt_lens[r] + completion_lens[r]))
    chunks: list[list[int]] = []
    p_max = c_max = total = 0
    for r in order:
        p_r, c_r = int(prompt_lens[r]), int(completion_lens[r])
        p, c = max(p_max, p_r), max(c_max, c_r)
        cost = total + p_r + c_r if packed else (len(chunks[-1]) + 1 if chunks else 1) * (p + c)
        if chunks and cost <= budget:
            chunks[-1].append(r)
            p_max, c_max, total = p, c, total + p_r + c_r
        else:
            chunks.append([r])
            p_max, c_max, total = p_r, c_r, p_r + c_r
    return [torch.tensor(sorted(c), dtype=torch.long, device=rows.device) for c in chunks]


def minibatch_rows(n: int, M: int, device) -> list[torch.Tensor]:
    """The rows of each of ``M`` minibatches of ``n`` rows: row i in minibatch i mod M, so that each group's rollouts
    (contiguous rows) are spread over the minibatches, G / M of each in each (TRL shuffles the rows instead).
    ``M = 1``: every row, in order."""
    return [torch.arange(m, n, M, device=device) for m in range(M)]


def plan_micro_batches(rows: torch.Tensor, chunks: list[torch.Tensor], world: World) -> MicroBatchPlan:
    """The passes ``chunks`` over ``rows``, padded to the most passes of any rank."""
    real = len(chunks)
    chunks += [torch.zeros(1, dtype=torch.long, device=rows.device)] * (dist_.all_max(real, world) - real)
    return MicroBatchPlan(rows, chunks, real)
