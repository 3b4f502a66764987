"""What a training run settles before anything is built: its config, complete, checked and resolved once into the
frozen config every stage reads (and config.json records), and the process's random state and threads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from grpolab.common.given import NOTHING, Given
from grpolab.config import fields
from grpolab.config.task import DataSection
from grpolab.config.train import RESOLVED_AT_START, TrainConfig
from grpolab.env import resolved_data

if TYPE_CHECKING:
    from grpolab.common.distributed import World
    from grpolab.common.precision import Precision


def checked_config(cfg: TrainConfig, world_size: int = 1, given: Given = NOTHING) -> TrainConfig:
    """``cfg`` as a run uses it: the model's defaults filled in (``MODEL_DEFAULTS``), ``--format auto`` resolved
    from the data (``given``: rows given to the Python API; what config.json records), validated for
    ``world_size`` processes."""
    cfg = cfg.resolved()
    cfg = dataclasses.replace(cfg, dataset=resolved_data(cfg.dataset, cfg.episodes, given))
    cfg.validate()
    cfg.validate_world(world_size)
    return cfg


def resolve_options(
    cfg: TrainConfig, local_rank: int = 0, given: Given = NOTHING, engine_given: bool = False
) -> TrainConfig:
    """The options a checked config leaves to be settled where the run starts (``RESOLVED_AT_START``): ``--precision
    auto`` for the device and model (a choice the device cannot run refused), ``--rollout-dtype auto`` (the
    precision's compute dtype) and ``--engine-correction auto`` (none where the engine computes exactly what the
    trainer computes). Every stage reads them from the returned config, which config.json records as it is; a resumed
    run has taken its own first (:meth:`TrainConfig.continuing`). ``local_rank``: this process's on its node (its
    device). ``engine_given``: a rollout engine object replaces --rollout-engine's (the tests' scripted ones), taken
    as exact."""
    import torch  # not before a --nproc relaunch

    from grpolab.algo.engine_correction import resolve_correction
    from grpolab.common.devices import resolve_device
    from grpolab.common.precision import machine_precision, rollout_dtype

    device = resolve_device(cfg.machine.device, local_rank)
    precision = machine_precision(cfg.machine, device, cfg.policy.model, given)
    dtype = rollout_dtype(cfg.engine.rollout_dtype, precision.compute_dtype)
    # The hf engine is exact in the trainer's own dtype when the trainer computes in it (not under autocast) and that
    # dtype is fp32 or fp64: two bf16 kernels differ by bf16's rounding (docs/precision.md measures it). With
    # --max-staleness K >= 1 the engine draws with older weights, a mismatch the correction weighs.
    wide = dtype in (torch.float32, torch.float64)
    own = dtype == weights_dtype(cfg, precision) and not precision.mixed and wide
    exact = (engine_given or (cfg.engine.rollout_engine == "hf" and own)) and not cfg.engine.max_staleness
    correction = resolve_correction(cfg.objective.engine_correction, exact, cfg.terms.loss_type)
    return cfg.replace(
        precision=precision.name, rollout_dtype=str(dtype).removeprefix("torch."), engine_correction=correction
    )


def resolve_config(
    cfg: TrainConfig, world: World | None = None, given: Given = NOTHING, engine_given: bool = False
) -> TrainConfig:
    """``cfg`` checked (:func:`checked_config`) and its start-time options resolved (:func:`resolve_options`): the one
    frozen config a trainer is built from."""
    size, local_rank = (1, 0) if world is None else (world.size, world.local_rank)
    return resolve_options(checked_config(cfg, size, given), local_rank, given, engine_given)


def is_resolved(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` has been through :func:`resolve_options` (none of ``RESOLVED_AT_START`` left on auto)."""
    return all(fields.get(cfg, key) != "auto" for key in RESOLVED_AT_START)


def run_precision(cfg: TrainConfig) -> Precision:
    """The resolved config's precision as the stages use it (--precision, --compensation, --fp32-head; the --dtype
    alias folded in)."""
    from grpolab.common.precision import Precision

    machine = cfg.machine.folded()
    if machine.precision == "auto":
        raise ValueError("run_precision takes a resolved config (resolve_options)")
    return Precision(machine.precision, machine.compensation, machine.fp32_head)


def weights_dtype(cfg: TrainConfig, precision: Precision):
    """The dtype the policy is loaded in: the precision's, except that a LoRA run under bf16-mixed holds its frozen
    base in bf16 (the products compute in bf16 anyway; the fp32 adapters are the masters that train)."""
    if cfg.policy.lora_rank and precision.name == "bf16-mixed":
        return precision.compute_dtype
    return precision.param_dtype


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
