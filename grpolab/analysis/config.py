"""What every gradient probe command (``rank``, ``mse``, ``groupsize``) is configured with.

Each probe samples rollouts of the policy it measures and scores them as training does (the same
engine path and the run's own reward functions); unset (None, empty) options take the measured
run's values (its config.json), else training's defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass
class ProbeConfig:
    """Options shared by the probes: how their rollouts are sampled and rewarded, and where they run."""

    max_new_tokens: int | None = None
    """Longest completion (default: the run's, else 48)."""
    temperature: float | None = None
    """Sampling temperature (default: the run's --temperature, else 1)."""
    format_weight: float | None = None
    """lambda in the reward r = accuracy + lambda * format (default: the run's, else training's default for the
    model)."""
    probe_split: Literal["held-out", "train"] = "held-out"
    """Which prompts of a run's data file are probed: 'held-out' (its --eval-data, or the split it held out) or
    'train' (its training records); the first --prompts of them. The built-in task: its fixed probe set."""
    data: str = ""
    """A data file (any form --data takes) whose first --prompts records are the probe prompts: for a bare model, or
    instead of a run's own data."""
    reward_fn: tuple[str, ...] = ()
    """Reward functions (module:function or file.py:function, as --reward-fn in training; default: the run's, else
    the built-in answer check)."""
    reward_weights: tuple[float, ...] = ()
    """Weights of --reward-fn (default: the run's, else 1 each)."""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What samples the probe's rollouts: 'hf' (grpolab's sampler) or 'vllm'. The gradients always come from the
    transformers model; the rank probe's entropy selection, without vLLM entropies, from one forward."""
    include: str = ""
    """Regex restricting psi to matching parameter names (e.g. 'layers\\.0\\.'); empty = all."""
    overlong_buffer: int | None = None
    """DAPO's length penalty in the reward, as --overlong-buffer in training (default: the run's, else 0)."""
    overlong_penalty: float | None = None
    """The largest overlong penalty (default: the run's, else 1)."""
    seed: int = 0
    """Seed of the probe's rollouts (and of its Monte Carlo draws)."""
    threads: int = 1
    """Torch intra-op threads."""
    nproc: int = 1
    """Processes on this machine: > 1 relaunches under torchrun, each rank measuring a block of the prompts
    (results equal to one process's). Ignored inside a torchrun launch."""
    progress: bool = True
    """Show a progress bar."""
