"""What a training run settles before anything is built: its config, complete and checked, and the process's
random state and threads."""

from __future__ import annotations

import dataclasses

from grpolab.common.given import NOTHING, Given
from grpolab.common.rng import seed_everything, set_threads
from grpolab.config.train import TrainConfig
from grpolab.data.task import resolve_format


def checked_config(cfg: TrainConfig, world_size: int = 1, given: Given = NOTHING) -> TrainConfig:
    """``cfg`` as a run uses it: the model's defaults filled in (``MODEL_DEFAULTS``), ``--format auto`` resolved
    from the data (``given``: rows given to the Python API; what config.json records), validated for
    ``world_size`` processes."""
    cfg = cfg.resolved()
    cfg = dataclasses.replace(cfg, dataset=resolve_format(cfg.dataset, bool(cfg.episodes.env), given))
    cfg.validate()
    cfg.validate_world(world_size)
    return cfg


def seed_process(cfg: TrainConfig) -> None:
    """One seed drives Python, NumPy and torch in this process; torch runs on --threads intra-op threads."""
    set_threads(cfg.machine.threads)
    seed_everything(cfg.run.seed)
