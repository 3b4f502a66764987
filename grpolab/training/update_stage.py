"""The update stage: the policy and everything that trains it, built from the run's resolved config.

It owns the policy (loaded, its LoRA adapter, its dropout off), the frozen KL reference, the training forward, AdamW,
the learning-rate schedule, fp16's loss scaler and the entropy bonus's control (the last two inside the
:class:`grpolab.training.update.Updater`), and it carries across a resume what the optimizer and schedule files do
not: the scaler's and the entropy control's state (:meth:`UpdateStage.state_dict`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch
from transformers import get_scheduler

from grpolab.algo.entropy_bonus import EntropyControl
from grpolab.common.distributed import World
from grpolab.common.given import Given
from grpolab.config.train import TrainConfig
from grpolab.models import checkpoint
from grpolab.models.policy import (
    Policy,
    disable_dropout,
    enable_activation_checkpointing,
    load_policy,
    system_prompt_for,
)
from grpolab.training.distill import TeacherSignal, load_teacher
from grpolab.training.forward import TrainModule
from grpolab.training.optim import build_optimizer, build_scaler
from grpolab.training.setup import run_precision, weights_dtype
from grpolab.training.update import Updater
from grpolab.training.update_options import UpdateSections

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""--lr-schedule -> transformers' scheduler name."""


