"""What every gradient probe command (``rank``, ``mse``, ``groupsize``) is configured with.

Each probe samples rollouts of the policy it measures and scores them as training does (the same
engine path and the run's own reward functions); for a run, its own values (its config.json) are the defaults
of the options marked as the run's, else training's defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from grpolab.config import fields
from grpolab.config.fields import FROM_RUN
from grpolab.config.rollout import RewardSection


@fields.sectioned
class ProbeConfig:
    """Options shared by the probes: how their rollouts are sampled and rewarded, and where they run. For a run, its
    own sampling and reward options are the defaults."""

    max_new_tokens: int = dataclasses.field(default=48, metadata=FROM_RUN)
    """Longest completion (a run: its own)."""
    temperature: float = dataclasses.field(default=1.0, metadata=FROM_RUN)
    """Sampling temperature (a run: its own --temperature)."""
    reward: RewardSection = dataclasses.field(default=RewardSection(), metadata=FROM_RUN)
    probe_split: Literal["held-out", "train"] = "held-out"
    """Which prompts of a run's data file are probed: 'held-out' (its --eval-data, or the split it held out) or
    'train' (its training records); the first --prompts of them. The built-in task: its fixed probe set."""
    data: str = dataclasses.field(default="", metadata=fields.takes_object("data", "data"))
    """A data file (any form --data takes) whose first --prompts records are the probe prompts: for a bare model, or
    instead of a run's own data."""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What samples the probe's rollouts: 'hf' (grpolab's sampler) or 'vllm'. The gradients always come from the
    transformers model; the rank probe's entropy selection, without vLLM entropies, from one forward."""
    include: str = ""
    """Regex restricting psi to matching parameter names (e.g. 'layers\\.0\\.'); empty = all."""
    seed: int = 0
    """Seed of the probe's rollouts (and of its Monte Carlo draws)."""
    threads: int = 1
    """Torch intra-op threads."""
    nproc: int = 1
    """Processes on this machine: > 1 relaunches under torchrun, each rank measuring a block of the prompts
    (results equal to one process's). Ignored inside a torchrun launch."""
    progress: bool = True
    """Show a progress bar."""
