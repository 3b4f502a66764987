"""Seeding and threads."""

from __future__ import annotations

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


def rng_untouched(device: torch.device | str):
    """A context in which torch's random state (CPU and ``device``'s) is saved and restored, so that a forward done
    only to look (with dropout on, it draws) leaves the run's later draws as they were."""
    device = torch.device(device)
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type)


def rng_state() -> dict:
    """Python's, numpy's and torch's global random states as tensors and plain values (loadable without pickle)."""
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "name": name,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(rng: dict) -> None:
    """Restore :func:`rng_state` (or the tuples of a checkpoint written before it)."""
    python, numpy_state = rng["python"], rng["numpy"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if isinstance(numpy_state, dict):
        k = numpy_state
        numpy_state = (k["name"], k["key"].numpy().astype(np.uint32), k["pos"], k["has_gauss"], k["cached_gaussian"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(rng["torch"])
