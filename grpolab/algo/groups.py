"""Group layout: where each group's rollouts sit in a flat list of rows, and whether its rewards vary.

A step's rollouts are stored group after group: group k holds rows ``offsets[k] : offsets[k + 1]``.
Groups may differ in size (``--sampling adaptive``). A group whose rewards are all equal has every
group-baseline advantage exactly 0: it carries no gradient (``--sampling filter`` drops it, the
probes skip it, the metrics count it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def offsets(sizes: Sequence[int]) -> list[int]:
    """``[0, n_0, n_0 + n_1, ..., N]``: group k's rows are ``offsets[k] : offsets[k + 1]``."""
    return [0, *itertools.accumulate(sizes)]


def common_size(sizes: Sequence[int]) -> int | None:
    """G when every group has G rollouts, else None (ragged groups, or none)."""
    return sizes[0] if sizes and all(n == sizes[0] for n in sizes) else None


def varies(rewards: Sequence[float]) -> bool:
    """Whether one group's rewards are not all equal (the group carries a group-baseline gradient)."""
    return any(r != rewards[0] for r in rewards)


def has_variance(rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool for rewards ``[B, G]``: True where the group's rewards are not all equal."""
    return (rewards != rewards[:, :1]).any(dim=1)
