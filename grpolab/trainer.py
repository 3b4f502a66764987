"""The GRPO loop: sample -> score -> advantages -> loss -> update, one step at a time, and ``train``, the run.

The math lives in ``advantages``, ``loss``, ``rewards`` and ``sampling``; the shared machinery
(policy, reference, optimizer, update, evaluation, checkpoints) in ``trainer_base``; this file
calls them in order and keeps the books.

On P processes (torchrun) each rank takes a contiguous block of the step's prompts with all
their rollouts (a group never spans ranks, so its baseline needs no communication); rollout
(b, g) draws from the stream keyed by the *global* prompt index b, so the rollouts do not
depend on P. Losses use the whole step's normalisers and gradients are summed over ranks
(grpolab.train_forward), so the update is the single-process update. Metrics are computed from the
gathered per-rollout values, identically on every rank; rank 0 alone writes them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from grpolab import checkpoint
from grpolab import distributed as dist_
from grpolab.advantages import STD_EPS, batch_std, compute_advantages, estimator_for_scale, ragged_advantages
from grpolab.collect import Collector
from grpolab.config import ConfigError, TrainConfig
from grpolab.distributed import SINGLE, World
from grpolab.group_budget import prompt_weights
from grpolab.policy import load_policy
from grpolab.probes.advantage_stats import advantage_stats
from grpolab.probes.gram import score_gram, token_weights
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics
from grpolab.progress import progress_bar
from grpolab.rollout import select
from grpolab.runlog import RunLogger, truncate_jsonl
from grpolab.trainer_base import StepOutput, TrainerBase
from grpolab.utils import git_revision


class GRPOTrainer(TrainerBase):
    """The single-turn trainer: a step samples groups (``grpolab.collect``) and updates on them."""

    def __init__(
        self,
        cfg: TrainConfig,
        log=print,
        adapter_from: str | Path | None = None,
        world: World = SINGLE,
        reference: torch.nn.Module | None = None,
    ):
        super().__init__(cfg, log=log, adapter_from=adapter_from, world=world, reference=reference)
        self.collector = Collector(self)

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepOutput:
        cfg = self.cfg
        t_step = time.perf_counter()

        # 1-2. rollouts and their rewards; --sampling decides how many of which prompts (grpolab.group_budget)
        roll = self.collector.collect(step)
        groups, rows = roll.groups, roll.groups.rows
        batch, scores, texts = rows.batch, rows.scores, rows.texts
        t_score = time.perf_counter()

        # 3. advantages: one scalar per rollout [Foundations, Thm 3.1]; groups are whole on this rank
        estimator = estimator_for_scale(cfg.estimator, cfg.scale_rewards)  # --scale-rewards batch|none: from grpo
        if not groups.sizes:
            adv = torch.zeros(0, device=self.device)
        elif len(set(groups.sizes)) == 1:
            G = groups.sizes[0]
            adv = compute_advantages(scores.total.to(self.device).view(len(groups.sizes), G), estimator).reshape(
                -1
            )  # [n]
        else:
            adv = ragged_advantages(list(scores.total.to(self.device).split(groups.sizes)), estimator)  # [n]
        if cfg.scale_rewards == "batch" and roll.rewards:  # the std of every reward in the update, all ranks
            adv = adv / (batch_std(torch.tensor([r for g in roll.rewards for r in g])).to(adv.device) + STD_EPS)
        position = {b: k for k, b in enumerate(roll.prompts)}  # prompt -> its place among the update's groups
        sizes = [len(r) for r in roll.rewards]  # group sizes of the whole update (all ranks), in its order
        weighted = adv
        if len(set(sizes)) > 1:  # every prompt weighs 1/B whatever its group size (grpolab.group_budget)
            factor = prompt_weights(sizes)
            w = torch.cat([torch.full((n,), factor[position[b]]) for b, n in zip(groups.prompt, groups.sizes)])
            weighted = adv * w.to(adv.device, adv.dtype)

        # The whole step's samples and rollouts of the update's groups, in prompt order, on every rank.
        starts = [0]
        for n in groups.sizes:
            starts.append(starts[-1] + n)
        local = {
            "samples": [
                (
                    position[b],
                    {
                        "question": rec["question"],
                        "completion": texts[starts[k]],
                        "reward": scores.total[starts[k]].item(),
                    },
                )
                for k, (b, rec) in enumerate(zip(groups.prompt, groups.records))
                if position[b] < cfg.log_samples
            ],
            "rollouts": [
                (
                    position[b],
                    {
                        "prompt": b,
                        "rollout": g,
                        "question": rec["question"],
                        "completion": texts[starts[k] + g],
                        "tokens": int(batch.completion_mask[starts[k] + g].sum()),
                        "reward": scores.total[starts[k] + g].item(),
                        "advantage": adv[starts[k] + g].item(),
                    },
                )
                for k, (b, rec) in enumerate(zip(groups.prompt, groups.records))
                for g in range(groups.sizes[k])
            ]
            if cfg.log_rollouts
            else [],
        }
        parts = dist_.gather(local, self.world)
        whole = {
            k: [x for _, x in sorted((x for p in parts for x in p[k]), key=lambda x: x[0])] for k in local
        }  # stable sort

        probe = self._probe(step, roll, adv)  # on the policy that sampled

        # 4. loss and update
        self.status(f"step {step}: update ({cfg.mu} x {rows.n} rollouts)")
        update = self._update(batch, weighted, rows.entropy) if roll.rewards else self._no_update()
        t_end = time.perf_counter()

        gen = roll.generated
        lengths = torch.tensor(gen["length"], dtype=torch.float)  # [every rollout generated]
        reward = torch.tensor(gen["reward"])  # [every rollout generated]
        group_std = (
            torch.tensor(roll.rewards).std(dim=1, unbiased=False)
            if len(set(sizes)) == 1
            else torch.stack([torch.tensor(r).std(unbiased=False) for r in roll.rewards])
            if sizes
            else None
        )  # [groups]
        self.rollouts_total += reward.numel()
        metrics = {
            "reward/mean": reward.mean().item(),
            "reward/std": reward.std(unbiased=False).item(),
            "reward/group_std_mean": group_std.mean().item() if sizes else None,
            "reward/frac_zero_std": statistics.fmean(len(set(r)) == 1 for r in roll.rewards) if sizes else None,
            "reward/accuracy": statistics.fmean(gen["accuracy"]),
            "reward/format": statistics.fmean(gen["format"]),
            "reward/errors": gen["errors"],
            **{k: statistics.fmean(v) for k, v in gen.items() if k.startswith("reward/")},  # each --reward-fn
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
            "policy/entropy": sum(gen["entropy_sum"]) / max(1.0, lengths.sum().item()),  # mean over generated tokens
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
                    psi = score_gram(
                        self.policy.model,
                        sub,
                        token_weights(sub.completion_mask, cfg.aggregation, cfg.max_new_tokens),
                        temperature=cfg.temperature,
                    )
                    metrics.append(
                        (position[b], spectrum_metrics(singular_values_from_gram(psi, adv[start : start + n].cpu())))
                    )
                start += n
            metrics = [m for _, m in sorted(dist_.gather_concat(metrics, self.world), key=lambda x: x[0])]
            for key, name in (("effective_rank", "eff_rank"), ("top1_fraction", "top1_frac"), ("num_rank", "num_rank")):
                out[f"probe/{name}"] = sum(m[key] for m in metrics) / len(metrics) if metrics else None
            out["probe/groups_measured"] = len(metrics)
            out["time/probe_s"] = time.perf_counter() - t0
        return out


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT stopped the run after a finished step, whose checkpoint was written."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {path}")


class _StopSignals:
    """While training: the first SIGTERM/SIGINT asks the loop to stop after the current step; a second one
    exits at once (the signal's default action). Handlers are only installed in the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
            "(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _prepare_run_dir(cfg: TrainConfig, log=print) -> tuple[Path, int, Path | None]:
    """Check (and for a new run, create) the run directory. Returns (dir, first step to run, checkpoint to load):
    on --resume the newest *intact* checkpoint (a damaged newer one is named in a warning and skipped).

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
                raise ConfigError(
                    f"--resume: --{key.replace('_', '-')} is {getattr(cfg, key)!r} but the run was started with {saved.get(key)!r}"
                )
        try:
            step, path = checkpoint.newest_intact(out, warn=log)
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"--resume: {e}") from None
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
    out, start, ckpt = _prepare_run_dir(cfg, log)
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
    config_dict = {
        **dataclasses.asdict(cfg),
        "model": json.loads((out / "config.json").read_text())["model"] if ckpt else cfg.model,
        "world_size": world.size,
    }
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

    logger = (
        RunLogger(out, config=config_dict, tensorboard=cfg.tensorboard, wandb=cfg.wandb, warn=log)
        if world.is_main
        else None
    )
    try:
        with (
            _StopSignals() as stop,
            progress_bar(
                "step", cfg.steps, enabled=cfg.progress and world.is_main, start=start, every=cfg.log_every, unit="step"
            ) as bar,
        ):
            trainer_step = [start]  # the last finished step: what the bar counts while a step or evaluation runs
            trainer.status = lambda text: bar.update(trainer_step[0], text)
            if start == 0:
                metrics, examples = trainer.evaluate(0)
                if logger:
                    logger.log(0, metrics)
                    logger.log_samples(0, [{"kind": "eval", **e} for e in examples])
            spent = bool(
                cfg.max_rollouts and trainer.rollouts_total >= cfg.max_rollouts
            )  # resuming a run that reached it
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
                saved = (cfg.save_every and step % cfg.save_every == 0) or last
                if saved:
                    trainer.save(out, step)
                status = f"reward {metrics['reward/mean']:.3f}  acc {metrics['reward/accuracy']:.3f}"
                evaluated = "eval/accuracy_sampled" in metrics
                if evaluated:
                    status += f"  eval greedy {metrics['eval/accuracy_greedy']:.3f} sampled {metrics['eval/accuracy_sampled']:.3f}"
                trainer_step[0] = step
                bar.update(step, status, force=evaluated)
                if last:
                    if step < cfg.steps:
                        log(
                            f"--max-rollouts {cfg.max_rollouts}: {trainer.rollouts_total} rollouts generated by step {step}; stopping"
                        )
                    break
                signum = dist_.all_max(stop.signum, world)  # every rank stops after the same step
                if signum:
                    if not saved:
                        trainer.save(out, step)
                    path = out / "checkpoints" / f"step_{step}"
                    log(
                        f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path}; "
                        f"continue with --resume"
                    )
                    raise TrainingInterrupted(signum, step, path)
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
