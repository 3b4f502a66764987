"""Token batches: prompts and completions as padded id tensors, and the rows of a batch."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Batch(NamedTuple):
    """Prompts and completions of N rollouts, as token ids."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded after EOS
    completion_mask: torch.Tensor  # [N, T] 1 on generated tokens, EOS included


def select(batch: Batch, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` of a batch, with all-padding columns trimmed (left of prompts, right of completions)."""
    pm, cm = batch.prompt_mask[idx], batch.completion_mask[idx]
    first = int((pm.sum(0) > 0).nonzero().min()) if pm.any() else pm.shape[1]
    last = int((cm.sum(0) > 0).nonzero().max()) + 1 if cm.any() else 1
    return Batch(batch.prompt_ids[idx, first:], pm[:, first:], batch.completion_ids[idx, :last], cm[:, :last])


def left_pad(seqs: list[list[int]], pad_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, P]`` ids and mask with every sequence pushed to the right edge; P is the longest's length, or
    ``width`` if that is more."""
    P = max(width, *(len(s) for s in seqs))
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, P - len(s) :] = 1
    return ids, mask
