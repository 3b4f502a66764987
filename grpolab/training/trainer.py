"""The GRPO trainer: its parts, set up once, and a step that reads collect -> advantages -> update -> record.

Each stage lives where its name says: rollouts are drawn and scored by the rollout service and the collector
(``grpolab.rollout``), the step's credit is ``grpolab.training.credit``, the update ``grpolab.training.update``,
the books ``grpolab.training.books``; the probes, the token-credit records and the rollout logs watch the step
(``grpolab.training.observers``, attached by the run). The run around the steps is ``grpolab.training.recipe``.

On P processes (torchrun) each rank takes a contiguous block of the step's prompts with all
their rollouts (a group never spans ranks, so its baseline needs no communication); rollout
(b, g) draws from the stream keyed by the *global* prompt index b, so the rollouts do not
depend on P. Losses use the whole step's normalisers and gradients are summed over ranks
(grpolab.training.forward), so the update is the single-process update. Metrics are computed from the
gathered per-rollout values, identically on every rank; rank 0 alone writes them.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import get_scheduler

from grpolab.algo.engine_correction import resolve_correction
from grpolab.algo.group_budget import RankControl, rank_control
from grpolab.common import distributed as dist_
from grpolab.common.devices import resolve_device
from grpolab.common.distributed import SINGLE, World
from grpolab.common.given import NOTHING, Given
from grpolab.common.precision import Precision, machine_precision, rollout_dtype
from grpolab.config.train import TrainConfig
from grpolab.data.task import few_shot_examples, task_data
from grpolab.env import environment
from grpolab.env.credit import mc_values
from grpolab.eval.accuracy import evaluate, format_accuracy
from grpolab.models import checkpoint
from grpolab.models.policy import (
    Policy,
    disable_dropout,
    enable_activation_checkpointing,
    load_policy,
    system_prompt_for,
)
from grpolab.rewards.forms import check_columns
from grpolab.rewards.rewarder import close_reward, eval_reward, rewarder_for, start_reward
from grpolab.rollout.collect import Collector, CollectSettings
from grpolab.rollout.engine import RolloutEngine, build_engine, greedy_texts
from grpolab.rollout.service import RolloutService
from grpolab.training.books import step_metrics
from grpolab.training.credit import cut_rows, loss_advantages, step_advantages
from grpolab.training.forward import TrainModule
from grpolab.training.optim import build_optimizer, build_scaler
from grpolab.training.setup import checked_config
from grpolab.training.step import StepObserver, StepResult
from grpolab.training.update import Updater

STALE_WEIGHTS = "stale_weights.safetensors"
"""The file of a checkpoint that keeps --max-staleness's held and pending weights."""


def engine_books(engine, result: StepResult) -> None:
    """What an engine that keeps books of its own adds to a step (generator workers): its metrics
    (``generators/*``) and its timeline (draws, broadcasts, joins, losses: ``result.engine_events``)."""
    metrics, events = getattr(engine, "pop_metrics", None), getattr(engine, "pop_events", None)
    if metrics is not None:
        result.metrics.update(metrics())
    if events is not None:
        result.engine_events = events()


def staleness_metrics(step: int, drawn_with: int | None) -> dict:
    """``async/staleness_*`` of a step whose rollouts were all drawn with the weights of sync ``drawn_with`` (None:
    with the current ones, nothing to log): the optimizer steps between those and the weights the update starts from."""
    if drawn_with is None:
        return {}
    staleness = step - 1 - drawn_with
    return {"async/staleness_mean": float(staleness), "async/staleness_max": staleness}


