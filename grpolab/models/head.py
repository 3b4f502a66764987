"""The LM head's product in fp32 (``--fp32-head``), in a model that otherwise computes in bf16 or fp16.

ScaleRL (fp32 logits in generator and trainer) and MiniMax-M1 (Sec. 3.2: an fp32 LM head raised the train/inference
probability correlation) compute the last product in fp32: the logits of a bf16 product carry bf16's 8 bits of
mantissa, about 0.4% of each logit, before the softmax. Casting the head's *output* to fp32 does not undo that, and
neither does casting its weight: under ``torch.autocast`` an ``nn.Linear`` is cast back to bf16 whatever its weight's
dtype, since ``linear`` is on autocast's list. So :class:`Fp32Head` turns autocast off around the product and runs
it on fp32 inputs and weights (an fp32 master under a mixed precision; a bf16 weight cast up exactly under
bf16-true), and :func:`fp32_head` puts it in the model's place for the time of a forward: transformers' forward and
grpolab's chunked head both call the model's output embedding, and the model's state dict keeps its own names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Fp32Head(nn.Module):
    """``x W^T (+ b)`` of the wrapped linear layer, in fp32 outside autocast: ``[..., d] -> [..., V]`` fp32."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.head, "bias", None)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.head.weight.float(), None if bias is None else bias.float())


@contextlib.contextmanager
def fp32_head(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside: ``model``'s output embedding (its LM head) runs as :class:`Fp32Head`; outside, as before. Nothing
    happens when ``enabled`` is False or the model has no linear head."""
    head = model.get_output_embeddings() if enabled else None
    if head is None or isinstance(head, Fp32Head) or not hasattr(head, "weight"):
        yield
        return
    model.set_output_embeddings(Fp32Head(head))
    try:
        yield
    finally:
        model.set_output_embeddings(head)
