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
    media: tuple | None = None
    """``[N]`` each row's images as its model takes them (a ``grpolab.vision.media.Media``, or None for a row without
    any); None for a batch of text rows. A group's rows hold the same object."""

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four token tensors (without ``media``)."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask

    def to(self, device) -> Batch:
        """The batch with its tensors (the media's too) on ``device``."""
        media = None if self.media is None else tuple(m if m is None else m.to(device) for m in self.media)
        return Batch(*(t.to(device) for t in self.tensors), media)

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` with their padding kept (unlike :func:`select`, which trims it)."""
        media = None if self.media is None else self.media[start:stop]
        return Batch(*(t[start:stop] for t in self.tensors), media)


def select(batch: Batch, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` of a batch, with all-padding columns trimmed (left of prompts, right of completions)."""
    pm, cm = batch.prompt_mask[idx], batch.completion_mask[idx]
    first = int((pm.sum(0) > 0).nonzero().min()) if pm.any() else pm.shape[1]
    last = int((cm.sum(0) > 0).nonzero().max()) + 1 if cm.any() else 1
    media = None if batch.media is None else tuple(batch.media[i] for i in idx.tolist())
    return Batch(batch.prompt_ids[idx, first:], pm[:, first:], batch.completion_ids[idx, :last], cm[:, :last], media)


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