class GRPOTrainer:
    """One run's policy, KL reference, optimizer and update, its task's data, reward and environment, and the
    rollout service every rollout is drawn through; :meth:`step` runs one GRPO step.

    ``cfg`` is checked here (:func:`grpolab.training.setup.checked_config`); the process's seed and threads are the
    run's to set before (:func:`grpolab.training.setup.seed_process`). ``adapter_from``: a LoRA checkpoint to resume
    the adapter from. ``reference``: the KL reference when it is not the starting weights (a resumed run's start).
    ``engine``: a rollout engine instead of the one --rollout-engine names. ``status``: told what the step is doing
    (a progress bar's status line). ``given``: Python objects given to the API in place of what options name
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
    ):
        self.cfg = checked_config(cfg, world.size, given)
        self.log, self.world, self.status, self.given = log, world, status, given
        self.device = resolve_device(self.cfg.machine.device, world.local_rank)
        self.observers: list[StepObserver] = []
        self.rollouts_total = 0  # rollouts generated since step 1 (restored on resume)
        # --group-size-control rank: this step's G (restored on resume); None: every step B prompts x G
        self.control = RankControl(self.cfg.groups.group_size) if self.cfg.groups.group_size_control == "rank" else None
        # In this order: LoRA wraps the loaded model before any forward is built on it; the optimizer takes the
        # parameters the training forward leaves (FSDP's shards); the data may put solved examples in the prompts;
        # the rollout engine samples the policy as it is then.
        self._setup_policy(adapter_from)
        self._resolve_engine_options(engine)
        self._setup_reference(reference)
        self._setup_optimizer()
        self._setup_task()
        self._setup_rollouts(engine)

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepResult:
        """collect -> advantages -> update -> record."""
        t_step = time.perf_counter()
        self._apply_control()
        # 1-2. rollouts (episodes) and their rewards; --sampling decides how many of which prompts
        drawn_with = self.service.weights_version()  # --max-staleness: the sync whose weights draw this step
        roll = self.collector.collect(step)
        t_collected = time.perf_counter()
        if self.cfg.engine.max_staleness:  # a generator process draws the next step's rollouts during the update
            self.collector.prefetch(step + 1)
        # 3. advantages: one per rollout [Foundations, Thm 3.1], or per turn of an episode (--advantage)
        adv = step_advantages(roll, self.cfg.objective, self.device, self._mc_values, self.reward.weights, self.world)
        result = StepResult(step, roll, adv, weights_version=drawn_with)
        for observer in self.observers:  # the policy that sampled
            observer.before_update(result)
        # 4. loss and update (the watched rollouts' per-token values kept for the observers)
        self.status(f"step {step}: update ({self.cfg.objective.mu} x {roll.groups.rows.n} rollouts)")
        result.watch = next((w for o in self.observers if (w := o.watch(result)) is not None), None)
        result.update = self._update(result)
        for observer in self.observers:
            observer.after_update(result)
        t_sync = time.perf_counter()
        self.service.weights_changed()  # the vllm engine takes the new weights here
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
        if self.service.multi_turn:
            times["time/env_s"] = self.service.pop_env_time()
        result.metrics = {**step_metrics(roll, self.rollouts_total, result.update, times), **result.metrics}
        result.metrics.update(staleness_metrics(step, drawn_with))
        engine_books(self.service.engine, result)
        self._update_control(result)
        return result

    def _apply_control(self) -> None:
        """--group-size-control rank: the controller's G, and the prompts that keep the step's rollout budget."""
        if self.control is not None:
            G = self.control.group_size
            B = self.cfg.groups.rollouts_per_step // G
            self.collector.settings = dataclasses.replace(self.collector.settings, group_size=G, prompts_per_step=B)

    def _update_control(self, result: StepResult) -> None:
        """What this step's probe says about the next step's group size (every rank decides the same: the probe's
        metrics are gathered)."""
        if self.control is None:
            return
        result.metrics["control/group_size"] = self.control.group_size
        groups = self.cfg.groups
        self.control = rank_control(
            self.control,
            result.step,
            result.metrics.get("probe/eff_rank"),
            groups.rollouts_per_step,
            max(2, self.world.size),
            groups.control_patience,
            divisor=self.world.size,
            share=groups.control_share,
        )

    def _update(self, result: StepResult) -> dict:
        """mu optimizer steps on this rank's rows (``grpolab.training.update``); a step with no group to learn from
        (--sampling filter, every round all-equal) only moves the schedule on."""
        roll = result.collected
        if not roll.rewards:
            return self.updater.skip()
        rows = roll.groups.rows
        watch = None if result.watch is None else rows.rows_of(result.watch)
        adv = loss_advantages(roll, result.advantages)
        return self.updater(rows.batch, adv, rows.entropy, rows.logprobs, watch, rows.action, cut_rows(rows))

    def _mc_values(self, rows, sizes: list[int]) -> list[torch.Tensor]:
        """rtg-mc's state values of this rank's groups, from --branches continuations drawn by the service."""
        branches, settings = self.cfg.objective.branches, self.collector.settings.sampling
        return mc_values(self.service, rows, sizes, branches, settings, status=self.status)

    # ------------------------------------------------------------------ set-up
    def _setup_policy(self, adapter_from: str | Path | None) -> None:
        cfg, log = self.cfg, self.log
        t0 = time.perf_counter()
        log(f"loading {cfg.policy.model}{' (' + cfg.policy.gguf_file + ')' if cfg.policy.gguf_file else ''} ...")
        self.precision = self._resolve_precision()
        self.policy: Policy = load_policy(
            cfg.policy.model,
            self._weights_dtype(),
            gguf_file=cfg.policy.gguf_file,
            revision=cfg.policy.revision,
            chat=cfg.prompt.chat,
            device=self.device,
            given=self.given,
        )
        n_params = sum(p.numel() for p in self.policy.model.parameters())
        log(
            f"loaded {self.policy.source}: {n_params / 1e6:.1f} M parameters, {next(self.policy.model.parameters()).dtype}"
            f" on {self.device}, in {time.perf_counter() - t0:.0f} s"
        )
        if cfg.machine.precision == "auto" or self.precision.name != "32-true":
            log(self.precision.describe(self.device))
        self.policy.system = system_prompt_for(cfg.dataset.format, cfg.prompt.system_prompt)
        family = self.policy.family  # a vision-language model's adapter, else None
        if family is not None and not cfg.policy.train_vision_tower:
            log(
                f"{family.name}: the vision tower is frozen ({family.freeze_tower(self.policy.model) / 1e6:.2f} M parameters)"
            )
        if cfg.update.gradient_checkpointing:  # on the base model, before LoRA wraps it (peft then makes inputs
            enable_activation_checkpointing(self.policy.model)  # require grad)
        if cfg.policy.lora_rank:
            from grpolab.models.lora import add_lora, load_lora

            base, lora = self.policy.model, cfg.policy
            alpha = lora.lora_alpha or 2.0 * lora.lora_rank
            if adapter_from:  # a resumed run's adapter: its layers are those its adapter_config.json names
                self.policy.model = load_lora(base, adapter_from)
            else:
                targets = lora.lora_modules if family is None else family.lora_targets(base, lora.lora_modules)
                self.policy.model = add_lora(base, lora.lora_rank, alpha, lora.lora_dropout, targets)
        if not cfg.update.keep_dropout:  # before the reference is copied from it
            disable_dropout(self.policy.model)
        self.policy.model.train()

    def _resolve_precision(self) -> Precision:
        """--precision as this run uses it (``auto`` resolved for the device and model, a choice the device cannot
        run refused), written into the config like the engine's options (config.json records it)."""
        precision = machine_precision(self.cfg.machine, self.device, self.cfg.policy.model, self.given)
        self.cfg = self.cfg.replace(precision=precision.name)
        return precision

    def _weights_dtype(self):
        """The dtype the policy is loaded in: the precision's, except that a LoRA run under bf16-mixed holds its
        frozen base in bf16 (the products compute in bf16 anyway; the fp32 adapters are the masters that train)."""
        if self.cfg.policy.lora_rank and self.precision.name == "bf16-mixed":
            return self.precision.compute_dtype
        return self.precision.param_dtype

    def _resolve_engine_options(self, engine: RolloutEngine | None) -> None:
        """--rollout-dtype auto and --engine-correction auto as this run uses them, now the precision and device
        are known: written into the config (config.json records them; a resumed run takes them as they were)."""
        cfg, param = self.cfg, next(self.policy.model.parameters())
        dtype = rollout_dtype(cfg.engine.rollout_dtype, self.precision.compute_dtype)
        # An engine given in place of --rollout-engine's (the tests' scripted ones) is taken as exact: no correction
        # (--max-staleness K >= 1: the engine draws with older weights, a mismatch the correction weighs). The hf
        # engine is exact in the trainer's own dtype when the trainer computes in it (not under autocast) and that
        # dtype is fp32 or fp64: two bf16 kernels differ by bf16's rounding (docs/precision.md measures it).
        wide = dtype in (torch.float32, torch.float64)
        own = dtype == param.dtype and not self.precision.mixed and wide
        exact = engine is not None or (cfg.engine.rollout_engine == "hf" and own)
        exact = exact and not cfg.engine.max_staleness
        correction = resolve_correction(cfg.objective.engine_correction, exact, cfg.terms.loss_type)
        self.cfg = cfg.replace(rollout_dtype=str(dtype).removeprefix("torch."), engine_correction=correction)
        if "auto" in (cfg.engine.rollout_dtype, cfg.objective.engine_correction):
            self.log(f"rollouts sampled in {self.cfg.engine.rollout_dtype}, engine correction {correction}")

    def _setup_reference(self, reference: torch.nn.Module | None) -> None:
        """The KL reference: the starting policy, frozen (only when the KL term is on). With LoRA it is the same
        model with the adapter disabled: no second copy in memory."""
        cfg = self.cfg
        self.ref = None
        self.ref_is_base = cfg.objective.beta > 0 and cfg.policy.lora_rank > 0
        if cfg.objective.beta > 0 and not cfg.policy.lora_rank:
            dtype = next(self.policy.model.parameters()).dtype  # a resumed run's start is loaded in fp32
            ref_model = reference.to(self.device, dtype) if reference is not None else copy.deepcopy(self.policy.model)
            self.ref = self._train_module(ref_model.eval().requires_grad_(False))

    def _train_module(self, model: torch.nn.Module) -> TrainModule:
        cfg = self.cfg
        shared = cfg.update.shared_prefix == "on"
        temperature = cfg.generation.temperature
        return TrainModule(
            model,
            temperature,
            self.world,
            fsdp=cfg.update.fsdp,
            shared_prefix=shared,
            packing=cfg.update.packing,
            log=self.log,
            precision=self.precision,
            images=self.policy.family is not None,
        )

    def _setup_optimizer(self) -> None:
        """The policy's training forward, AdamW, the schedule and the update that uses them."""
        cfg = self.cfg
        # Before the optimizer: under FSDP the parameters it holds are the shards.
        self.train_module = self._train_module(self.policy.model)
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, cfg.optimizer.lr, cfg.optimizer.weight_decay, self.precision)
        self.scheduler = get_scheduler(
            {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optimizer.lr_schedule],
            self.optimizer,
            num_warmup_steps=cfg.optimizer.warmup_steps,
            num_training_steps=cfg.run.steps * cfg.objective.mu * cfg.update.minibatches,
        )
        self.updater = Updater(
            cfg.objective,
            cfg.update,
            cfg.optimizer.max_grad_norm,
            cfg.max_policy_tokens,
            self.train_module,
            self.optimizer,
            self.scheduler,
            self.world,
            self.policy.eos_id,
            reference=self.ref,
            reference_is_base=self.ref_is_base,
            terms=cfg.terms,
            top_p=cfg.generation.top_p,
            scaler=build_scaler(self.precision, self.device),
        )

    def _setup_task(self) -> None:
        """The reward functions, the held-out set and the training sampler (and --few-shot examples), the environment
        and the held-out accuracy's reward; each checked against the data now, not at the first step."""
        cfg, policy = self.cfg, self.policy
        given = self.given
        self.reward = rewarder_for(
            cfg.reward,
            policy,
            episodes=cfg.multi_turn,
            max_new_tokens=cfg.generation.max_new_tokens,
            sandbox=cfg.code_sandbox,
            given=given,
            greedy=greedy_texts,
        )
        self.held_out, self.sampler = task_data(
            cfg.dataset, cfg.arithmetic, cfg.episodes, cfg.eval.eval_questions, cfg.run.seed, self.log, given
        )
        # an environment task: its environment, with one episode opened on a held-out record to check it now
        first = self.held_out[0] if self.held_out else None
        self.env = environment(cfg.episodes, cfg.arithmetic.max_operand, policy, first, given)
        fns = self.reward.reward_fns
        self.eval_reward_name, self.eval_reward = eval_reward(
            cfg.reward, cfg.eval.eval_reward_fn, cfg.dataset.format, cfg.multi_turn, policy.shown_prompt, policy.chat,
            fns, sandbox=cfg.code_sandbox, given=given,
        )  # fmt: skip
        if cfg.dataset.data:  # a reward that needs a column the data lacks: one line now, not a zero reward every step
            check_columns(fns, self.sampler.records, f"--data {cfg.dataset.data}")
        held = cfg.dataset.eval_data or self.held_out  # --eval-fraction 0 holds nothing out: nothing to check
        if (cfg.dataset.data or cfg.dataset.eval_data) and self.eval_reward is not None and held:
            where = f"--eval-data {cfg.dataset.eval_data}" if cfg.dataset.eval_data else "the held-out records"
            check_columns([(self.eval_reward_name, self.eval_reward, 1.0)], self.held_out, where)
        # a code reward's sandbox, started now: a machine where programs cannot be isolated says so at once
        self.reward.start(self.log)
        start_reward([self._own_eval_reward], self.log)
        if cfg.prompt.few_shot and self.sampler is not None:  # solved examples from the training split
            self.policy.few_shot = few_shot_examples(self.sampler, cfg.prompt.few_shot)

    @property
    def _own_eval_reward(self):
        """The held-out accuracy's function when it is not one of the training reward's (the trainer then owns it)."""
        return None if any(fn is self.eval_reward for _, fn, _ in self.reward.reward_fns) else self.eval_reward

    @property
    def _sampler_computes(self) -> dict:
        """``fp32_head`` and ``autocast`` of grpolab's sampler (``build_engine``'s): as the trainer computes, when it
        samples in the trainer's compute dtype (--rollout-dtype auto under a mixed precision)."""
        same = self.cfg.engine.rollout_dtype == str(self.precision.compute_dtype).removeprefix("torch.")
        return {"fp32_head": self.precision.head_fp32, "autocast": self.precision.mixed and same}

    def _setup_rollouts(self, engine: RolloutEngine | None) -> None:
        """The rollout engine, the service every rollout of the run is drawn through (training's, evaluation's,
        rtg-mc's branches) and the collector of a step's rollouts."""
        cfg, t0 = self.cfg, time.perf_counter()
        full_weights = self.train_module.full_weights
        if engine is None and cfg.engine.in_process:  # --generator process: the engine in a process of its own
            from grpolab.rollout.generator import build_process_engine

            engine = build_process_engine(cfg.engine, cfg.run.seed, self.policy, full_weights, **self._sampler_computes)
        elif engine is None and cfg.engine.generators:  # --generators N: workers that join over the network
            from grpolab.rollout.remote.pool import build_worker_pool

            rank = self.world.rank
            # every rank's workers are its own: under torchrun each rank says what happens to them, by rank
            say = self.log if not self.world.distributed else lambda s: print(f"[rank {rank}] {s}", flush=True)
            engine = build_worker_pool(
                cfg.engine, cfg.run.seed, self.policy, full_weights, **self._sampler_computes,
                run=Path(cfg.run.out).name, rank=rank, say=say,
            )  # fmt: skip
        self.engine = engine or build_engine(
            cfg.engine, cfg.run.seed, self.policy, full_weights, **self._sampler_computes
        )
        if engine is None and cfg.engine.rollout_engine != "hf":
            mode = "compiled" if cfg.engine.vllm_compile else "eager"
            self.log(
                f"rollout engine: {cfg.engine.rollout_engine} ({mode}), started in {time.perf_counter() - t0:.0f} s"
            )
        self.service = RolloutService(self.engine, self.policy, self.reward, self.env)
        settings = CollectSettings.of(cfg.groups, cfg.generation, cfg.run.seed)
        self.collector = Collector(self.service, self.sampler, settings, self.world, status=self.status)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """Held-out accuracy at ``step`` (``grpolab.eval.accuracy``), drawn through the run's service; the metrics
        and the first --log-samples examples."""
        t0 = time.perf_counter()
        cfg = self.cfg
        if not self.held_out:  # --data with --eval-fraction 0: no held-out evaluation
            return {}, []
        with self.train_module.full_weights(), self.service.current_weights():
            metrics, examples = evaluate(
                self.service,
                self.held_out,
                samples=cfg.eval.eval_samples,
                temperature=cfg.generation.temperature,
                max_new_tokens=cfg.generation.max_new_tokens,
                seed=cfg.run.seed,
                world=self.world,
                progress=lambda done, total: self.status(f"eval at step {step}: {done}/{total} completions"),
                score=self.eval_reward,
                pass_k=cfg.eval.pass_k,
            )
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.log(
            f"eval at step {step}: {format_accuracy(metrics)}  ({len(self.held_out)} questions, "
            f"{cfg.eval.eval_samples} samples each, {metrics['time/eval_s']:.0f} s)"
        )
        return metrics, examples[: cfg.logging.log_samples]

    # ------------------------------------------------------------------ checkpoints
    def restore_stale_weights(self, ckpt: Path, state: dict) -> None:
        """--max-staleness on resume: the engine's held and pending weights as the checkpoint kept them."""
        if self.cfg.engine.max_staleness and "stale_weights" in state:
            self.service.engine.restore_lag(state["stale_weights"], checkpoint.load_tensors(ckpt, STALE_WEIGHTS))

    def save(self, out: Path, step: int) -> None:
        """Rank 0 writes ``checkpoints/step_N``; under FSDP every rank first sends it its shards.

        A checkpoint holds whole tensors whatever the process count, so any number of
        processes (or one) can resume it.
        """
        model_state = optim_state = None
        if self.train_module.fsdp:
            model_state, optim_state = self.train_module.full_state(self.optimizer)
        # Nobody runs ahead of (or resumes from) a checkpoint still being written, and a save that fails on rank 0,
        # whatever the error, stops every rank at once.
        dist_.on_main(
            lambda: self._write_checkpoint(out, step, model_state, optim_state),
            self.world,
            lambda: checkpoint.CheckpointError(
                f"could not write checkpoint step_{step} in {out / 'checkpoints'} (see rank 0)"
            ),
        )

    def _write_checkpoint(self, out: Path, step: int, model_state, optim_state) -> None:
        """Rank 0's part of :meth:`save`: the run's state beside the weights, the optimizer and the scheduler."""
        state = {"seed": self.cfg.run.seed, "world_size": self.world.size, "rollouts_total": self.rollouts_total}
        if self.control is not None:
            state["rank_control"] = dataclasses.asdict(self.control)
        if self.updater.entropy is not None:
            state["entropy_control"] = dataclasses.asdict(self.updater.entropy)
        if self.updater.scaler is not None:  # 16-mixed: the loss scale and its growth count
            state["grad_scaler"] = self.updater.scaler.state_dict()
        tensors = {}
        if self.cfg.engine.max_staleness:  # the weights of the steps in flight: a resume draws with them
            state["stale_weights"], tensors[STALE_WEIGHTS] = self.service.engine.lag_state()
        checkpoint.save(
            out,
            step,
            self.policy.model,
            self.policy.processor or self.policy.tokenizer,  # a vision-language model's: images and text
            self.optimizer,
            self.scheduler,
            state,
            keep=self.cfg.logging.keep_checkpoints,
            model_state=model_state,
            optimizer_state=optim_state,
            tensors=tensors,
        )

    def close(self) -> None:
        """Stop what the run started (the tool worker, the code reward's sandbox)."""
        self.service.close()
        close_reward([self._own_eval_reward])
