"""What a trainer owns besides its step: the policy, its reference, the optimizer, the update, the data, rewards and
environment, evaluation and checkpoints. ``grpolab.training.trainer.GRPOTrainer`` adds the step; this module does not import
it.

Set-up runs in named steps (policy, reference, optimizer and update, data); the update itself
lives in ``grpolab.training.update``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch
from transformers import get_scheduler

from grpolab.common import distributed as dist_
from grpolab.common.batch import Batch
from grpolab.common.devices import parse_dtype, resolve_device
from grpolab.common.distributed import SINGLE, World
from grpolab.config.train import TrainConfig
from grpolab.data.task import few_shot_examples, task_data
from grpolab.env import environment
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
from grpolab.rewards.rewarder import eval_reward, rewarder_for, start_reward
from grpolab.training.forward import TrainModule
from grpolab.training.setup import checked_config, seed_process
from grpolab.training.update import Updater


@dataclasses.dataclass
class StepOutput:
    metrics: dict
    samples: list[dict]
    rollouts: list[dict] | None = None
    """Every rollout of the step, in (prompt, rollout) order, with --log-rollouts."""
    token_credit: list[dict] | None = None
    """The rollouts recorded token by token, with --log-token-credit (rank 0's)."""


class TrainerBase:
    """Owns the policy, reference, optimizer and data of one run; subclasses define ``step``."""

    def __init__(
        self,
        cfg: TrainConfig,
        log=print,
        adapter_from: str | Path | None = None,
        world: World = SINGLE,
        reference: torch.nn.Module | None = None,
    ):
        """``cfg`` is resolved and validated here (:func:`grpolab.training.setup.checked_config`).
        ``adapter_from``: a LoRA checkpoint to resume the adapter from. ``reference``: the KL reference when it is
        not the starting weights (a resumed run's start)."""
        self.cfg = cfg = checked_config(cfg, world.size)
        self.log, self.world = log, world
        seed_process(cfg)
        self.device = resolve_device(cfg.machine.device, world.local_rank)
        self.status = lambda text: None  # train() points this at the progress bar
        # In this order: LoRA wraps the loaded model before any forward is built on it; the optimizer takes the
        # parameters the training forward leaves (FSDP's shards); the data may put solved examples in the prompts.
        self._setup_policy(adapter_from)
        self._setup_reference(reference)
        self._setup_optimizer()
        self._setup_data()

    def _setup_policy(self, adapter_from: str | Path | None) -> None:
        cfg, log = self.cfg, self.log
        t0 = time.perf_counter()
        log(f"loading {cfg.policy.model}{' (' + cfg.policy.gguf_file + ')' if cfg.policy.gguf_file else ''} ...")
        dtype = parse_dtype(cfg.machine.dtype)
        self.policy: Policy = load_policy(
            cfg.policy.model, dtype, gguf_file=cfg.policy.gguf_file, chat=cfg.prompt.chat, device=self.device
        )
        n_params = sum(p.numel() for p in self.policy.model.parameters())
        log(
            f"loaded {self.policy.source}: {n_params / 1e6:.1f} M parameters, {next(self.policy.model.parameters()).dtype}"
            f" on {self.device}, in {time.perf_counter() - t0:.0f} s"
        )
        self.policy.system = system_prompt_for(cfg.dataset.format, cfg.prompt.system_prompt)
        if (
            cfg.update.gradient_checkpointing
        ):  # on the base model, before LoRA wraps it (peft then makes inputs require grad)
            enable_activation_checkpointing(self.policy.model)
        if cfg.policy.lora_rank:
            from grpolab.models.lora import add_lora, load_lora

            base = self.policy.model
            self.policy.model = (
                load_lora(base, adapter_from)
                if adapter_from
                else add_lora(base, cfg.policy.lora_rank, cfg.policy.lora_alpha or 2.0 * cfg.policy.lora_rank)
            )
        if not cfg.update.keep_dropout:  # before the reference is copied from it
            disable_dropout(self.policy.model)
        self.policy.model.train()

    def _setup_reference(self, reference: torch.nn.Module | None) -> None:
        """The KL reference: the starting policy, frozen (only when the KL term is on). With LoRA it is the same
        model with the adapter disabled: no second copy in memory."""
        cfg = self.cfg
        self.ref = None
        self.ref_is_base = cfg.objective.beta > 0 and cfg.policy.lora_rank > 0
        if cfg.objective.beta > 0 and not cfg.policy.lora_rank:
            ref_model = reference.to(self.device) if reference is not None else copy.deepcopy(self.policy.model)
            self.ref = self._train_module(ref_model.eval().requires_grad_(False))

    def _train_module(self, model: torch.nn.Module) -> TrainModule:
        cfg = self.cfg
        shared = cfg.update.shared_prefix == "on"
        return TrainModule(
            model,
            cfg.generation.temperature,
            self.world,
            fsdp=cfg.update.fsdp,
            shared_prefix=shared,
            packing=cfg.update.packing,
            log=self.log,
        )

    def _setup_optimizer(self) -> None:
        """The policy's training forward, AdamW, the schedule and the update that uses them."""
        cfg = self.cfg
        # Before the optimizer: under FSDP the parameters it holds are the shards.
        self.train_module = self._train_module(self.policy.model)
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
        total_updates = cfg.run.steps * cfg.objective.mu
        self.scheduler = get_scheduler(
            {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optimizer.lr_schedule],
            self.optimizer,
            num_warmup_steps=cfg.optimizer.warmup_steps,
            num_training_steps=total_updates,
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
        )

    def _setup_data(self) -> None:
        """The reward functions, the held-out set and the training sampler (and --few-shot examples)."""
        cfg, policy = self.cfg, self.policy
        self.reward = rewarder_for(
            cfg.reward,
            policy,
            episodes=cfg.multi_turn,
            max_new_tokens=cfg.generation.max_new_tokens,
            sandbox=cfg.code_sandbox,
        )
        self.reward_fns = self.reward.reward_fns
        self.held_out, self.sampler = self._data()
        # an environment task: its environment, with one episode opened on a held-out record to check it now
        self.env = environment(
            cfg.episodes, cfg.arithmetic.max_operand, policy, self.held_out[0] if self.held_out else None
        )
        self.eval_reward_name, self.eval_reward = eval_reward(
            cfg.reward,
            cfg.eval.eval_reward_fn,
            cfg.dataset.format,
            cfg.multi_turn,
            policy.shown_prompt,
            policy.chat,
            self.reward_fns,
            sandbox=cfg.code_sandbox,
        )
        if cfg.dataset.data:  # a reward that needs a column the data lacks: one line now, not a zero reward every step
            check_columns(self.reward_fns, self.sampler.records, f"--data {cfg.dataset.data}")
        if (cfg.dataset.data or cfg.dataset.eval_data) and self.eval_reward is not None:
            where = f"--eval-data {cfg.dataset.eval_data}" if cfg.dataset.eval_data else "the held-out records"
            check_columns([(self.eval_reward_name, self.eval_reward, 1.0)], self.held_out, where)
        # a code reward's sandbox, started now: a machine where programs cannot be isolated says so at once
        self.reward.start(self.log)
        start_reward([self._own_eval_reward], self.log)
        self.rollouts_total = 0  # rollouts generated since step 1 (restored on resume)
        if cfg.prompt.few_shot and self.sampler is not None:  # solved examples from the training split
            self.policy.few_shot = few_shot_examples(self.sampler, cfg.prompt.few_shot)

    @property
    def _own_eval_reward(self):
        """The held-out accuracy's function when it is not one of the training reward's (then the trainer owns it)."""
        return None if any(fn is self.eval_reward for _, fn, _ in self.reward_fns) else self.eval_reward

    def _data(self):
        cfg = self.cfg
        return task_data(cfg.dataset, cfg.arithmetic, cfg.episodes, cfg.eval.eval_questions, cfg.run.seed, self.log)

    def _update(
        self,
        batch: Batch,
        adv: torch.Tensor,
        entropy: torch.Tensor | None = None,
        sampler_logp: torch.Tensor | None = None,
        watch: list[int] | None = None,
        action: torch.Tensor | None = None,
        cut: torch.Tensor | None = None,
    ) -> dict:
        """mu optimizer steps on this rank's rows and advantages (``grpolab.training.update``); ``watch``: rows whose
        per-token values the update keeps (``self.updater.watched``); ``action``, ``cut``: an episode's tokens and
        rows (see :class:`grpolab.training.update.Updater`)."""
        return self.updater(batch, adv, entropy, sampler_logp, watch, action, cut)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        t0 = time.perf_counter()
        cfg = self.cfg
        with self.train_module.full_weights():
            metrics, examples = evaluate(
                self.service,  # the run's rollout engine and environment (set by the trainer)
                self.held_out,
                samples=cfg.eval.eval_samples,
                temperature=cfg.generation.temperature,
                max_new_tokens=cfg.generation.max_new_tokens,
                seed=cfg.run.seed,
                world=self.world,
                progress=lambda done, total: self.status(f"eval at step {step}: {done}/{total} completions"),
                score=self.eval_reward,
            )
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.log(
            f"eval at step {step}: {format_accuracy(metrics)}  ({len(self.held_out)} questions, "
            f"{cfg.eval.eval_samples} samples each, {metrics['time/eval_s']:.0f} s)"
        )
        return metrics, examples[: self.cfg.logging.log_samples]

    # ------------------------------------------------------------------ checkpoints
    def save(self, out: Path, step: int) -> None:
        """Rank 0 writes ``checkpoints/step_N``; under FSDP every rank first sends it its shards.

        A checkpoint holds whole tensors whatever the process count, so any number of
        processes (or one) can resume it.
        """
        model_state = optim_state = None
        if self.train_module.fsdp:
            model_state, optim_state = self.train_module.full_state(self.optimizer)
        error = None
        if self.world.is_main:
            try:
                checkpoint.save(
                    out,
                    step,
                    self.policy.model,
                    self.policy.tokenizer,
                    self.optimizer,
                    self.scheduler,
                    {"seed": self.cfg.run.seed, "world_size": self.world.size, "rollouts_total": self.rollouts_total},
                    keep=self.cfg.logging.keep_checkpoints,
                    model_state=model_state,
                    optimizer_state=optim_state,
                )
            except checkpoint.CheckpointError as e:
                error = e
        # Nobody runs ahead of (or resumes from) a checkpoint still being written, and a failed save stops every rank.
        if not dist_.all_true(error is None, self.world):
            raise error or checkpoint.CheckpointError(
                f"could not write checkpoint step_{step} in {out / 'checkpoints'} (see rank 0)"
            )
