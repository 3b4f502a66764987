"""The sampling stage: where a run's rollouts come from, built from the run's resolved config.

It owns the rollout engine (in this process, in a generator process or on generator workers: one
:func:`grpolab.rollout.placement.build_engine` from one :class:`grpolab.rollout.spec.EngineSpec`), the rollout service
every rollout of the run is drawn through (training's, evaluation's, rtg-mc's branches), the collector of a step's
rollouts, --group-size-control's controller, and the weight versions --max-staleness holds. It carries across a
resume the controller's state and the held and pending weights (:meth:`SamplingStage.state_dict`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpolab.common.distributed import World
from grpolab.common.precision import Precision
from grpolab.config.train import TrainConfig
from grpolab.env.credit import mc_values
from grpolab.models.policy import Policy
from grpolab.rollout.collect import Collector, CollectSettings
from grpolab.rollout.engine import EngineSpec, RolloutEngine
from grpolab.rollout.placement import build_engine
from grpolab.rollout.service import RolloutService
from grpolab.training.group_size import GroupSizeControl
from grpolab.training.task_stage import TaskStage

HELD_WEIGHTS = "stale_weights.safetensors"
"""The file of a checkpoint that keeps --max-staleness's held and pending weight versions."""


def engine_spec(cfg: TrainConfig, policy: Policy, precision: Precision, full_weights, rank: int) -> EngineSpec:
    """The engine the run's options ask for over ``policy``: its rollout dtype (resolved), vLLM's settings, where it
    draws, and grpolab's sampler computing as the trainer does (``fp32_head``; ``autocast`` when it samples in the
    trainer's compute dtype under a mixed precision)."""
    same = cfg.engine.rollout_dtype == str(precision.compute_dtype).removeprefix("torch.")
    return EngineSpec.of(
        cfg.engine, cfg.run.seed, policy, full_weights, fp32_head=precision.head_fp32,
        autocast=precision.mixed and same, run=Path(cfg.run.out).name, rank=rank,
    )  # fmt: skip


class SamplingStage:
    """The engine, the service and the collector of a run on ``policy``, scoring with ``task``'s reward and
    environment. ``full_weights``: the context in which the policy's weights are whole (FSDP). ``engine``: an engine
    object in place of the one the options name (the tests' scripted ones). ``status``: told what is being drawn. Of
    the run's resolved config it reads the sections ``engine``, ``groups`` and ``generation``, ``objective.branches``
    (rtg-mc's continuations) and ``run`` (the seed, the run's id)."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: Policy,
        precision: Precision,
        full_weights,
        task: TaskStage,
        world: World,
        log=print,
        status: Callable[[str], None] = lambda text: None,
        engine: RolloutEngine | None = None,
    ):
        self.cfg, self.world, self.status = cfg, world, status
        log(f"rollouts sampled in {cfg.engine.rollout_dtype}, engine correction {cfg.objective.engine_correction}")
        t0 = time.perf_counter()
        if engine is None:
            # every rank's workers are its own: under torchrun each rank says what happens to them, by rank
            say = log if not world.distributed else lambda s: print(f"[rank {world.rank}] {s}", flush=True)
            engine = build_engine(engine_spec(cfg, policy, precision, full_weights, world.rank), policy.model, say)
            if cfg.engine.rollout_engine != "hf":
                mode = "compiled" if cfg.engine.vllm_compile else "eager"
                log(
                    f"rollout engine: {cfg.engine.rollout_engine} ({mode}), started in {time.perf_counter() - t0:.0f} s"
                )
        self.engine = engine
        self.service = RolloutService(engine, policy, task.reward, task.env)
        settings = CollectSettings.of(cfg.groups, cfg.generation, cfg.run.seed)
        self.collector = Collector(self.service, task.sampler, settings, world, status=status)
        self.control = GroupSizeControl(cfg.groups, world) if cfg.groups.group_size_control == "rank" else None
        """--group-size-control rank's controller; None: every step B prompts x G."""

    def collect(self, step: int):
        """Step ``step``'s rollouts (episodes) and their rewards (:meth:`grpolab.rollout.collect.Collector.collect`),
        at the controller's group size; with --max-staleness, the next step's drawn during the update."""
        if self.control is not None:
            self.collector.settings = self.control.settings(self.collector.settings)
        roll = self.collector.collect(step)
        if self.cfg.engine.max_staleness:  # a generator process draws the next step's rollouts during the update
            self.collector.prefetch(step + 1)
        return roll

    def weights_version(self) -> int | None:
        """--max-staleness: the weight sync whose weights the next draw uses (None: the current ones)."""
        return self.service.weights_version()

    def weights_changed(self) -> None:
        """The policy was updated: the engine takes the new weights (or holds them, --max-staleness)."""
        self.service.weights_changed()

    def mc_values(self, rows, sizes: list[int]) -> list[torch.Tensor]:
        """rtg-mc's state values of this rank's groups, from --branches continuations drawn by the service."""
        branches, settings = self.cfg.objective.branches, self.collector.settings.sampling
        return mc_values(self.service, rows, sizes, branches, settings, status=self.status)

    def engine_books(self, result) -> None:
        """What an engine that keeps books of its own adds to a step (generator workers): its metrics
        (``generators/*``) and its timeline (draws, broadcasts, joins, losses: ``result.engine_events``)."""
        metrics, events = getattr(self.engine, "pop_metrics", None), getattr(self.engine, "pop_events", None)
        if metrics is not None:
            result.metrics.update(metrics())
        if events is not None:
            result.engine_events = events()

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """The controller's G (``rank_control``), and under --max-staleness the held and pending weight versions:
        their counts (``stale_weights``) and their tensors under ``files`` (a safetensors file of their own)."""
        state = self.control.state_dict() if self.control is not None else {}
        if self.cfg.engine.max_staleness:  # the weights of the steps in flight: a resume draws with them
            state["stale_weights"], tensors = self.engine.held_state()
            state["files"] = {HELD_WEIGHTS: tensors}
        return state

    def load_state_dict(self, state: dict, read: Callable[[str], dict]) -> None:
        """:meth:`state_dict`'s keys where the checkpoint has them; ``read(name)``: a tensor file of the checkpoint."""
        if self.control is not None:
            self.control.load_state_dict(state)
        if self.cfg.engine.max_staleness and "stale_weights" in state:
            self.engine.restore_held(state["stale_weights"], read(HELD_WEIGHTS))

    def close(self) -> None:
        """Stop what the service owns (the engine's process or workers, the tool worker, the reward's sandbox)."""
        self.service.close()
