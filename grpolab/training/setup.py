"""What a training run settles before anything is built: its config, complete and checked, and the process's
random state and threads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from grpolab.common.given import NOTHING, Given
from grpolab.config.task import DataSection
from grpolab.config.train import TrainConfig
from grpolab.env import resolved_data


def checked_config(cfg: TrainConfig, world_size: int = 1, given: Given = NOTHING) -> TrainConfig:
    """``cfg`` as a run uses it: the model's defaults filled in (``MODEL_DEFAULTS``), ``--format auto`` resolved
    from the data (``given``: rows given to the Python API; what config.json records), validated for
    ``world_size`` processes."""
    cfg = cfg.resolved()
    cfg = dataclasses.replace(cfg, dataset=resolved_data(cfg.dataset, cfg.episodes, given))
    cfg.validate()
    cfg.validate_world(world_size)
    return cfg


def seed_process(cfg: TrainConfig) -> None:
    """One seed drives Python, NumPy and torch in this process; torch runs on --threads intra-op threads."""
    from grpolab.common.rng import seed_everything, set_threads  # torch: not before a --nproc relaunch

    set_threads(cfg.machine.threads)
    seed_everything(cfg.run.seed)


def hub_sources(data: DataSection, model_origin: dict | None, reward_models: Sequence[dict] = ()) -> dict:
    """What config.json records of the Hub repositories a run reads: ``{"model"|"data"|"eval_data": {"id",
    "revision", "commit"}}`` for each one given by its Hub id (``model_origin``: the loaded policy's), and
    ``"reward_model"``: a list of those of its reward models given by their Hub id (``reward_models``)."""
    from grpolab.common.hub import is_hub_id
    from grpolab.data.dataset import hub_snapshot

    out = {"model": model_origin} if model_origin else {}
    if reward_models:
        out["reward_model"] = list(reward_models)
    for name, spec, held_out in (("data", data.data, False), ("eval_data", data.eval_data, True)):
        if spec and is_hub_id(spec):
            out[name] = hub_snapshot(spec, data.source(held_out)).record()
    return out
