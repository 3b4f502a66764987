"""What watches a training step (``grpolab.training.step.StepObserver``): the rollout logs, the in-training probes
[Foundations] and the token-credit records. The trainer calls them; it does not know what they measure.

- :class:`RolloutLog`: the step's samples and, with --log-rollouts, every rollout (samples.jsonl, rollouts.jsonl);
- :class:`AdvantageProbe`: the zero-sum advantage statistics every step (``probe/adv_*``) [Foundations, Thm 4.1];
- :class:`SpectrumProbe`: the spectrum of the per-rollout gradient matrix every --probe-every steps
  (``probe/eff_rank``, ``probe/top1_frac``) [Foundations, Sec. 7], and the best group size at a fixed rollout
  budget estimated on the same groups (``probe/g_star``) [U-statistic, Thm 7];
- :class:`TokenCredit`: --log-token-credit K rollouts token by token, and what the update did to each token;
- :class:`grpolab.training.hacking.HackingWatch`: the early signs of reward hacking (``hacking/*``).

:func:`observers_for` gives the ones a run's config asks for.
"""

from __future__ import annotations

import math
import time

import torch

from grpolab.algo.advantages import compute_advantages
from grpolab.algo.groups import offsets, varies
from grpolab.algo.loss import effective_aggregation
from grpolab.common import distributed as dist_
from grpolab.common.batch import select
from grpolab.common.distributed import World
from grpolab.common.rng import rng_untouched
from grpolab.data.images import shown_images
from grpolab.data.records import question_of
from grpolab.probes.advantage_stats import advantage_stats
from grpolab.probes.gram import score_gram, token_weights
from grpolab.probes.mse import groupsize_constants, loo_vector, optimal_group_size, prompt_moments, sketch_dim_for
from grpolab.probes.spectrum import advantage_effective_rank, singular_values_from_gram, spectrum_metrics
from grpolab.probes.token_credit import credit_row, join_credit_rows, pick_rollouts, record_aggregates
from grpolab.rollout.rows import rollout_lengths, truncated_flags
from grpolab.training.books import episode_fields, rollout_record
from grpolab.training.hacking import HackingWatch
from grpolab.training.optim import exact_weights
from grpolab.training.step import StepObserver, StepResult


class RolloutLog(StepObserver):
    """The step's samples (first completion of the first ``samples`` prompts) and, with ``every``, every rollout of
    the update's groups, in prompt order, on every rank. An episode's also show its conversation, its turns'
    rewards and, with ``every``, their advantages."""

    def __init__(self, samples: int, every: bool, world: World, eos_id: int | None = None):
        self.samples, self.every, self.world, self.eos_id = samples, every, world, eos_id

    def before_update(self, result: StepResult) -> None:
        roll, adv = result.collected, result.advantages
        groups = roll.groups
        rows = groups.rows
        tokens = rollout_lengths(rows)
        cut = truncated_flags(rows, self.eos_id) if self.eos_id is not None else None  # what the doctor shows
        position = roll.positions
        starts = offsets(groups.sizes)
        local = {"samples": [], "rollouts": []}
        for k, (b, rec) in enumerate(zip(groups.prompt, groups.records)):
            first = starts[k]
            if position[b] < self.samples:
                sample = {
                    "question": question_of(rec),
                    "completion": rows.texts[first],
                    "reward": rows.scores.total[first].item(),
                    "tokens": int(tokens[first]),
                    **({"truncated": bool(cut[first])} if cut else {}),
                    **episode_fields(rows, first),
                    **shown_images(rec),
                }
                local["samples"].append((position[b], sample))
            if self.every:
                version = {} if result.weights_version is None else {"weights": result.weights_version}
                local["rollouts"] += [
                    (
                        position[b],
                        {**rollout_record(b, g, rec, rows, tokens, adv.rollout, first + g, adv.turns), **version},
                    )
                    for g in range(groups.sizes[k])
                ]
        parts = dist_.gather(local, self.world)
        ordered = {k: [x for _, x in sorted((x for p in parts for x in p[k]), key=lambda x: x[0])] for k in local}
        result.samples = ordered["samples"]
        result.rollouts = ordered["rollouts"] if self.every else None