class UpdateStage:
    """The policy and its update. Built in this order: the policy (LoRA wraps the loaded model before any forward is
    built on it), the KL reference (copied before training moves the policy), the training forward, then the
    optimizer on the parameters that forward leaves (FSDP's shards), the schedule and the :class:`Updater`. Of the
    run's resolved config it reads the sections ``policy``, ``prompt`` and ``dataset.format`` (the system prompt),
    ``machine`` (the precision), ``update``, ``objective``, ``terms``, ``optimizer`` and ``generation`` (the
    temperature, top-p), and ``run.steps`` (the schedule's length).

    ``weights_from``: a checkpoint to load the weights from in place of --model's (a resumed run's, without LoRA);
    ``adapter_from``: a LoRA checkpoint to resume the adapter from. ``reference``: the KL reference when it is not
    the starting weights (a resumed run's start)."""

    def __init__(
        self,
        cfg: TrainConfig,
        device: torch.device,
        world: World,
        given: Given,
        log=print,
        adapter_from: str | Path | None = None,
        reference: torch.nn.Module | None = None,
        weights_from: str | Path | None = None,
    ):
        self.cfg, self.device, self.world, self.log = cfg, device, world, log
        self.precision = run_precision(cfg)
        self.policy: Policy = self._load_policy(given, adapter_from, weights_from)
        self.ref, self.ref_is_base = self._reference(reference), cfg.objective.beta > 0 and cfg.policy.lora_rank > 0
        self.teacher = self._teacher(given)
        self.train_module = self._train_module(self.policy.model)  # before the optimizer: FSDP's shards
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, cfg.optimizer.lr, cfg.optimizer.weight_decay, self.precision)
        self.scheduler = get_scheduler(
            SCHEDULES[cfg.optimizer.lr_schedule],
            self.optimizer,
            num_warmup_steps=cfg.optimizer.warmup_steps,
            num_training_steps=cfg.run.steps * cfg.objective.mu * cfg.update.minibatches,
        )
        self.updater = Updater(
            UpdateSections.of(cfg),
            self.train_module,
            self.optimizer,
            self.scheduler,
            world,
            self.policy.eos_id,
            reference=self.ref,
            reference_is_base=self.ref_is_base,
            scaler=build_scaler(self.precision, device),
            teacher=self.teacher,
        )

    # ------------------------------------------------------------------ set-up
    def _load_policy(self, given: Given, adapter_from: str | Path | None, weights_from: str | Path | None) -> Policy:
        """The policy in its weights' dtype, its vision tower frozen (unless trained), LoRA added (or a resumed run's
        adapter loaded), dropout off, in training mode."""
        cfg, log, t0 = self.cfg, self.log, time.perf_counter()
        model, gguf = (str(weights_from), "") if weights_from else (cfg.policy.model, cfg.policy.gguf_file)
        log(f"loading {model}{' (' + gguf + ')' if gguf else ''} ...")
        policy = load_policy(
            model,
            weights_dtype(cfg, self.precision),
            gguf_file=gguf,
            revision=cfg.policy.revision,
            chat=cfg.prompt.chat,
            device=self.device,
            given=given,
        )
        n_params = sum(p.numel() for p in policy.model.parameters())
        log(
            f"loaded {policy.source}: {n_params / 1e6:.1f} M parameters, {next(policy.model.parameters()).dtype}"
            f" on {self.device}, in {time.perf_counter() - t0:.0f} s"
        )
        log(self.precision.describe(self.device))  # what --precision (auto resolved) holds and computes in
        policy.system = system_prompt_for(cfg.dataset.format, cfg.prompt.system_prompt)
        family = policy.family  # a vision-language model's adapter, else None
        if family is not None and not cfg.policy.train_vision_tower:
            frozen = family.freeze_tower(policy.model) / 1e6
            log(f"{family.name}: the vision tower is frozen ({frozen:.2f} M parameters)")
        if cfg.update.gradient_checkpointing:  # on the base model, before LoRA wraps it (peft then makes inputs
            enable_activation_checkpointing(policy.model)  # require grad)
        if cfg.policy.lora_rank:
            from grpolab.models.lora import add_lora, load_lora

            base, lora = policy.model, cfg.policy
            alpha = lora.lora_alpha or 2.0 * lora.lora_rank
            if adapter_from:  # a resumed run's adapter: its layers are those its adapter_config.json names
                policy.model = load_lora(base, adapter_from)
            else:
                targets = lora.lora_modules if family is None else family.lora_targets(base, lora.lora_modules)
                policy.model = add_lora(base, lora.lora_rank, alpha, lora.lora_dropout, targets)
        if not cfg.update.keep_dropout:  # before the reference is copied from it
            disable_dropout(policy.model)
        policy.model.train()
        return policy

    def _reference(self, reference: torch.nn.Module | None) -> TrainModule | None:
        """The KL reference: the starting policy, frozen (only when the KL term is on). With LoRA it is the same model
        with the adapter disabled (``ref_is_base``): no second copy in memory."""
        if not self.cfg.objective.beta > 0 or self.cfg.policy.lora_rank:
            return None
        dtype = next(self.policy.model.parameters()).dtype  # a resumed run's start is loaded in fp32
        ref_model = reference.to(self.device, dtype) if reference is not None else copy.deepcopy(self.policy.model)
        return self._train_module(ref_model.eval().requires_grad_(False))

    def _teacher(self, given: Given) -> TeacherSignal | None:
        """On-policy distillation's teacher (--teacher), frozen, in the run's compute dtype, whole on every process
        (never sharded: it takes no gradient), with its term of the loss; None without one."""
        section = self.cfg.distill
        if not section.on:
            return None
        model = load_teacher(section, self.policy, self.precision.compute_dtype, self.device, given, self.log)
        return TeacherSignal(section, self._train_module(model, fsdp=False), self.world)

    def _train_module(self, model: torch.nn.Module, fsdp: bool | None = None) -> TrainModule:
        cfg = self.cfg
        return TrainModule(
            model,
            cfg.generation.temperature,
            self.world,
            fsdp=cfg.update.fsdp if fsdp is None else fsdp,
            shared_prefix=cfg.update.shared_prefix == "on",
            packing=cfg.update.packing,
            log=self.log,
            precision=self.precision,
            images=self.policy.family is not None,
        )

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """What a resume needs besides the weights, the optimizer and the schedule (their own files): the entropy
        control's coefficient and fp16's loss scale, each only where the run has one."""
        state = {}
        if self.updater.entropy is not None:
            state["entropy_control"] = dataclasses.asdict(self.updater.entropy)
        if self.updater.scaler is not None:  # 16-mixed: the loss scale and its growth count
            state["grad_scaler"] = self.updater.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """:meth:`state_dict`'s keys, where the checkpoint has them (one written before a key existed keeps the
        start's)."""
        if self.updater.entropy is not None and "entropy_control" in state:
            self.updater.entropy = EntropyControl(**state["entropy_control"])
        if self.updater.scaler is not None and "grad_scaler" in state:
            self.updater.scaler.load_state_dict(state["grad_scaler"])

    def load_training_state(self, ckpt: Path) -> dict:
        """The optimizer's, the schedule's and the random state from ``ckpt``'s files; returns its trainer state."""
        return checkpoint.load_training_state(ckpt, self.optimizer, self.scheduler, model=self.policy.model)
