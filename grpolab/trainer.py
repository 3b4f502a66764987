"""The GRPO loop: sample -> score -> advantages -> loss -> update, one step at a time.

The math lives in ``advantages``, ``loss`` and ``rewards``; this file only
calls it in order and keeps the books (metrics, checkpoints, evaluation).

On P processes (torchrun) each rank takes a contiguous block of B/P of the step's
prompts with all their rollouts (a group never spans ranks, so its baseline needs no
communication); rollout (b, g) draws from the stream keyed by the *global* prompt index b,
so the rollouts do not depend on P. Losses use the whole step's normalisers and gradients
are summed over ranks (grpolab.parallel), so the update is the single-process update.
Metrics are computed from the gathered per-rollout values, identically on every rank;
rank 0 alone writes them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch
from transformers import get_scheduler

from grpolab import checkpoint
from grpolab import distributed as dist_
from grpolab.advantages import compute_advantages, ragged_advantages
from grpolab.collect import ROLLOUT_STREAM, Collector  # noqa: F401  (ROLLOUT_STREAM: the benchmarks key rollouts with it)
from grpolab.config import ConfigError, TrainConfig
from grpolab.devices import parse_dtype, resolve_device
from grpolab.data.task import few_shot_examples, task_data
from grpolab.distributed import SINGLE, World
from grpolab.evaluate import evaluate, format_accuracy
from grpolab.loss import policy_loss
from grpolab.parallel import TrainModule
from grpolab.policy import MATH_SYSTEM_PROMPT, Policy, enable_activation_checkpointing, load_policy
from grpolab.probes.advantage_stats import advantage_stats
from grpolab.probes.gram import score_gram, token_weights
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics
from grpolab.progress import progress_bar
from grpolab.rewards import default_reward_fns, load_reward_fn
from grpolab.rollout import Batch, select
from grpolab.runlog import RunLogger, truncate_jsonl
from grpolab.sampling import prompt_weights
from grpolab.utils import git_revision, seed_everything, set_threads


@dataclasses.dataclass
class StepOutput:
    metrics: dict
    samples: list[dict]
    rollouts: list[dict] | None = None
    """Every rollout of the step, in (prompt, rollout) order, with --log-rollouts."""


class GRPOTrainer:
    """Owns the policy, reference, optimizer and data of one run."""

    def __init__(self, cfg: TrainConfig, log=print, adapter_from: str | Path | None = None, world: World = SINGLE,
                 reference: torch.nn.Module | None = None):
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
        log(f"loaded {self.policy.source}: {n_params / 1e6:.1f} M parameters, {next(self.policy.model.parameters()).dtype}"
            f" on {self.device}, in {time.perf_counter() - t0:.0f} s")
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
            self.policy.model = (load_lora(base, adapter_from) if adapter_from
                                 else add_lora(base, cfg.lora_rank, cfg.lora_alpha or 2.0 * cfg.lora_rank))
        self.policy.model.train()
        # The reference is the starting policy, frozen (only needed when the KL term is on). With LoRA it
        # is the same model with the adapter disabled: no second copy in memory.
        self.ref = None
        self.ref_is_base = cfg.beta > 0 and cfg.lora_rank > 0
        shared = cfg.shared_prefix == "on"
        if cfg.beta > 0 and not cfg.lora_rank:
            ref_model = reference.to(self.device) if reference is not None else copy.deepcopy(self.policy.model)
            self.ref = TrainModule(ref_model.eval().requires_grad_(False), cfg.temperature, world, fsdp=cfg.fsdp,
                                   shared_prefix=shared, log=log)
        # Before the optimizer: under FSDP the parameters it holds are the shards.
        self.train_module = TrainModule(self.policy.model, cfg.temperature, world, fsdp=cfg.fsdp, shared_prefix=shared, log=log)
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        total_updates = cfg.steps * cfg.mu
        self.scheduler = get_scheduler(
            {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule],
            self.optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_updates,
        )
        accuracy_fn = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else None
        self.reward_fns = default_reward_fns(cfg.format_weight, **({"accuracy_fn": accuracy_fn} if accuracy_fn else {}))
        self.held_out, self.sampler = self._data()
        self.collector = Collector(self)
        self.rollouts_total = 0  # rollouts generated since step 1 (restored on resume)
        if cfg.few_shot and self.sampler is not None:  # solved examples from the training split
            self.policy.few_shot = few_shot_examples(self.sampler, cfg.few_shot)

    def _data(self):
        return task_data(self.cfg, self.log)

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepOutput:
        cfg = self.cfg
        t_step = time.perf_counter()

        # 1-2. rollouts and their rewards; --sampling decides how many of which prompts (grpolab.sampling)
        roll = self.collector.collect(step)
        groups, rows = roll.groups, roll.groups.rows
        batch, scores, texts = rows.batch, rows.scores, rows.texts
        t_score = time.perf_counter()

        # 3. advantages: one scalar per rollout (paper 000, Thm 3.1); groups are whole on this rank
        if not groups.sizes:
            adv = torch.zeros(0, device=self.device)
        elif len(set(groups.sizes)) == 1:
            G = groups.sizes[0]
            adv = compute_advantages(scores.total.to(self.device).view(len(groups.sizes), G), cfg.estimator).reshape(-1)  # [n]
        else:
            adv = ragged_advantages(list(scores.total.to(self.device).split(groups.sizes)), cfg.estimator)  # [n]
        position = {b: k for k, b in enumerate(roll.prompts)}  # prompt -> its place among the update's groups
        weighted = adv
        if len({len(r) for r in roll.rewards}) > 1:  # every prompt weighs 1/B whatever its group size (grpolab.sampling)
            factor = prompt_weights([len(r) for r in roll.rewards])  # [groups], the update's order
            w = torch.cat([torch.full((n,), factor[position[b]]) for b, n in zip(groups.prompt, groups.sizes)])
            weighted = adv * w.to(adv.device, adv.dtype)

        # The whole step's samples and rollouts of the update's groups, in prompt order, on every rank.
        starts = [0]
        for n in groups.sizes:
            starts.append(starts[-1] + n)
        local = {
            "samples": [(position[b], {"question": rec["question"], "completion": texts[starts[k]],
                                       "reward": scores.total[starts[k]].item()})
                        for k, (b, rec) in enumerate(zip(groups.prompt, groups.records)) if position[b] < cfg.log_samples],
            "rollouts": [(position[b], {"prompt": b, "rollout": g, "question": rec["question"], "completion": texts[starts[k] + g],
                                        "tokens": int(batch.completion_mask[starts[k] + g].sum()),
                                        "reward": scores.total[starts[k] + g].item(), "advantage": adv[starts[k] + g].item()})
                         for k, (b, rec) in enumerate(zip(groups.prompt, groups.records)) for g in range(groups.sizes[k])]
                        if cfg.log_rollouts else [],
        }
        parts = dist_.gather(local, self.world)
        whole = {k: [x for _, x in sorted((x for p in parts for x in p[k]), key=lambda x: x[0])] for k in local}  # stable sort

        probe = self._probe(step, roll, adv)  # on the policy that sampled

        # 4. loss and update
        self.status(f"step {step}: update ({cfg.mu} x {rows.n} rollouts)")
        update = self._update(batch, weighted) if roll.rewards else self._no_update()
        t_end = time.perf_counter()

        gen = roll.generated
        lengths = torch.tensor(gen["length"], dtype=torch.float)  # [every rollout generated]
        reward = torch.tensor(gen["reward"])  # [every rollout generated]
        uniform = len({len(r) for r in roll.rewards}) == 1
        group_std = (torch.tensor(roll.rewards).std(dim=1, unbiased=False) if uniform else
                     torch.stack([torch.tensor(r).std(unbiased=False) for r in roll.rewards]) if roll.rewards else None)  # [groups]
        sizes = [len(r) for r in roll.rewards]
        self.rollouts_total += reward.numel()
        metrics = {
            "reward/mean": reward.mean().item(),
            "reward/std": reward.std(unbiased=False).item(),
            "reward/group_std_mean": group_std.mean().item() if sizes else None,
            "reward/frac_zero_std": statistics.fmean(len(set(r)) == 1 for r in roll.rewards) if sizes else None,
            "reward/accuracy": statistics.fmean(gen["accuracy"]),
            "reward/format": statistics.fmean(gen["format"]),
            "reward/errors": gen["errors"],
            "sampling/rollouts": reward.numel(),
            "sampling/rollouts_total": self.rollouts_total,
            "sampling/rounds": roll.rounds,
            "sampling/kept_groups": len(sizes),
            "sampling/short": int(roll.short),
            "sampling/frac_zero_std_drawn": gen["zero_std"],
            "sampling/group_size_mean": statistics.fmean(sizes) if sizes else 0.0,
            "sampling/group_size_max": max(sizes, default=0),
            **update,
            **probe,
            "completion/len_mean": lengths.mean().item(),
            "completion/len_max": lengths.max().item(),
            "completion/truncated_frac": statistics.fmean(map(float, gen["truncated"])),
            "time/generate_s": roll.time_generate,
            "time/score_s": roll.time_score,
            "time/update_s": t_end - t_score,
            "time/step_s": t_end - t_step,
        }
        return StepOutput(metrics, whole["samples"], whole["rollouts"] if cfg.log_rollouts else None)

    def _probe(self, step: int, roll, adv: torch.Tensor) -> dict:
        """Advantage statistics every step; the gradient spectrum every ``probe_every`` steps.

        ``roll.rewards``: every group of the update (all ranks, in order); ``roll.groups``, adv ``[n]``:
        this rank's. The spectrum is measured on the first ``probe_groups`` groups with reward
        variance of the whole step, each by the rank that holds it.
        """
        cfg = self.cfg
        rewards, groups, batch = roll.rewards, roll.groups, roll.groups.rows.batch
        out = {}
        if rewards and min(len(r) for r in rewards) >= 2:
            stats = advantage_stats([torch.tensor(r) for r in rewards], eps=cfg.probe_eps)
            out = {f"probe/adv_{k}": v for k, v in stats.items()}
        if cfg.probe_every and step % cfg.probe_every == 0:
            t0 = time.perf_counter()
            live = [k for k, r in enumerate(rewards) if len(set(r)) > 1][: cfg.probe_groups]  # positions in the update
            position = {b: k for k, b in enumerate(roll.prompts)}
            metrics, start = [], 0
            for b, n in zip(groups.prompt, groups.sizes):
                if position[b] in live:
                    sub = select(batch, torch.arange(start, start + n, device=self.device))
                    psi = score_gram(self.policy.model, sub, token_weights(sub.completion_mask, cfg.aggregation, cfg.max_new_tokens),
                                     temperature=cfg.temperature)
                    metrics.append((position[b], spectrum_metrics(singular_values_from_gram(psi, adv[start : start + n].cpu()))))
                start += n
            metrics = [m for _, m in sorted(dist_.gather_concat(metrics, self.world), key=lambda x: x[0])]
            for key, name in (("effective_rank", "eff_rank"), ("top1_fraction", "top1_frac"), ("num_rank", "num_rank")):
                out[f"probe/{name}"] = sum(m[key] for m in metrics) / len(metrics) if metrics else None
            out["probe/groups_measured"] = len(metrics)
            out["time/probe_s"] = time.perf_counter() - t0
        return out

    def _no_update(self) -> dict:
        """A step with no group to learn from (--sampling filter, every round all-equal): the weights stay,
        the schedule moves on, and the step is counted (``sampling/short``)."""
        for _ in range(self.cfg.mu):
            self.scheduler.step()
        return {"loss/total": None, "loss/policy": None, "loss/kl": None, "loss/clip_frac": None, "loss/ratio_mean": None,
                "loss/active_frac": 0.0, "loss/skipped_updates": 0, "grad/norm": None, "charts/lr": self.scheduler.get_last_lr()[0]}

    def _update(self, batch: Batch, adv: torch.Tensor) -> dict:
        """mu optimizer steps on this rank's rollouts; with P ranks, the sum of their gradients.

        batch, adv ``[n]``: this rank's n rows (rollouts; turns for the multi-turn trainer); n may be 0.
        Normalisers are the whole step's (N rows over all ranks, their token count), so each rank's
        loss is its share of the single-process loss.
        """
        cfg, world, train = self.cfg, self.world, self.train_module
        model = self.policy.model
        mask = batch.completion_mask[: adv.shape[0]]  # a rank with no rows of its own holds one stand-in row (collect.Rows)
        N, num_tokens = dist_.all_sum([float(adv.shape[0]), float(mask.sum())], world)
        N = int(N)
        mb = cfg.micro_batch or N
        # With no KL term, a rollout whose advantage is exactly 0 contributes exactly 0
        # to the loss and its gradient (every term is ratio * 0), so it is not run at all.
        # Normalisers stay those of the whole batch, so the gradient is unchanged.
        rows = torch.arange(adv.shape[0], device=adv.device) if cfg.beta > 0 else (adv != 0).nonzero().squeeze(1)
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
                if cfg.mu > 1:  # sampling-time log-probs for the importance ratio (paper 003, App. A (ii))
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
                    loss, st = policy_loss(
                        logp, old_logp.get(c_i, logp.detach()), adv[idx], sub.completion_mask,
                        clip_low=cfg.clip_low, clip_high=cfg.clip_high, ref_logp=ref_logp.get(c_i), beta=cfg.beta,
                        kl=cfg.kl, aggregation=cfg.aggregation, max_len=cfg.max_new_tokens,
                        num_seqs=N, num_tokens=num_tokens,
                    )
                    if c_i >= real:  # padding pass
                        loss = loss * 0.0
                    # A non-finite loss still runs backward: the ranks stay in step, and the update is skipped below.
                    finite = finite and bool(torch.isfinite(loss))
                    (loss * train.loss_scale).backward()
                if c_i >= real:
                    continue
                n_tok = float(sub.completion_mask.sum())
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
        totals = dict(zip(keys + ["active", "active_tok"],
                          dist_.all_sum([sums[k] for k in keys] + [rows.numel(), float(mask[rows].sum())], world)))
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
                self.policy, self.held_out, samples=cfg.eval_samples, temperature=cfg.temperature,
                max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, world=self.world,
                progress=lambda done, total: self.status(f"eval at step {step}: {done}/{total} completions"),
            )
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.log(f"eval at step {step}: {format_accuracy(metrics)}  ({len(self.held_out)} questions, "
                 f"{cfg.eval_samples} samples each, {metrics['time/eval_s']:.0f} s)")
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
        if self.world.is_main:
            checkpoint.save(out, step, self.policy.model, self.policy.tokenizer, self.optimizer, self.scheduler,
                            {"seed": self.cfg.seed, "world_size": self.world.size, "rollouts_total": self.rollouts_total}, keep=self.cfg.keep_checkpoints,
                            model_state=model_state, optimizer_state=optim_state)
        dist_.barrier(self.world)  # nobody runs ahead of (or resumes from) a checkpoint still being written


def _prepare_run_dir(cfg: TrainConfig) -> tuple[Path, int, Path | None]:
    """Check (and for a new run, create) the run directory. Returns (dir, first step to run, checkpoint to load).

    Only reads and ``mkdir``: every rank runs it before rank 0 writes anything.
    """
    out = Path(cfg.out)
    if cfg.resume:
        ckpts = checkpoint.checkpoint_dirs(out)
        if not ckpts:
            raise ConfigError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
        saved = json.loads((out / "config.json").read_text())
        for key in ("seed", "prompts_per_step", "group_size", "estimator", "aggregation", "model", "sampling"):
            if saved.get(key, "fixed" if key == "sampling" else None) != getattr(cfg, key):
                raise ConfigError(f"--resume: --{key.replace('_', '-')} is {getattr(cfg, key)!r} but the run was started with {saved.get(key)!r}")
        step, path = ckpts[-1]
        return out, step, path
    if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0:
        raise ConfigError(f"--out {out}: already holds a run; pass --resume to continue it or choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    return out, 0, None


def train(cfg: TrainConfig, log=print) -> Path:
    """Run GRPO as configured; returns the run directory.

    Under torchrun (``WORLD_SIZE`` > 1) this process joins the group and trains its share;
    rank 0 alone logs, writes metrics, samples and checkpoints.
    """
    cfg = cfg.resolved()  # model-dependent defaults filled in (and recorded in config.json)
    cfg.validate()
    world = dist_.init(cfg.device)
    cfg.validate_world(world.size)
    if not world.is_main:
        log = _quiet
    out, start, ckpt = _prepare_run_dir(cfg)
    dist_.barrier(world)  # every rank has checked the directory before rank 0 writes to it
    adapter_from = None
    if ckpt is not None and cfg.lora_rank:
        adapter_from = ckpt  # the base as configured, the adapter from the checkpoint
    elif ckpt is not None:
        cfg = dataclasses.replace(cfg, model=str(ckpt), gguf_file="")  # weights from the checkpoint
    # On resume the KL reference is the run's *starting* model, not the checkpoint.
    reference = _reference_for_resume(out) if ckpt is not None and cfg.beta > 0 and not cfg.lora_rank else None
    if cfg.task == "arith-multiturn":
        from grpolab.multiturn.trainer import MultiTurnTrainer

        trainer = MultiTurnTrainer(cfg, log=log, adapter_from=adapter_from, world=world)
    else:
        trainer = GRPOTrainer(cfg, log=log, adapter_from=adapter_from, world=world, reference=reference)
    config_dict = {**dataclasses.asdict(cfg), "model": json.loads((out / "config.json").read_text())["model"] if ckpt else cfg.model,
                   "world_size": world.size}
    if ckpt is not None:
        state = checkpoint.load_training_state(ckpt, trainer.optimizer, trainer.scheduler, model=trainer.policy.model)
        start = state["step"]
        # Checkpoints written before --sampling existed: every step generated B*G rollouts.
        trainer.rollouts_total = state.get("rollouts_total", start * cfg.rollouts_per_step)
        if world.is_main:
            truncate_jsonl(out / "metrics.jsonl", start)
            truncate_jsonl(out / "samples.jsonl", start)
            truncate_jsonl(out / "rollouts.jsonl", start)
        log(f"resuming {out} from step {start}" + (f" on {world.size} processes" if world.distributed else ""))
    elif world.is_main:
        (out / "config.json").write_text(json.dumps({**config_dict, "code_version": git_revision()}, indent=2))

    logger = RunLogger(out, config=config_dict, tensorboard=cfg.tensorboard, wandb=cfg.wandb, warn=log) if world.is_main else None
    try:
        with progress_bar("grpo", cfg.steps, enabled=cfg.progress and world.is_main, start=start) as bar:
            trainer_step = [start]  # the last finished step: what the bar counts while a step or evaluation runs
            trainer.status = lambda text: bar.update(trainer_step[0], text)
            if start == 0:
                metrics, examples = trainer.evaluate(0)
                if logger:
                    logger.log(0, metrics)
                    logger.log_samples(0, [{"kind": "eval", **e} for e in examples])
            spent = bool(cfg.max_rollouts and trainer.rollouts_total >= cfg.max_rollouts)  # resuming a run that reached it
            for step in range(start + 1, (start if spent else cfg.steps) + 1):
                out_step = trainer.step(step)
                metrics = out_step.metrics
                # --max-rollouts: this step reached the budget, so it is the last one (evaluated and saved).
                last = step == cfg.steps or bool(cfg.max_rollouts and trainer.rollouts_total >= cfg.max_rollouts)
                if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                    ev, examples = trainer.evaluate(step)
                    metrics.update(ev)
                    if logger:
                        logger.log_samples(step, [{"kind": "train", **s} for s in out_step.samples])
                        logger.log_samples(step, [{"kind": "eval", **e} for e in examples])
                if logger:
                    logger.log(step, metrics)
                    if out_step.rollouts is not None:
                        logger.log_rollouts(step, out_step.rollouts)
                if (cfg.save_every and step % cfg.save_every == 0) or last:
                    trainer.save(out, step)
                status = f"reward {metrics['reward/mean']:.3f} acc {metrics['reward/accuracy']:.3f}"
                if "eval/accuracy_sampled" in metrics:
                    status += f" | eval greedy {metrics['eval/accuracy_greedy']:.3f} sampled {metrics['eval/accuracy_sampled']:.3f}"
                trainer_step[0] = step
                bar.update(step, status)
                if last:
                    if step < cfg.steps:
                        log(f"--max-rollouts {cfg.max_rollouts}: {trainer.rollouts_total} rollouts generated by step {step}; stopping")
                    break
    finally:
        if logger:
            logger.close()
    return out


def _quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


def _reference_for_resume(out: Path) -> torch.nn.Module:
    """The run's starting model (from its config.json), frozen."""
    saved = json.loads((out / "config.json").read_text())
    start = load_policy(saved["model"], gguf_file=saved.get("gguf_file", ""))
    return start.model.eval().requires_grad_(False)
