"""The GRPO step: sample -> score -> advantages -> update -> log, one step at a time.

The math lives in ``advantages``, ``loss``, ``rewards`` and ``group_budget``; sampling and scoring
in ``collect`` (through a rollout engine, ``engine``); the update in ``update``; the shared
machinery (policy, reference, optimizer, evaluation, checkpoints) in ``trainer_base``; the run
around the steps in ``recipe``. This file calls them in order; the books (per-step metrics and
records) are kept apart, at the end of the file.

On P processes (torchrun) each rank takes a contiguous block of the step's prompts with all
their rollouts (a group never spans ranks, so its baseline needs no communication); rollout
(b, g) draws from the stream keyed by the *global* prompt index b, so the rollouts do not
depend on P. Losses use the whole step's normalisers and gradients are summed over ranks
(grpolab.train_forward), so the update is the single-process update. Metrics are computed from the
gathered per-rollout values, identically on every rank; rank 0 alone writes them.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from grpolab import distributed as dist_
from grpolab.advantages import STD_EPS, batch_std, compute_advantages, estimator_for_scale, ragged_advantages
from grpolab.collect import Collector, CollectSettings, StepRollouts
from grpolab.config import TrainConfig
from grpolab.data.records import question_of
from grpolab.distributed import SINGLE, World
from grpolab.engine import RolloutEngine, build_engine
from grpolab.group_budget import prompt_weights
from grpolab.groups import common_size, offsets, varies
from grpolab.probes.advantage_stats import advantage_stats
from grpolab.probes.gram import score_gram, token_weights
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics
from grpolab.probes.token_credit import credit_aggregates, pick_rollouts, token_segments, token_spans
from grpolab.rewards import Rewarder
from grpolab.rollout import select
from grpolab.trainer_base import StepOutput, TrainerBase
from grpolab.utils import rng_untouched


class GRPOTrainer(TrainerBase):
    """The single-turn trainer: a step samples groups (``grpolab.collect``) and updates on them.

    ``engine``: the rollout engine (default: the one ``cfg.rollout_engine`` names, ``grpolab.engine.build_engine``).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        log=print,
        adapter_from: str | Path | None = None,
        world: World = SINGLE,
        reference: torch.nn.Module | None = None,
        engine: RolloutEngine | None = None,
    ):
        super().__init__(cfg, log=log, adapter_from=adapter_from, world=world, reference=reference)
        cfg, policy = self.cfg, self.policy
        t0 = time.perf_counter()
        self.engine = engine or build_engine(cfg, policy, self.train_module.full_weights)
        if engine is None and cfg.rollout_engine != "hf":
            mode = "compiled" if cfg.vllm_compile else "eager"
            log(f"rollout engine: {cfg.rollout_engine} ({mode}), started in {time.perf_counter() - t0:.0f} s")
        self.reward = Rewarder(self.reward_fns, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        self.collector = Collector(
            self.engine,
            self.sampler,
            policy,
            self.reward,
            CollectSettings.from_config(cfg),
            world,
            status=lambda text: self.status(text),  # self.status is re-pointed by the run
        )

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepOutput:
        t_step = time.perf_counter()
        # 1-2. rollouts and their rewards; --sampling decides how many of which prompts (grpolab.group_budget)
        roll = self.collector.collect(step)
        t_score = time.perf_counter()
        # 3. advantages: one scalar per rollout [Foundations, Thm 3.1]; groups are whole on this rank
        adv = self._advantages(roll)  # [n]
        records = self._records(roll, adv)
        probe = self._probe(step, roll, adv)  # on the policy that sampled
        # 4. loss and update (--log-token-credit: the update keeps the watched rows' per-token values)
        self.status(f"step {step}: update ({self.cfg.mu} x {roll.groups.rows.n} rollouts)")
        rows = roll.groups.rows
        watch = pick_rollouts(adv, roll.groups.sizes, self.cfg.log_token_credit) if self.cfg.log_token_credit else None
        credit, credit_metrics = None, {}
        if roll.rewards:
            update = self._update(rows.batch, self._prompt_weighted(roll, adv), rows.entropy, rows.logprobs, watch)
            if watch is not None:  # what the update did to each watched token's log-prob
                credit, credit_metrics = self._token_credit(roll, adv)
        else:  # no group entered the update (--sampling filter, every round all-equal)
            update = self.updater.skip()
        t_sync = time.perf_counter()
        self.engine.weights_changed()  # the vllm engine takes the new weights here
        t_end = time.perf_counter()
        # 5. the books
        self.rollouts_total += len(roll.generated["reward"])
        times = {
            "time/generate_s": roll.time_generate,
            "time/score_s": roll.time_score,
            "time/update_s": t_sync - t_score,
            "time/sync_s": t_end - t_sync,
            "time/step_s": t_end - t_step,
        }
        metrics = {**step_metrics(roll, self.rollouts_total, update, probe, times), **credit_metrics}
        return StepOutput(
            metrics,
            records["samples"],
            records["rollouts"] if self.cfg.log_rollouts else None,
            credit,
        )

    def _advantages(self, roll: StepRollouts) -> torch.Tensor:
        """``[n]`` this rank's advantages, group by group, under --estimator and --scale-rewards."""
        cfg, groups = self.cfg, roll.groups
        rewards = groups.rows.scores.total.to(self.device)  # [n]
        estimator = estimator_for_scale(cfg.estimator, cfg.scale_rewards)  # --scale-rewards batch|none: from grpo
        G = common_size(groups.sizes)
        if not groups.sizes:
            adv = torch.zeros(0, device=self.device)
        elif G is not None:
            adv = compute_advantages(rewards.view(len(groups.sizes), G), estimator).reshape(-1)  # [n]
        else:
            adv = ragged_advantages(list(rewards.split(groups.sizes)), estimator)  # [n]
        if cfg.scale_rewards == "batch" and roll.rewards:  # the std of every reward in the update, all ranks
            adv = adv / (batch_std(torch.tensor([r for g in roll.rewards for r in g])).to(adv.device) + STD_EPS)
        return adv

    def _prompt_weighted(self, roll: StepRollouts, adv: torch.Tensor) -> torch.Tensor:
        """The advantages the loss uses: with groups of different sizes (--sampling adaptive) each prompt still
        weighs 1/B in the step's mean (``grpolab.group_budget.prompt_weights``); otherwise ``adv`` itself."""
        sizes = [len(r) for r in roll.rewards]  # group sizes of the whole update (all ranks), in its order
        if not sizes or common_size(sizes) is not None:
            return adv
        position = roll.positions
        factor = prompt_weights(sizes)
        groups = roll.groups
        w = torch.cat([torch.full((n,), factor[position[b]]) for b, n in zip(groups.prompt, groups.sizes)])
        return adv * w.to(adv.device, adv.dtype)

    def _records(self, roll: StepRollouts, adv: torch.Tensor) -> dict:
        """The step's samples (first completion of the first --log-samples prompts) and, with --log-rollouts, every
        rollout of the update's groups, in prompt order, on every rank."""
        cfg, groups = self.cfg, roll.groups
        batch, scores, texts = groups.rows.batch, groups.rows.scores, groups.rows.texts
        position = roll.positions
        starts = offsets(groups.sizes)
        local = {"samples": [], "rollouts": []}
        for k, (b, rec) in enumerate(zip(groups.prompt, groups.records)):
            first = starts[k]
            if position[b] < cfg.log_samples:
                sample = {
                    "question": question_of(rec),
                    "completion": texts[first],
                    "reward": scores.total[first].item(),
                }
                local["samples"].append((position[b], sample))
            if cfg.log_rollouts:
                local["rollouts"] += [
                    (position[b], _rollout_record(b, g, rec, texts, batch, scores, adv, first + g))
                    for g in range(groups.sizes[k])
                ]
        parts = dist_.gather(local, self.world)
        return {k: [x for _, x in sorted((x for p in parts for x in p[k]), key=lambda x: x[0])] for k in local}

    def _token_credit(self, roll: StepRollouts, adv: torch.Tensor) -> tuple[list[dict], dict]:
        """After the update: the watched rows' log-probs under the new weights (one forward, on every rank: FSDP's
        forwards are collectives), their records token by token and the ``credit/*`` aggregates (rank 0's rows)."""
        t0 = time.perf_counter()
        watched, batch = self.updater.watched, roll.groups.rows.batch
        with torch.no_grad(), rng_untouched(self.device):
            sub = select(batch, torch.tensor(watched.rows or [0], dtype=torch.long, device=self.device))
            after = self.train_module.logprobs(sub).to(torch.float64)  # [K, T']
        if not self.world.is_main or not watched.rows:
            return [], {}
        groups, starts = roll.groups, offsets(roll.groups.sizes)
        group_of = {starts[k] + g: (k, g) for k in range(len(groups.sizes)) for g in range(groups.sizes[k])}
        out = []
        for k, r in enumerate(watched.rows):
            gk, g = group_of[r]
            head = {
                "prompt": groups.prompt[gk],
                "rollout": g,
                "question": question_of(groups.records[gk]),
                "reward": groups.rows.scores.total[r].item(),
                "advantage": adv[r].item(),
            }
            out.append({**head, **_credit_tokens(self.policy.tokenizer, groups.rows, r, k, watched, after)})

        def recorded(t: torch.Tensor) -> torch.Tensor:  # [K, T] -> [M]: the recorded tokens, rollout after rollout
            return torch.cat([t[k, : len(o["ids"])].cpu() for k, o in enumerate(out)])

        before = recorded(watched.logp)
        segments = [s for o in out for s in o["segment"]]
        metrics = credit_aggregates(recorded(after) - before, recorded(watched.adv), segments, before)
        metrics = {f"credit/{k}": v for k, v in metrics.items()}
        metrics["credit/rollouts"] = len(out)
        metrics["time/credit_s"] = time.perf_counter() - t0
        return out, metrics

    def _probe(self, step: int, roll: StepRollouts, adv: torch.Tensor) -> dict:
        """Advantage statistics every step; the gradient spectrum every ``probe_every`` steps.

        ``roll.rewards``: every group of the update (all ranks, in order); ``roll.groups``, adv ``[n]``:
        this rank's. The spectrum is measured on the first ``probe_groups`` groups with reward
        variance of the whole step, each by the rank that holds it.
        """
        cfg, rewards = self.cfg, roll.rewards
        out = {}
        if rewards and min(len(r) for r in rewards) >= 2:
            stats = advantage_stats([torch.tensor(r) for r in rewards], eps=cfg.probe_eps)
            out = {f"probe/adv_{k}": v for k, v in stats.items()}
        if cfg.probe_every and step % cfg.probe_every == 0:
            t0 = time.perf_counter()
            spectra = dist_.gather_concat(self._spectra(roll, adv), self.world)
            metrics = [m for _, m in sorted(spectra, key=lambda x: x[0])]
            for key, name in (("effective_rank", "eff_rank"), ("top1_fraction", "top1_frac"), ("num_rank", "num_rank")):
                out[f"probe/{name}"] = sum(m[key] for m in metrics) / len(metrics) if metrics else None
            out["probe/groups_measured"] = len(metrics)
            out["time/probe_s"] = time.perf_counter() - t0
        return out

    def _spectra(self, roll: StepRollouts, adv: torch.Tensor) -> list[tuple[int, dict]]:
        """(position in the update, spectrum metrics) of this rank's groups among the first ``probe_groups``
        groups with reward variance of the whole step."""
        cfg, groups, batch = self.cfg, roll.groups, roll.groups.rows.batch
        live = [k for k, r in enumerate(roll.rewards) if varies(r)][: cfg.probe_groups]  # positions in the update
        position = roll.positions
        starts = offsets(groups.sizes)
        out = []
        for k, b in enumerate(groups.prompt):
            if position[b] not in live:
                continue
            start, stop = starts[k], starts[k + 1]
            sub = select(batch, torch.arange(start, stop, device=self.device))
            weights = token_weights(sub.completion_mask, cfg.aggregation, cfg.max_new_tokens)
            psi = score_gram(self.policy.model, sub, weights, temperature=cfg.temperature)
            out.append((position[b], spectrum_metrics(singular_values_from_gram(psi, adv[start:stop].cpu()))))
        return out


# ---------------------------------------------------------------------- the books
def _rollout_record(b, g, rec, texts, batch, scores, adv, row: int) -> dict:
    """One line of rollouts.jsonl."""
    return {
        "prompt": b,
        "rollout": g,
        "question": question_of(rec),
        "completion": texts[row],
        "tokens": int(batch.completion_mask[row].sum()),
        "reward": scores.total[row].item(),
        "advantage": adv[row].item(),
    }


def _credit_tokens(tokenizer, rows, r: int, k: int, watched, after: torch.Tensor) -> dict:
    """The per-token part of one token_credit.jsonl line: row ``r`` of ``rows``, the ``k``-th watched row
    (``after`` ``[K, T']``: the log-probs after the update)."""
    T = int(rows.batch.completion_mask[r].sum())  # completions are right-padded: tokens 0..T-1 are real
    ids = rows.batch.completion_ids[r, :T].tolist()
    spans = token_spans(lambda i: tokenizer.decode(i, skip_special_tokens=True), ids)  # as Policy.decode
    before = watched.logp[k, :T].cpu()

    def floats(t: torch.Tensor | None) -> list | None:  # JSON has no NaN: a value that is not a number is null
        return None if t is None else [v if math.isfinite(v) else None for v in t.double().tolist()]

    return {
        "completion": "".join(spans),
        "tokens": spans,
        "ids": ids,
        "segment": token_segments(spans),
        "dlogp": floats(after[k, :T].cpu() - before),
        "logp": floats(before),
        "logp_sampler": None if rows.logprobs is None else floats(rows.logprobs[r, :T]),
        "entropy": None if rows.entropy is None else floats(rows.entropy[r, :T]),
        "adv": floats(watched.adv[k, :T].cpu()),
        "ratio": floats(watched.ratio[k, :T].cpu()),
        "clipped": watched.clipped[k, :T].tolist(),
    }


def step_metrics(roll: StepRollouts, rollouts_total: int, update: dict, probe: dict, times: dict) -> dict:
    """One step's metrics: rewards and sampling over every rollout generated (all ranks), then the update's, the
    probes', the completions' and the times."""
    gen = roll.generated
    sizes = [len(r) for r in roll.rewards]
    lengths = torch.tensor(gen["length"], dtype=torch.float)  # [every rollout generated]
    reward = torch.tensor(gen["reward"])  # [every rollout generated]
    if common_size(sizes) is not None:
        group_std = torch.tensor(roll.rewards).std(dim=1, unbiased=False)  # [groups]
    else:
        group_std = torch.stack([torch.tensor(r).std(unbiased=False) for r in roll.rewards]) if sizes else None
    return {
        "reward/mean": reward.mean().item(),
        "reward/std": reward.std(unbiased=False).item(),
        "reward/group_std_mean": group_std.mean().item() if sizes else None,
        "reward/frac_zero_std": statistics.fmean(not varies(r) for r in roll.rewards) if sizes else None,
        "reward/accuracy": statistics.fmean(gen["accuracy"]),
        "reward/format": statistics.fmean(gen["format"]),
        "reward/errors": gen["errors"],
        **{f"reward/{k}": v for k, v in sorted(gen["counts"].items())},  # the code reward's outcomes
        **{k: statistics.fmean(v) for k, v in gen.items() if k.startswith("reward/")},  # each --reward-fn
        "sampling/rollouts": reward.numel(),
        "sampling/rollouts_total": rollouts_total,
        "sampling/rounds": roll.rounds,
        "sampling/kept_groups": len(sizes),
        "sampling/short": int(roll.short),
        "sampling/frac_zero_std_drawn": gen["zero_std"],
        "sampling/group_size_mean": statistics.fmean(sizes) if sizes else 0.0,
        "sampling/group_size_max": max(sizes, default=0),
        **update,
        **probe,
        # mean over generated tokens; None when the engine gives no entropies (vllm)
        "policy/entropy": sum(gen["entropy_sum"]) / max(1.0, lengths.sum().item()) if gen["entropy_sum"] else None,
        "completion/len_mean": lengths.mean().item(),
        "completion/len_max": lengths.max().item(),
        "completion/truncated_frac": statistics.fmean(map(float, gen["truncated"])),
        **times,
    }
