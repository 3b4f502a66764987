"""The GRPO trainer: the step around three stages, reading collect -> advantages -> update -> record.

Each stage owns its parts and what it carries across a resume, and is built from the run's resolved config
(:func:`grpolab.training.setup.resolve_config`): the update stage (``grpolab.training.update_stage``: the policy, the
KL reference, the optimizer, the schedule and the update), the task stage (``grpolab.training.task_stage``: rewards,
data, environment) and the sampling stage (``grpolab.training.sampling_stage``: the engine, the rollout service, the
collector, group-size control). The step's credit is ``grpolab.training.credit``, its books
``grpolab.training.books``; the probes, the token-credit records and the rollout logs watch the step
(``grpolab.training.observers``, attached by the run); checkpoints are ``grpolab.training.checkpoints``. The run
around the steps is ``grpolab.training.recipe``.

On P processes (torchrun) each rank takes a contiguous block of the step's prompts with all
their rollouts (a group never spans ranks, so its baseline needs no communication); rollout
(b, g) draws from the stream keyed by the *global* prompt index b, so the rollouts do not
depend on P. Losses use the whole step's normalisers and gradients are summed over ranks
(grpolab.training.forward), so the update is the single-process update. Metrics are computed from the
gathered per-rollout values, identically on every rank; rank 0 alone writes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpolab.common.devices import resolve_device
from grpolab.common.distributed import SINGLE, World
from grpolab.common.given import NOTHING, Given
from grpolab.config.train import TrainConfig
from grpolab.eval.accuracy import evaluate, format_accuracy
from grpolab.rollout.engine import RolloutEngine, SamplingSettings
from grpolab.training import checkpoints
from grpolab.training.books import step_metrics
from grpolab.training.credit import cut_rows, loss_advantages, step_advantages
from grpolab.training.hacking import honeypot_metrics
from grpolab.training.sampling_stage import SamplingStage
from grpolab.training.setup import is_resolved
from grpolab.training.step import StepObserver, StepResult
from grpolab.training.task_stage import TaskStage
from grpolab.training.update_stage import UpdateStage


def staleness_metrics(step: int, weights_version: int | None) -> dict:
    """``async/staleness_*`` of a step whose rollouts were all drawn with the weights of sync ``weights_version``
    (None: with the current ones, nothing to log): the optimizer steps between those and the weights the update starts
    from."""
    if weights_version is None:
        return {}
    staleness = step - 1 - weights_version
    return {"async/staleness_mean": float(staleness), "async/staleness_max": staleness}


class GRPOTrainer:
    """One run's stages and :meth:`step`, one GRPO step over them.

    ``cfg``: the run's resolved config (:func:`grpolab.training.setup.resolve_config`; :func:`grpolab.training.recipe.
    build_trainer` resolves it), which no stage rewrites; the process's seed and threads are the run's to set before
    (:func:`grpolab.training.setup.seed_process`). ``weights_from``: a checkpoint whose weights replace --model's (a
    resumed run's). ``adapter_from``: a LoRA checkpoint to resume the adapter from.
    ``reference``: the KL reference when it is not the starting weights (a resumed run's start). ``engine``: a rollout
    engine instead of the one --rollout-engine names. ``status``: told what the step is doing (a progress bar's status
    line). ``given``: Python objects given to the API in place of what options name
    (:class:`grpolab.common.given.Given`). ``observers`` watch each step (:class:`grpolab.training.step.StepObserver`).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        log=print,
        adapter_from: str | Path | None = None,
        world: World = SINGLE,
        reference: torch.nn.Module | None = None,
        engine: RolloutEngine | None = None,
        status: Callable[[str], None] = lambda text: None,
        given: Given = NOTHING,
        weights_from: str | Path | None = None,
    ):
        if not is_resolved(cfg):
            raise ValueError("GRPOTrainer takes a resolved config: build it with build_trainer, or resolve_config")
        self.cfg, self.log, self.world, self.status = cfg, log, world, status
        self.device = resolve_device(cfg.machine.device, world.local_rank)
        self.observers: list[StepObserver] = []
        self.rollouts_total = 0  # rollouts generated since step 1 (restored on resume)
        # In this order: the policy before the task (--few-shot examples go into its prompts); the rollout engine
        # samples the policy as it is then.
        self.update_stage = UpdateStage(cfg, self.device, world, given, log, adapter_from, reference, weights_from)
        self.policy = self.update_stage.policy
        self.task_stage = TaskStage(cfg, self.policy, given, log)
        self.sampling_stage = SamplingStage(
            cfg, self.policy, self.update_stage.precision, self.update_stage.train_module.full_weights,
            self.task_stage, world, log, status, engine,
        )  # fmt: skip

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepResult:
        """collect -> advantages -> update -> record."""
        t_step, sampling, task = time.perf_counter(), self.sampling_stage, self.task_stage
        # 1-2. rollouts (episodes) and their rewards; --sampling decides how many of which prompts
        weights_version = sampling.weights_version()  # --max-staleness: the sync whose weights draw this step
        roll = sampling.collect(step)
        t_collected = time.perf_counter()
        # 3. advantages: one per rollout [Foundations, Thm 3.1], or per turn of an episode (--advantage)
        adv = step_advantages(
            roll, self.cfg.objective, self.device, sampling.mc_values, task.reward.weights, self.world
        )
        result = StepResult(step, roll, adv, weights_version=weights_version)
        for observer in self.observers:  # the policy that sampled
            observer.before_update(result)
        # 4. loss and update (the watched rollouts' per-token values kept for the observers)
        self.status(f"step {step}: update ({self.cfg.objective.mu} x {roll.groups.rows.n} rollouts)")
        result.watch = next((w for o in self.observers if (w := o.watch(result)) is not None), None)
        result.update = self._update(result)
        for observer in self.observers:
            observer.after_update(result)
        t_sync = time.perf_counter()
        sampling.weights_changed()  # the vllm engine takes the new weights here
        t_end = time.perf_counter()
        # 5. the books
        self.rollouts_total += roll.generated.n
        times = {
            "time/generate_s": roll.time_generate,
            "time/score_s": roll.time_score,
            "time/update_s": t_sync - t_collected,
            "time/sync_s": t_end - t_sync,
            "time/step_s": t_end - t_step,
        }
        if sampling.service.multi_turn:
            times["time/env_s"] = sampling.service.pop_env_time()
        result.metrics = {**step_metrics(roll, self.rollouts_total, result.update, times), **result.metrics}
        result.metrics.update(staleness_metrics(step, weights_version))
        sampling.engine_books(result)
        if sampling.control is not None:
            sampling.control.after_step(step, result.metrics)
        return result

    def _update(self, result: StepResult) -> dict:
        """--mu passes of --minibatches optimizer steps on this rank's rows (``grpolab.training.update``); a step with
        no group to learn from (--sampling filter, every round all-equal) only moves the schedule on."""
        roll, updater = result.collected, self.update_stage.updater
        if not roll.rewards:
            return updater.skip()
        rows = roll.groups.rows
        watch = None if result.watch is None else rows.rows_of(result.watch)
        adv = loss_advantages(roll, result.advantages)
        return updater(rows.batch, adv, rows.entropy, rows.logprobs, watch, rows.action, cut_rows(rows))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """Held-out accuracy at ``step`` (``grpolab.eval.accuracy``), drawn through the run's service; the metrics
        and the first --log-samples examples (then the honeypots' paid completions, kind 'honeypot')."""
        t0, cfg, task, service = time.perf_counter(), self.cfg, self.task_stage, self.sampling_stage.service
        if not task.held_out:  # --data with --eval-fraction 0: no held-out evaluation
            return {}, []
        with self.update_stage.train_module.full_weights(), service.current_weights():
            metrics, examples = evaluate(
                service,
                task.held_out,
                samples=cfg.eval.eval_samples,
                temperature=cfg.generation.temperature,
                max_new_tokens=cfg.generation.max_new_tokens,
                seed=cfg.run.seed,
                batch_size=cfg.eval.eval_batch,
                world=self.world,
                progress=lambda done, total: self.status(f"eval at step {step}: {done}/{total} completions"),
                score=task.eval_reward,
                pass_k=cfg.eval.pass_k,
            )
            shown = examples[: cfg.logging.log_samples]
            if task.honeypots:  # any reward on a question with no answer is a loophole (grpolab.training.hacking)
                caught, paid = self._honeypots(step)
                metrics.update(caught)
                shown += [{"kind": "honeypot", **p} for p in paid]
        metrics["time/eval_s"] = time.perf_counter() - t0
        caught = (
            f"  honeypots paid {metrics['hacking/honeypot_paid']:.3f}" if "hacking/honeypot_paid" in metrics else ""
        )
        self.log(
            f"eval at step {step}: {format_accuracy(metrics)}{caught}  ({len(task.held_out)} questions, "
            f"{cfg.eval.eval_samples} samples each, {metrics['time/eval_s']:.0f} s)"
        )
        return metrics, shown

    def _honeypots(self, step: int) -> tuple[dict, list[dict]]:
        """The training reward on the honeypots (--honeypots), sampled as the held-out questions are."""
        cfg, task, t0 = self.cfg, self.task_stage, time.perf_counter()
        settings = SamplingSettings(cfg.generation.max_new_tokens, cfg.generation.temperature)
        caught, paid = honeypot_metrics(
            self.sampling_stage.service, task.honeypots, max(cfg.eval.eval_samples, 1), settings, cfg.run.seed, step,
            task.reward.names[0], self.world,
        )  # fmt: skip
        return {**caught, "time/honeypot_s": time.perf_counter() - t0}, paid

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The step's own books across a resume (the stages keep theirs: :mod:`grpolab.training.checkpoints`)."""
        return {"seed": self.cfg.run.seed, "world_size": self.world.size, "rollouts_total": self.rollouts_total}

    def load_state_dict(self, state: dict) -> None:
        # Checkpoints written before --sampling existed: every step generated B*G rollouts.
        self.rollouts_total = state.get("rollouts_total", state["step"] * self.cfg.rollouts_per_step)

    def save(self, out: Path, step: int) -> None:
        """Write ``checkpoints/step_N`` of every stage (:func:`grpolab.training.checkpoints.save`)."""
        checkpoints.save(self, out, step)

    def close(self) -> None:
        """Stop what the run started (the engine's process or workers, the tool worker, the sandboxes)."""
        self.sampling_stage.close()
        self.task_stage.close()
