"""Seeding and threads."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """One seed drives Python, NumPy and torch (weight init, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_threads(threads: int) -> int:
    """Use ``threads`` intra-op threads (0 keeps torch's default). Returns the number in use.

    For the small models grpolab trains on a CPU one thread is fastest: the
    per-op work is too small to split, and OpenMP's spinning workers fight any
    other process for the cores (the CLI sets ``OMP_WAIT_POLICY=PASSIVE``).
    """
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def git_revision() -> str | None:
    """The code version: the git commit of the package's checkout, if it is one."""
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def percentile_interval(values, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap replicates: the sorted values at
    ``(1 - level) / 2`` and ``(1 + level) / 2`` of the way through (lower index)."""
    v = sorted(values)
    n = len(v) - 1
    return v[int((1 - level) / 2 * n)], v[int((1 + level) / 2 * n)]


def rng_untouched(device: torch.device | str):
    """A context in which torch's random state (CPU and ``device``'s) is saved and restored, so that a forward done
    only to look (with dropout on, it draws) leaves the run's later draws as they were."""
    device = torch.device(device)
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type)