class AdvantageProbe(StepObserver):
    """Zero-sum advantage statistics of every group of the update (all ranks) [Foundations, Thm 4.1], every step:
    ``eps`` is the threshold of an epsilon-effective rollout."""

    def __init__(self, eps: float):
        self.eps = eps

    def before_update(self, result: StepResult) -> None:
        rewards = result.collected.rewards
        if rewards and min(len(r) for r in rewards) >= 2:
            stats = advantage_stats([torch.tensor(r) for r in rewards], eps=self.eps)
            result.metrics.update({f"probe/adv_{k}": v for k, v in stats.items()})


class SpectrumProbe(StepObserver):
    """Every ``every`` steps, on the policy that sampled: the spectrum of the per-rollout gradient matrix of the
    first ``groups`` groups with reward variance of the whole step, each measured by the rank that holds it, with
    the loss's per-token weights (``aggregation``, ``max_len``) [Foundations, Sec. 7]."""

    def __init__(
        self,
        model,
        every: int,
        groups: int,
        aggregation: str,
        max_len: int,
        temperature: float,
        world,
        device,
        estimator: str = "grpo",
        g_star: bool = True,
    ):
        self.model, self.every, self.groups = model, every, groups
        self.aggregation, self.max_len, self.temperature = aggregation, max_len, temperature
        self.world, self.device, self.estimator = world, device, estimator
        self.g_star = g_star
        self._params: dict | None = None  # see _trained
        self._sketch_dim = 0

    def before_update(self, result: StepResult) -> None:
        if result.step % self.every:
            return
        t0 = time.perf_counter()
        moments, vectors = [], []
        spectra = dist_.gather_concat(self._spectra(result, moments, vectors), self.world)
        if self.g_star:
            result.metrics["probe/g_star"] = self._g_star(moments, vectors)
        metrics = [m for _, m in sorted(spectra, key=lambda x: x[0])]
        for key, name in (("effective_rank", "eff_rank"), ("top1_fraction", "top1_frac"), ("num_rank", "num_rank")):
            result.metrics[f"probe/{name}"] = _mean([m[key] for m in metrics])
        halves = [h for m in metrics for h in m.get("halves", []) if h["reward_std"] > 0]
        result.metrics["probe/eff_rank_half"] = _mean([h["effective_rank"] for h in halves])
        result.metrics["probe/eff_rank_vanilla"] = _mean(
            [m["vanilla"]["effective_rank"] for m in metrics if "vanilla" in m]
        )
        result.metrics["probe/groups_measured"] = len(metrics)
        result.metrics["time/probe_s"] = time.perf_counter() - t0
        result.probe = [{"prompt": k, **m} for k, m in sorted(spectra, key=lambda x: x[0])]

    def _spectra(self, result: StepResult, moments: list, vectors: list) -> list[tuple[int, dict]]:
        """(position in the update, spectrum metrics) of this rank's measured groups. An episode's score vector sums
        its token rows', each token weighted by its turn's advantage (the rows of G = diag(A) Psi^(1/2) generalised
        to per-turn credit).

        G*'s sample is the update's first ``groups`` groups whatever their rewards (choosing groups by their rewards,
        as the spectrum does, would bias the moments): for each of them of 3 or more single-turn rollouts on this
        rank, ``moments`` gains its (position, U-statistic moments) and ``vectors`` its leave-one-out gradient. A
        group with equal rewards costs nothing: every moment G* uses is 0, and so is mu_hat."""
        roll, adv = result.collected, result.advantages
        groups, rows = roll.groups, roll.groups.rows
        live = [k for k, r in enumerate(roll.rewards) if varies(r)][: self.groups]  # positions in the update
        position = roll.positions
        starts = offsets(groups.sizes)
        out = []
        for k, b in enumerate(groups.prompt):
            start, stop = starts[k], starts[k + 1]
            sampled = self.g_star and position[b] < self.groups and adv.token is None and stop - start >= 3
            if position[b] not in live:
                if sampled:
                    moments.append((position[b], {"O2": 0.0, "H2": 0.0, "mu2": 0.0}))
                    vectors.append(torch.zeros(self._width()))
                continue
            idx = torch.tensor(rows.rows_of(list(range(start, stop))), device=self.device)
            sub = select(rows.batch, idx)
            weights = token_weights(
                rows.loss_tokens[idx, : sub.completion_ids.shape[1]], self.aggregation, self.max_len
            )
            rewards = torch.tensor(roll.rewards[position[b]], dtype=torch.float64)
            if adv.token is None:
                psi = score_gram(self.model, sub, weights, temperature=self.temperature)
                out.append((position[b], group_spectra(psi, adv.rollout[start:stop].cpu(), rewards, self.estimator)))
                if sampled:
                    moments.append((position[b], prompt_moments(self._plain_gram(psi, weights, sub), rewards)))
                    vectors.append(self._loo_vector(sub, rewards).cpu())
            else:  # per-turn credit folded into the weights; rows summed into their episode
                weights = weights * adv.token[idx, : weights.shape[1]].to(weights)
                psi = _rows_to_rollouts(
                    score_gram(self.model, sub, weights, temperature=self.temperature), rows.counts[start:stop]
                )
                a = torch.ones(stop - start, dtype=torch.float64)
                out.append((position[b], {**_spread(rewards), **spectrum_metrics(singular_values_from_gram(psi, a))}))
        return out

    def _plain_gram(self, psi: torch.Tensor, weights: torch.Tensor, sub) -> torch.Tensor:
        """The Gram matrix ``[G, G]`` of the rollouts' plain scores (weight 1 per completion token), which the
        U-statistic moments need: ``psi / c^2`` when the loss's weights are one constant c on every completion token
        (token-mean, Dr. GRPO's), else a Gram pass of its own."""
        plain = sub.completion_mask.to(weights)
        on = weights[plain > 0]
        if on.numel() and bool((on == on[0]).all()) and bool((weights[plain == 0] == 0).all()):
            return (psi / float(on[0]) ** 2).cpu()
        return score_gram(self.model, sub, plain, temperature=self.temperature).cpu()

    def _trained(self) -> dict:
        """The trained parameters by name (LoRA: the adapters'), the blocks of mu_hat; read at the first probe, after
        the trainer's LoRA or freezing. Vectors wider than 1 GB for the probe's groups are CountSketched."""
        if self._params is None:
            self._params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
            self._sketch_dim = sketch_dim_for(self.groups, sum(p.numel() for p in self._params.values()))
        return self._params

    def _width(self) -> int:
        """mu_hat's length: the sketch's, or the trained parameters' count (the same on every rank)."""
        params = self._trained()
        return self._sketch_dim or sum(p.numel() for p in params.values())

    def _loo_vector(self, sub, rewards: torch.Tensor) -> torch.Tensor:
        params = self._trained()
        return loo_vector(self.model, sub, rewards.to(self.device), params, self.temperature, self._sketch_dim)

    def _g_star(self, moments: list, vectors: list) -> float | None:
        """G* = 1 + sqrt(2 tau^2 / sigma_P^2) from the measured groups' moments and the cross products of their
        leave-one-out gradients (``grpolab.probes.mse``), as ``grpolab groupsize`` estimates it from a pool; None
        with fewer than two groups of 3 or more rollouts, or no prompt-sampling variance (sigma_P^2 <= 0)."""
        local = torch.stack(vectors).double() if vectors else torch.zeros(0, self._width(), dtype=torch.float64)
        cross = dist_.gram(local.to(self.device), self.world).cpu()  # [M, M], rank order; every rank calls it
        pairs = dist_.gather_concat(moments, self.world)  # [(position, moments)], rank order
        if len(pairs) < 2:
            return None
        order = torch.tensor(sorted(range(len(pairs)), key=lambda i: pairs[i][0]))  # by position: P-independent
        c = groupsize_constants([pairs[i][1] for i in order.tolist()], cross[order][:, order])
        g = optimal_group_size(c)
        return g if math.isfinite(g) else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _spread(rewards: torch.Tensor) -> dict:
    return {"G": len(rewards), "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False))}


def group_spectra(psi: torch.Tensor, adv: torch.Tensor, rewards: torch.Tensor, estimator: str) -> dict:
    """One group's record from its score Gram matrix Psi ``[G, G]``: its rewards' spread, the spectrum of G = rows
    A_i psi_i with the update's advantages, the advantages' own effective rank, the spectrum with vanilla's A = r
    (no baseline: [Foundations, Sec. 8]'s first question), and, for an even G, each half's spectrum as a group of
    G/2 (the rollouts are i.i.d., so each half is a group of that size: its advantages recomputed by ``estimator``
    from its own rewards, its Gram matrix the principal block of Psi)."""
    rec = {**_spread(rewards), "adv_effective_rank": advantage_effective_rank(adv)}
    rec.update(spectrum_metrics(singular_values_from_gram(psi, adv)))
    rec["vanilla"] = spectrum_metrics(singular_values_from_gram(psi, rewards))
    G = len(rewards)
    if G >= 4 and G % 2 == 0:
        rec["halves"] = []
        for block in (slice(0, G // 2), slice(G // 2, G)):
            r = rewards[block]
            a = compute_advantages(r[None, :], estimator)[0]
            rec["halves"].append({**_spread(r), **spectrum_metrics(singular_values_from_gram(psi[block, block], a))})
    return rec


def _rows_to_rollouts(psi: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The Gram matrix of rollouts ``[n, n]`` from that of their token rows ``[m, m]`` (rollout i's score vector is
    the sum of its ``counts[i]`` rows'): S psi S^T."""
    S = torch.zeros(len(counts), psi.shape[0], dtype=psi.dtype)
    start = offsets(counts)
    for i in range(len(counts)):
        S[i, start[i] : start[i + 1]] = 1.0
    return S @ psi @ S.T


class TokenCredit(StepObserver):
    """--log-token-credit: ``k`` rollouts of the step (group by group, one with a positive and one with a negative
    advantage) recorded token by token, with what the update did to each token's log-prob (one forward over their
    token rows after the update, on every rank: FSDP's forwards are collectives), and the ``credit/*`` aggregates
    (rank 0's rollouts). An episode's record runs through its rows, the environment's tokens as context with no
    values."""

    def __init__(self, k: int, train_module, updater, tokenizer, world: World, device):
        self.k, self.train_module, self.updater, self.tokenizer = k, train_module, updater, tokenizer
        self.world, self.device = world, device

    def watch(self, result: StepResult) -> list[int]:
        return pick_rollouts(result.advantages.rollout, result.collected.groups.sizes, self.k)

    def after_update(self, result: StepResult) -> None:
        if not result.collected.rewards:  # no update ran: nothing to show
            return
        t0 = time.perf_counter()
        roll, watch = result.collected, result.watch
        watched, rows = self.updater.watched, roll.groups.rows
        with torch.no_grad(), rng_untouched(self.device):
            sub = select(rows.batch, torch.tensor(watched.rows or [0], dtype=torch.long, device=self.device))
            after = self.train_module.logprobs(sub).to(torch.float64)  # [K, T']
        if not self.world.is_main or not watched.rows:
            result.token_credit = []
            return
        groups, starts = roll.groups, offsets(roll.groups.sizes)
        group_of = {starts[k] + g: (k, g) for k in range(len(groups.sizes)) for g in range(groups.sizes[k])}
        out = []
        for i in watch:
            gk, g = group_of[i]
            head = {
                "prompt": groups.prompt[gk],
                "rollout": g,
                "question": question_of(groups.records[gk]),
                **shown_images(groups.records[gk]),  # the prompt's pictures: the report's card shows them
                "reward": rows.scores.total[i].item(),
                "advantage": result.advantages.rollout[i].item(),
            }
            parts = [
                credit_row(self.tokenizer, rows, r, watched.slot[r], watched, after, context_prompt=j > 0)
                for j, r in enumerate(rows.rows_of([i]))
            ]
            out.append({**head, **join_credit_rows(parts)})
        result.token_credit = out
        result.metrics.update({f"credit/{k}": v for k, v in record_aggregates(out).items()})
        result.metrics["credit/rollouts"] = len(out)
        result.metrics["time/credit_s"] = time.perf_counter() - t0


class DoctorInstruments(StepObserver):
    """What the doctor (grpolab.doctor) reads that no other metric shows, every step:

    - ``doctor/weight_change``: how far the step moved the weights, ||theta' - theta|| / ||theta|| over a fixed sample
      of the trainable weights (the first ``per_tensor`` entries of each tensor; this rank's shard under FSDP): a
      policy that does not move (a learning rate too low for the weights' precision) or moves too far in one step,
      which none of the losses shows at --mu 1 and --beta 0. A sample, not every weight: a copy of the whole model
      every step would double its memory.
    - ``doctor/weights_unmoved_frac``: of the same sample's weights whose gradient was nonzero at one of the step's
      optimizer steps, the share the step left exactly as they were: the update rounded away by the weights'
      precision (bf16 weights under plain AdamW at GRPO's learning rates leave most unmoved; fp32 masters none). The
      weights as held, the ones the forward computes with. From the gradients as they were before each optimizer step
      with a learning rate above 0 (a hook: some optimizers use the gradient's memory during their step); not logged
      at a step with none.
    - ``doctor/weights_unmoved_exact_frac``, with Kahan summation only: the same share of their exact values (the
      weight plus the compensation the optimizer holds, :func:`grpolab.training.optim.exact_weights`): the update the
      optimizer kept, against the one the held bf16 weights show.
    - ``doctor/truncated_reward_gap``: the mean first reward (reward/accuracy's) of the step's rollouts that ended
      before --max-new-tokens minus that of those cut by it (all ranks; only at steps that have both kinds): whether
      the limit costs reward or only cuts completions that were wrong anyway.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, per_tensor: int = 4096, kahan: bool = False):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.per_tensor, self.kahan = optimizer, per_tensor, kahan
        self.before: list[torch.Tensor] = []
        self.before_exact: list[torch.Tensor] = []
        self.nonzero: list[torch.Tensor] | None = None  # [per_tensor] per tensor: a nonzero gradient at some step
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._gradients_before_step)

    def _sample(self, exact: bool = False) -> list[torch.Tensor]:
        """The sampled weights as fp32, as held (``exact``: with Kahan's compensation added)."""
        return [exact_weights(self.optimizer if exact else None, p, self.per_tensor).clone() for p in self.params]

    def _gradients_before_step(self, optimizer, args, kwargs) -> None:
        """Before each optimizer step: which sampled weights have a nonzero gradient (this rank's shard)."""
        if self.nonzero is None or not any(group["lr"] for group in optimizer.param_groups):
            return  # not inside an update this observer watches, or a step that can move nothing (warm-up's first)
        for i, p in enumerate(self.params):
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if grad is not None:
                self.nonzero[i] |= grad.detach().reshape(-1)[: self.per_tensor] != 0

    def before_update(self, result: StepResult) -> None:
        self.before = self._sample()
        self.before_exact = self._sample(exact=True) if self.kahan else []
        self.nonzero = [torch.zeros_like(b, dtype=torch.bool) for b in self.before]

    def after_update(self, result: StepResult) -> None:
        after = self._sample()
        moved = sum(float((a - b).pow(2).sum()) for a, b in zip(after, self.before))
        size = sum(float(b.pow(2).sum()) for b in self.before)
        result.metrics["doctor/weight_change"] = math.sqrt(moved / size) if size > 0 else 0.0
        counted = sum(int(n.sum()) for n in self.nonzero)
        if counted:
            result.metrics["doctor/weights_unmoved_frac"] = _unmoved(after, self.before, self.nonzero) / counted
            if self.kahan:
                exact = _unmoved(self._sample(exact=True), self.before_exact, self.nonzero) / counted
                result.metrics["doctor/weights_unmoved_exact_frac"] = exact
        self.before, self.before_exact, self.nonzero = [], [], None
        gen = result.collected.generated
        cut = [a for a, t in zip(gen.accuracy, gen.truncated) if t]
        rest = [a for a, t in zip(gen.accuracy, gen.truncated) if not t]
        if cut and rest:  # logged only where both kinds are there
            result.metrics["doctor/truncated_reward_gap"] = sum(rest) / len(rest) - sum(cut) / len(cut)


def _unmoved(after: list[torch.Tensor], before: list[torch.Tensor], counted: list[torch.Tensor]) -> int:
    """How many of the ``counted`` entries kept their value from ``before`` to ``after`` (per tensor, flat)."""
    return sum(int(((a == b) & n).sum()) for a, b, n in zip(after, before, counted))


def observers_for(cfg, learner, world: World, device: torch.device, task=None, log=print) -> list[StepObserver]:
    """The observers a run's config (:class:`grpolab.config.train.TrainConfig`) asks for, on the update stage
    ``learner``'s policy (:class:`grpolab.training.update_stage.UpdateStage`): the rollout logs and advantage
    statistics always, the spectrum probe with --probe-every, the token-credit records with --log-token-credit, the
    hacking signs with --hacking-every or --audit-reward (the audit is the task stage ``task``'s), the doctor's
    instruments with --doctor on."""
    policy = learner.policy
    observers = [
        RolloutLog(cfg.logging.log_samples, cfg.logging.log_rollouts, world, policy.eos_id),
        AdvantageProbe(cfg.probe.probe_eps),
    ]
    if cfg.probe.probe_every:
        observers.append(
            SpectrumProbe(
                policy.model,
                cfg.probe.probe_every,
                cfg.probe.probe_groups,
                effective_aggregation(cfg.terms.loss_type, cfg.objective.aggregation),
                cfg.max_policy_tokens,
                cfg.generation.temperature,
                world,
                device,
                estimator=cfg.objective.estimator,
                g_star=cfg.probe.probe_g_star,
            )
        )
    if cfg.probe.log_token_credit:
        observers.append(
            TokenCredit(
                cfg.probe.log_token_credit, learner.train_module, learner.updater, policy.tokenizer, world, device
            )
        )
    if cfg.hacking.signs_on:
        observers.append(
            HackingWatch(
                policy.model,
                cfg.hacking.hacking_every,
                cfg.hacking.hacking_groups,
                effective_aggregation(cfg.terms.loss_type, cfg.objective.aggregation),
                cfg.max_policy_tokens,
                cfg.generation.temperature,
                world,
                device,
                audit=None if task is None else task.audit,
                audit_sample=cfg.hacking.audit_sample,
                first=task.reward.names[0] if task is not None and task.reward.names else "accuracy",
                gram=not cfg.update.fsdp,
                log=log,
            )
        )
    if cfg.diagnosis.doctor == "on":
        observers.append(DoctorInstruments(policy.model, learner.optimizer, kahan=learner.precision.kahan))
    return observers
