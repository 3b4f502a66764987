"""The GRPO step: sample -> score -> advantages -> update -> log, one step at a time.

The math lives in ``advantages``, ``loss``, ``rewards`` and ``group_budget``; sampling and scoring
in ``collect`` (through a rollout engine, ``engine``); the update in ``update``; the shared
machinery (policy, reference, optimizer, evaluation, checkpoints) in ``trainer_base``; the run
around the steps in ``recipe``. This file calls them in order; the books (per-step metrics and
records) are kept apart, in ``books``.

On P processes (torchrun) each rank takes a contiguous block of the step's prompts with all
their rollouts (a group never spans ranks, so its baseline needs no communication); rollout
(b, g) draws from the stream keyed by the *global* prompt index b, so the rollouts do not
depend on P. Losses use the whole step's normalisers and gradients are summed over ranks
(grpolab.training.forward), so the update is the single-process update. Metrics are computed from the
gathered per-rollout values, identically on every rank; rank 0 alone writes them.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from grpolab.algo.advantages import STD_EPS, batch_std, compute_advantages, estimator_for_scale, ragged_advantages
from grpolab.algo.group_budget import prompt_weights
from grpolab.algo.groups import common_size, offsets, varies
from grpolab.common import distributed as dist_
from grpolab.common.batch import select
from grpolab.common.distributed import SINGLE, World
from grpolab.common.rng import rng_untouched
from grpolab.config.train import TrainConfig
from grpolab.data.records import question_of
from grpolab.env.credit import episode_credit, mc_values
from grpolab.probes.advantage_stats import advantage_stats
from grpolab.probes.gram import score_gram, token_weights
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics
from grpolab.probes.token_credit import credit_row, join_credit_rows, pick_rollouts, record_aggregates
from grpolab.rewards.rewarder import close_reward
from grpolab.rollout.collect import Collector, CollectSettings, StepRollouts
from grpolab.rollout.engine import RolloutEngine, build_engine
from grpolab.rollout.rows import rollout_lengths
from grpolab.rollout.service import RolloutService
from grpolab.training.books import episode_fields, rollout_record, step_metrics
from grpolab.training.trainer_base import StepOutput, TrainerBase


class GRPOTrainer(TrainerBase):
    """The trainer: a step samples groups of rollouts, single-turn or episodes of an environment
    (``grpolab.rollout.collect``, ``grpolab.env``), and updates on them.

    ``engine``: the rollout engine (default: the one ``cfg.engine.rollout_engine`` names, ``grpolab.rollout.engine.build_engine``).
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
        self.engine = engine or build_engine(cfg.engine, cfg.run.seed, policy, self.train_module.full_weights)
        if engine is None and cfg.engine.rollout_engine != "hf":
            mode = "compiled" if cfg.engine.vllm_compile else "eager"
            log(f"rollout engine: {cfg.engine.rollout_engine} ({mode}), started in {time.perf_counter() - t0:.0f} s")
        # single-turn rollouts, or episodes of the run's environment; evaluation plays them too
        # every rollout of the run (training's, evaluation's, rtg-mc's branches) is drawn here
        self.service = RolloutService(self.engine, policy, self.reward, self.env)
        self.collector = Collector(
            self.service,
            self.sampler,
            CollectSettings.of(cfg.groups, cfg.generation, cfg.run.seed),
            world,
            status=lambda text: self.status(text),  # self.status is re-pointed by the run
        )

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> StepOutput:
        t_step = time.perf_counter()
        # 1-2. rollouts (episodes) and their rewards; --sampling decides how many of which prompts
        roll = self.collector.collect(step)
        t_score = time.perf_counter()
        # 3. advantages: one scalar per rollout [Foundations, Thm 3.1], or per turn of an episode (--advantage);
        # groups are whole on this rank
        adv, token_adv = self._advantages(roll, step)  # [n], [m, T] (episodes) or None
        records = self._records(roll, adv)
        probe = self._probe(step, roll, adv, token_adv)  # on the policy that sampled
        # 4. loss and update (--log-token-credit: the update keeps the watched rows' per-token values)
        rows = roll.groups.rows
        self.status(f"step {step}: update ({self.cfg.objective.mu} x {rows.n} rollouts)")
        watch = (
            pick_rollouts(adv, roll.groups.sizes, self.cfg.probe.log_token_credit)
            if self.cfg.probe.log_token_credit
            else None
        )
        credit, credit_metrics = None, {}
        if roll.rewards:
            update = self._update(
                rows.batch,
                self._prompt_weighted(roll, adv if token_adv is None else token_adv),
                rows.entropy,
                rows.logprobs,
                None if watch is None else rows.rows_of(watch),
                action=rows.action,
                cut=self._cut_rows(rows),
            )
            if watch is not None:  # what the update did to each watched token's log-prob
                credit, credit_metrics = self._token_credit(roll, adv, watch)
        else:  # no group entered the update (--sampling filter, every round all-equal)
            update = self.updater.skip()
        t_sync = time.perf_counter()
        self.service.weights_changed()  # the vllm engine takes the new weights here
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
        if self.service.multi_turn:
            times["time/env_s"] = self.service.pop_env_time()
        metrics = {**step_metrics(roll, self.rollouts_total, update, probe, times), **credit_metrics}
        return StepOutput(
            metrics,
            records["samples"],
            records["rollouts"] if self.cfg.logging.log_rollouts else None,
            credit,
        )

    def close(self) -> None:
        """Stop what the run started (the tool worker, the code reward's sandbox)."""
        self.service.close()
        close_reward([self._own_eval_reward])

    def _advantages(self, roll: StepRollouts, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n]`` this rank's advantages, group by group, under --estimator and --scale-rewards; for episodes also
        ``[m, T]`` each policy token's, its turn's under --advantage (``[n]`` then holds each rollout's first
        turn's)."""
        cfg, groups = self.cfg, roll.groups
        rewards = groups.rows.scores.total.to(self.device)  # [n]
        estimator = estimator_for_scale(
            cfg.objective.estimator, cfg.objective.scale_rewards
        )  # --scale-rewards batch|none: from grpo
        self._turn_adv = None
        if groups.rows.episodes is not None:
            return self._episode_advantages(roll, estimator, step)
        G = common_size(groups.sizes)
        if not groups.sizes:
            adv = torch.zeros(0, device=self.device)
        elif G is not None:
            adv = compute_advantages(rewards.view(len(groups.sizes), G), estimator).reshape(-1)  # [n]
        else:
            adv = ragged_advantages(list(rewards.split(groups.sizes)), estimator)  # [n]
        if cfg.objective.scale_rewards == "batch" and roll.rewards:  # the std of every reward in the update, all ranks
            adv = adv / (self._batch_std(roll) + STD_EPS)
        return adv, None

    def _batch_std(self, roll: StepRollouts) -> torch.Tensor:
        return batch_std(torch.tensor([r for g in roll.rewards for r in g])).to(self.device)

    def _episode_advantages(self, roll: StepRollouts, estimator: str, step: int):
        """Episodes: each turn's advantage under --advantage (rtg-mc: with values from branched continuations)."""
        cfg, groups = self.cfg, roll.groups
        values = None
        if cfg.objective.advantage == "rtg-mc" and groups.sizes:
            values = mc_values(
                self.service,
                groups.rows,
                groups.sizes,
                cfg.objective.branches,
                self.collector.settings.sampling,
                status=self.status,
            )
        credit = episode_credit(groups.rows, groups.sizes, estimator, cfg.objective.advantage, values)
        self._turn_adv = credit.turns  # for rollouts.jsonl
        first, token = credit.first.to(self.device), credit.token
        if cfg.objective.scale_rewards == "batch" and roll.rewards:
            scale = self._batch_std(roll) + STD_EPS
            first, token = first / scale, (None if token is None else token / scale.cpu())
        return first, (None if token is None else token.to(self.device))

    def _cut_rows(self, rows) -> torch.Tensor | None:
        """``[m]`` (episodes) whether each token row's episode was cut by a limit (--mask-truncated drops them)."""
        if rows.episodes is None:
            return None
        cut = [e.cut for e, k in zip(rows.episodes, rows.counts) for _ in range(k)]
        return torch.tensor(cut or [False] * (rows.batch.completion_ids.shape[0] if rows.batch is not None else 0))

    def _prompt_weighted(self, roll: StepRollouts, adv: torch.Tensor) -> torch.Tensor:
        """The advantages the loss uses (``[n]``, or ``[m, T]`` for episodes' token rows): with groups of different
        sizes (--sampling adaptive) each prompt still weighs 1/B in the step's mean
        (``grpolab.algo.group_budget.prompt_weights``); otherwise ``adv`` itself."""
        sizes = [len(r) for r in roll.rewards]  # group sizes of the whole update (all ranks), in its order
        if not sizes or common_size(sizes) is not None:
            return adv
        position = roll.positions
        factor = prompt_weights(sizes)
        groups = roll.groups
        w = torch.cat([torch.full((n,), factor[position[b]]) for b, n in zip(groups.prompt, groups.sizes)])
        if adv.dim() == 2:  # token rows: each row takes its rollout's weight
            w = torch.repeat_interleave(w, torch.tensor(groups.rows.counts))[:, None]
        return adv * w.to(adv.device, adv.dtype)

    def _records(self, roll: StepRollouts, adv: torch.Tensor) -> dict:
        """The step's samples (first completion of the first --log-samples prompts) and, with --log-rollouts, every
        rollout of the update's groups, in prompt order, on every rank. An episode's also show its conversation,
        its turns' rewards and, with --log-rollouts, their advantages."""
        cfg, groups = self.cfg, roll.groups
        rows = groups.rows
        tokens = rollout_lengths(rows)
        position = roll.positions
        starts = offsets(groups.sizes)
        local = {"samples": [], "rollouts": []}
        for k, (b, rec) in enumerate(zip(groups.prompt, groups.records)):
            first = starts[k]
            if position[b] < cfg.logging.log_samples:
                sample = {
                    "question": question_of(rec),
                    "completion": rows.texts[first],
                    "reward": rows.scores.total[first].item(),
                    **episode_fields(rows, first),
                }
                local["samples"].append((position[b], sample))
            if cfg.logging.log_rollouts:
                local["rollouts"] += [
                    (position[b], rollout_record(b, g, rec, rows, tokens, adv, first + g, self._turn_adv))
                    for g in range(groups.sizes[k])
                ]
        parts = dist_.gather(local, self.world)
        return {k: [x for _, x in sorted((x for p in parts for x in p[k]), key=lambda x: x[0])] for k in local}

    def _token_credit(self, roll: StepRollouts, adv: torch.Tensor, watch: list[int]) -> tuple[list[dict], dict]:
        """After the update: the watched rollouts' log-probs under the new weights (one forward over their token rows,
        on every rank: FSDP's forwards are collectives), their records token by token and the ``credit/*``
        aggregates (rank 0's rollouts). An episode's record runs through its rows, the environment's tokens as
        context with no values."""
        t0 = time.perf_counter()
        watched, rows = self.updater.watched, roll.groups.rows
        with torch.no_grad(), rng_untouched(self.device):
            sub = select(rows.batch, torch.tensor(watched.rows or [0], dtype=torch.long, device=self.device))
            after = self.train_module.logprobs(sub).to(torch.float64)  # [K, T']
        if not self.world.is_main or not watched.rows:
            return [], {}
        groups, starts = roll.groups, offsets(roll.groups.sizes)
        group_of = {starts[k] + g: (k, g) for k in range(len(groups.sizes)) for g in range(groups.sizes[k])}
        slot = watched.slot
        out = []
        for i in watch:
            gk, g = group_of[i]
            head = {
                "prompt": groups.prompt[gk],
                "rollout": g,
                "question": question_of(groups.records[gk]),
                "reward": rows.scores.total[i].item(),
                "advantage": adv[i].item(),
            }
            parts = [
                credit_row(self.policy.tokenizer, rows, r, slot[r], watched, after, context_prompt=j > 0)
                for j, r in enumerate(rows.rows_of([i]))
            ]
            out.append({**head, **join_credit_rows(parts)})
        metrics = {f"credit/{k}": v for k, v in record_aggregates(out).items()}
        metrics["credit/rollouts"] = len(out)
        metrics["time/credit_s"] = time.perf_counter() - t0
        return out, metrics

    def _probe(self, step: int, roll: StepRollouts, adv: torch.Tensor, token_adv: torch.Tensor | None) -> dict:
        """Advantage statistics every step; the gradient spectrum every ``probe_every`` steps.

        ``roll.rewards``: every group of the update (all ranks, in order); ``roll.groups``, adv ``[n]``
        (``token_adv`` ``[m, T]`` for episodes): this rank's. The spectrum is measured on the first ``probe_groups``
        groups with reward variance of the whole step, each by the rank that holds it.
        """
        cfg, rewards = self.cfg, roll.rewards
        out = {}
        if rewards and min(len(r) for r in rewards) >= 2:
            stats = advantage_stats([torch.tensor(r) for r in rewards], eps=cfg.probe.probe_eps)
            out = {f"probe/adv_{k}": v for k, v in stats.items()}
        if cfg.probe.probe_every and step % cfg.probe.probe_every == 0:
            t0 = time.perf_counter()
            spectra = dist_.gather_concat(self._spectra(roll, adv, token_adv), self.world)
            metrics = [m for _, m in sorted(spectra, key=lambda x: x[0])]
            for key, name in (("effective_rank", "eff_rank"), ("top1_fraction", "top1_frac"), ("num_rank", "num_rank")):
                out[f"probe/{name}"] = sum(m[key] for m in metrics) / len(metrics) if metrics else None
            out["probe/groups_measured"] = len(metrics)
            out["time/probe_s"] = time.perf_counter() - t0
        return out

    def _spectra(self, roll: StepRollouts, adv: torch.Tensor, token_adv: torch.Tensor | None) -> list[tuple[int, dict]]:
        """(position in the update, spectrum metrics) of this rank's groups among the first ``probe_groups``
        groups with reward variance of the whole step. An episode's score vector sums its token rows', each token
        weighted by its turn's advantage (the rows of G = diag(A) Psi^(1/2) generalised to per-turn credit)."""
        cfg, groups, rows = self.cfg, roll.groups, roll.groups.rows
        live = [k for k, r in enumerate(roll.rewards) if varies(r)][: cfg.probe.probe_groups]  # positions in the update
        position = roll.positions
        starts = offsets(groups.sizes)
        out = []
        for k, b in enumerate(groups.prompt):
            if position[b] not in live:
                continue
            start, stop = starts[k], starts[k + 1]
            idx = torch.tensor(rows.rows_of(list(range(start, stop))), device=self.device)
            sub = select(rows.batch, idx)
            weights = token_weights(
                rows.loss_tokens[idx, : sub.completion_ids.shape[1]], cfg.objective.aggregation, self._max_len
            )
            if token_adv is None:
                psi, a = (
                    score_gram(self.policy.model, sub, weights, temperature=cfg.generation.temperature),
                    adv[start:stop].cpu(),
                )
            else:  # per-turn credit folded into the weights; rows summed into their episode
                weights = weights * token_adv[idx, : weights.shape[1]].to(weights)
                psi = _rows_to_rollouts(
                    score_gram(self.policy.model, sub, weights, temperature=cfg.generation.temperature),
                    rows.counts[start:stop],
                )
                a = torch.ones(stop - start, dtype=torch.float64)
            out.append((position[b], spectrum_metrics(singular_values_from_gram(psi, a))))
        return out

    @property
    def _max_len(self) -> int:
        """The constant length of Dr. GRPO's normaliser: --max-new-tokens, or an episode's token bound."""
        return self.cfg.max_policy_tokens


def _rows_to_rollouts(psi: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The Gram matrix of rollouts ``[n, n]`` from that of their token rows ``[m, m]`` (rollout i's score vector is
    the sum of its ``counts[i]`` rows'): S psi S^T."""
    S = torch.zeros(len(counts), psi.shape[0], dtype=psi.dtype)
    start = offsets(counts)
    for i in range(len(counts)):
        S[i, start[i] : start[i + 1]] = 1.0
    return S @ psi @ S.T
