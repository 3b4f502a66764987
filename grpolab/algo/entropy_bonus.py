"""An entropy bonus in the loss, with a fixed or an adaptive coefficient.

The loss becomes ``L - c * H``, H the mean entropy of pi(. | q, o_<t) over the step's loss-carrying tokens (a
token mean over the whole step, every rank: micro-batches and processes add up to it). With the adaptive rule of
Skywork-OR1 as TRL implements it (``use_adaptive_entropy``), the coefficient applied at an optimizer step is c
only if the entropy measured at the previous optimizer step was at or below a target (0 before any measurement),
and after each optimizer step c moves by delta towards more bonus when that step's entropy was at or below the
target, towards less otherwise, within [c_min, c_max].
"""

from __future__ import annotations

import dataclasses
import math

import torch


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """sum over ``mask``'s tokens of ``entropy`` ``[N, T]``, over ``num_tokens`` (the whole step's count): this
    pass's share of the step's mean entropy H."""
    return (entropy * mask.to(entropy.dtype)).sum() / max(num_tokens, 1.0)


@dataclasses.dataclass
class EntropyControl:
    """The coefficient of the bonus and, when ``adaptive``, its schedule (the state a checkpoint keeps)."""

    coef: float
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    last_entropy: float = math.inf
    """The mean entropy at the last optimizer step (inf before the first)."""

    def applied(self) -> float:
        """The coefficient of this optimizer step: c, or (adaptive) c only while the last entropy is <= target."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy: float) -> None:
        """After an optimizer step whose mean entropy was ``entropy``: the adaptive rule's move of c."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy
