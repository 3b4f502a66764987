"""What the single-turn and the multi-turn trainer share: the policy, its reference, the optimizer,
the update, evaluation and checkpoints. Each trainer (``grpolab.trainer``,
``grpolab.multiturn.trainer``) adds its own ``step``; this module imports neither.

The update (``_update``) takes this rank's rows and their advantages and runs mu optimizer
steps with the whole step's normalisers, gradients summed over ranks (grpolab.train_forward), so
that P processes make the single-process update.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from pathlib import Path

import torch
from transformers import get_scheduler

from grpolab import checkpoint
from grpolab import distributed as dist_
from grpolab.config import TrainConfig
from grpolab.data.task import few_shot_examples, task_data
from grpolab.devices import parse_dtype, resolve_device
from grpolab.distributed import SINGLE, World
from grpolab.evaluate import evaluate, format_accuracy
from grpolab.loss import entropy_threshold, high_entropy_mask, loss_token_mask, policy_loss
from grpolab.policy import MATH_SYSTEM_PROMPT, Policy, enable_activation_checkpointing, load_policy
from grpolab.rewards import reward_functions
from grpolab.rollout import Batch, select
from grpolab.train_forward import TrainModule
from grpolab.utils import seed_everything, set_threads


@dataclasses.dataclass
class StepOutput:
    metrics: dict
    samples: list[dict]
    rollouts: list[dict] | None = None
    """Every rollout of the step, in (prompt, rollout) order, with --log-rollouts."""


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
        """``reference``: the KL reference when it is not the starting weights (a resumed run's start)."""
        cfg = cfg.resolved()
        cfg.validate()
        cfg.validate_world(world.size)
        self.cfg = cfg
        self.log = log
        self.world = world
        set_threads(cfg.threads)
        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.device, world.local_rank)
        dtype = parse_dtype(cfg.dtype)
        t0 = time.perf_counter()
        log(f"loading {cfg.model}{' (' + cfg.gguf_file + ')' if cfg.gguf_file else ''} ...")
        self.policy: Policy = load_policy(cfg.model, dtype, gguf_file=cfg.gguf_file, chat=cfg.chat, device=self.device)
        n_params = sum(p.numel() for p in self.policy.model.parameters())
        log(
            f"loaded {self.policy.source}: {n_params / 1e6:.1f} M parameters, {next(self.policy.model.parameters()).dtype}"
            f" on {self.device}, in {time.perf_counter() - t0:.0f} s"
        )
        self.status = lambda text: None  # train() points this at the progress bar
        if cfg.format == "math":
            self.policy.system = MATH_SYSTEM_PROMPT
        if cfg.system_prompt:
            self.policy.system = cfg.system_prompt
        if cfg.gradient_checkpointing:  # on the base model, before LoRA wraps it (peft then makes inputs require grad)
            enable_activation_checkpointing(self.policy.model)
        if cfg.lora_rank:
            from grpolab.models.lora import add_lora, load_lora

            base = self.policy.model
            self.policy.model = (
                load_lora(base, adapter_from)
                if adapter_from
                else add_lora(base, cfg.lora_rank, cfg.lora_alpha or 2.0 * cfg.lora_rank)
            )
        self.policy.model.train()
        # The reference is the starting policy, frozen (only needed when the KL term is on). With LoRA it
        # is the same model with the adapter disabled: no second copy in memory.
        self.ref = None
        self.ref_is_base = cfg.beta > 0 and cfg.lora_rank > 0
        shared = cfg.shared_prefix == "on"
        if cfg.beta > 0 and not cfg.lora_rank:
            ref_model = reference.to(self.device) if reference is not None else copy.deepcopy(self.policy.model)
            self.ref = TrainModule(
                ref_model.eval().requires_grad_(False),
                cfg.temperature,
                world,
                fsdp=cfg.fsdp,
                shared_prefix=shared,
                log=log,
            )
        # Before the optimizer: under FSDP the parameters it holds are the shards.
        self.train_module = TrainModule(
            self.policy.model, cfg.temperature, world, fsdp=cfg.fsdp, shared_prefix=shared, log=log
        )
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        total_updates = cfg.steps * cfg.mu
        self.scheduler = get_scheduler(
            {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule],
            self.optimizer,
            num_warmup_steps=cfg.warmup_steps,
            num_training_steps=total_updates,
        )
        policy = self.policy
        self.reward_fns = reward_functions(
            cfg.reward_fn,
            cfg.reward_weights,
            cfg.format_weight,
            chat=policy.chat,
            prompt_of=policy.chat_messages if policy.chat else policy.prompt_text,
        )
        self.held_out, self.sampler = self._data()
        self.rollouts_total = 0  # rollouts generated since step 1 (restored on resume)
        if cfg.few_shot and self.sampler is not None:  # solved examples from the training split
            self.policy.few_shot = few_shot_examples(self.sampler, cfg.few_shot)

    def _data(self):
        return task_data(self.cfg, self.log)

    def _no_update(self) -> dict:
        """A step with no group to learn from (--sampling filter, every round all-equal): the weights stay,
        the schedule moves on, and the step is counted (``sampling/short``)."""
        for _ in range(self.cfg.mu):
            self.scheduler.step()
        return {
            "loss/total": None,
            "loss/policy": None,
            "loss/kl": None,
            "loss/clip_frac": None,
            "loss/ratio_mean": None,
            "loss/active_frac": 0.0,
            "loss/skipped_updates": 0,
            "grad/norm": None,
            "charts/lr": self.scheduler.get_last_lr()[0],
        }

    def _update(self, batch: Batch, adv: torch.Tensor, entropy: torch.Tensor | None = None) -> dict:
        """mu optimizer steps on this rank's rollouts; with P ranks, the sum of their gradients.

        batch, adv ``[n]``: this rank's n rows (rollouts; turns for the multi-turn trainer); n may be 0.
        Normalisers are the whole step's (N rows over all ranks, their token count), so each rank's
        loss is its share of the single-process loss. ``entropy`` ``[n, T]``: the sampling policy's
        token entropies, for --top-entropy-quantile.
        """
        cfg, world, train = self.cfg, self.world, self.train_module
        model = self.policy.model
        n = adv.shape[0]
        mask = batch.completion_mask[:n]  # a rank with no rows of its own holds one stand-in row (collect.Rows)
        # The tokens that carry loss: --mask-truncated drops completions with no end-of-sequence token (DAPO),
        # by the rule the probes use (the entropy selection is applied below, its threshold over every rank).
        loss_mask = loss_token_mask(
            batch.completion_ids[:n], mask, self.policy.eos_id, mask_truncated=cfg.mask_truncated
        ).to(mask.dtype)  # [n, T]
        carries = (
            loss_mask.bool().any(dim=1) if cfg.mask_truncated else torch.ones(n, dtype=torch.bool, device=mask.device)
        )
        N, num_tokens = dist_.all_sum([float(n), float(loss_mask.sum())], world)
        N = int(N)
        mb = cfg.micro_batch or N
        threshold = None
        if cfg.top_entropy_quantile < 1.0:  # one threshold over every loss-carrying token of the step, all ranks
            local = entropy[:n].to(mask.device)[loss_mask.bool()].float().cpu() if n else torch.zeros(0)
            threshold = entropy_threshold(torch.cat(dist_.gather(local, world)), cfg.top_entropy_quantile)
        # With no KL term, a rollout whose advantage is exactly 0 contributes exactly 0
        # to the loss and its gradient (every term is ratio * 0), so it is not run at all; nor is a
        # rollout with no loss-carrying token. Normalisers stay those of the whole batch, so the gradient is unchanged.
        live = carries if cfg.beta > 0 else carries & (adv != 0)
        rows = live.nonzero().squeeze(1)
        chunks = [rows[i : i + mb] for i in range(0, rows.numel(), mb)]
        # Every rank runs the same number of forward/backward passes (DDP and FSDP pair up their
        # collectives pass by pass): a rank with fewer active rollouts pads with passes over one
        # row whose loss is multiplied by 0, so they add exactly nothing to the gradient.
        real = len(chunks)
        chunks += [torch.zeros(1, dtype=torch.long, device=adv.device)] * (dist_.all_max(real, world) - real)

        old_logp, ref_logp = {}, {}
        with torch.no_grad():
            for c_i, idx in enumerate(chunks):
                sub = select(batch, idx)
                if cfg.mu > 1:  # sampling-time log-probs for the importance ratio [U-statistic, App. A (ii)]
                    old_logp[c_i] = train.logprobs(sub)
                if self.ref is not None:
                    ref_logp[c_i] = self.ref.logprobs(sub)
                elif self.ref_is_base:
                    with model.disable_adapter():
                        ref_logp[c_i] = train.logprobs(sub)

        sums = {"loss": 0.0, "policy": 0.0, "kl_tok": 0.0, "clip_tok": 0.0, "ratio_tok": 0.0}
        grad_norm, skipped = 0.0, 0
        params = [p for p in model.parameters() if p.requires_grad]
        for _ in range(cfg.mu):
            self.optimizer.zero_grad(set_to_none=True)
            finite = True
            for c_i, idx in enumerate(chunks):
                sub = select(batch, idx)
                with train.sync(c_i == len(chunks) - 1):  # reduce over ranks once, after the last pass
                    logp = train.logprobs(sub)  # [n, T]
                    sub_mask = loss_mask[idx, : sub.completion_mask.shape[1]] if c_i < real else sub.completion_mask
                    weights = None
                    if threshold is not None:
                        ent = (
                            entropy[idx.cpu(), : sub_mask.shape[1]].to(sub_mask.device)
                            if c_i < real
                            else torch.zeros_like(logp)
                        )
                        weights = high_entropy_mask(ent, sub_mask, threshold.to(ent.device))
                    loss, st = policy_loss(
                        logp,
                        old_logp.get(c_i, logp.detach()),
                        adv[idx],
                        sub_mask,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        ref_logp=ref_logp.get(c_i),
                        beta=cfg.beta,
                        kl=cfg.kl,
                        aggregation=cfg.aggregation,
                        max_len=cfg.max_new_tokens,
                        num_seqs=N,
                        num_tokens=num_tokens,
                        importance_sampling=cfg.importance_sampling,
                        clip_delta=cfg.clip_delta or None,
                        token_weights=weights,
                    )
                    if c_i >= real:  # padding pass
                        loss = loss * 0.0
                    # A non-finite loss still runs backward: the ranks stay in step, and the update is skipped below.
                    finite = finite and bool(torch.isfinite(loss))
                    (loss * train.loss_scale).backward()
                if c_i >= real:
                    continue
                n_tok = float(sub_mask.sum())
                sums["loss"] += loss.item() / cfg.mu
                sums["policy"] += st["policy"].item() / cfg.mu
                sums["kl_tok"] += st["kl"].item() * n_tok / cfg.mu
                sums["clip_tok"] += st["clip_frac"].item() * n_tok / cfg.mu
                sums["ratio_tok"] += st["ratio_mean"].item() * n_tok / cfg.mu
            norm = train.clip_grad_norm(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
            # The gradient (and so its norm) is the same on every rank after the reduction; the loss flags are not.
            finite = dist_.all_true(finite and math.isfinite(norm), world)
            if finite:
                grad_norm += norm / cfg.mu
                self.optimizer.step()
            else:  # a non-finite loss or gradient: skip this update, count it, keep the weights
                skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        # Whole-step sums: this rank's part plus the others'.
        keys = list(sums)
        totals = dict(
            zip(
                keys + ["active", "active_tok"],
                dist_.all_sum([sums[k] for k in keys] + [rows.numel(), float(loss_mask[rows].sum())], world),
            )
        )
        active_tokens = max(1.0, totals["active_tok"])
        return {
            "loss/total": totals["loss"],
            "loss/policy": totals["policy"],
            "loss/kl": totals["kl_tok"] / active_tokens if (self.ref is not None or self.ref_is_base) else None,
            "loss/clip_frac": totals["clip_tok"] / active_tokens,
            "loss/ratio_mean": totals["ratio_tok"] / active_tokens if totals["active"] else 1.0,
            "loss/active_frac": totals["active"] / N,
            "loss/skipped_updates": skipped,
            "grad/norm": grad_norm,
            "charts/lr": self.scheduler.get_last_lr()[0],
        }

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        t0 = time.perf_counter()
        cfg = self.cfg
        with self.train_module.full_weights():
            metrics, examples = evaluate(
                self.policy,
                self.held_out,
                samples=cfg.eval_samples,
                temperature=cfg.temperature,
                max_new_tokens=cfg.max_new_tokens,
                seed=cfg.seed,
                world=self.world,
                progress=lambda done, total: self.status(f"eval at step {step}: {done}/{total} completions"),
            )
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.log(
            f"eval at step {step}: {format_accuracy(metrics)}  ({len(self.held_out)} questions, "
            f"{cfg.eval_samples} samples each, {metrics['time/eval_s']:.0f} s)"
        )
        return metrics, examples[: self.cfg.log_samples]

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
                    {"seed": self.cfg.seed, "world_size": self.world.size, "rollouts_total": self.rollouts_total},
                    keep=self.cfg.keep_checkpoints,
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
