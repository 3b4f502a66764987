"""The update of one GRPO step: mu passes over a batch of rows and their advantages, each of M optimizer steps
(--mu, --minibatches).

In order (:meth:`Updater.__call__`):

1. the loss mask: the tokens that carry loss (``--mask-truncated``; the entropy selection's
   threshold over every rank's tokens);
2. the micro-batch plan: which rows run, in passes of ``--micro-batch`` rows (or of at most
   ``--micro-batch-tokens`` padded tokens), the same number of passes on every rank;
3. the sampling-time (old) and reference log-probs, once, before any weight moves;
4. mu passes, each over the M minibatches: loss and backward per micro-batch, then the minibatch's
   optimizer step (skipped, and counted, when the loss or the gradient is not finite; under fp16's
   loss scaling a gradient that overflowed skips the step and halves the scale, counted apart);
5. the metrics, summed over ranks.

With ``watch`` rows (``--log-token-credit``), the update also keeps, for those rows, each token's
advantage, its log-prob under the weights before the update (the first pass's own forward) and
its importance ratio and clipping at the last pass (:class:`WatchedTokens`).

With P processes each rank holds its own rows; the normalisers are the whole step's (N rows
over all ranks, their token count), so each rank's loss is its share of the single-process
loss and the gradients, summed over ranks (``grpolab.training.forward``), are the single-process
gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from grpolab.algo.engine_correction import (
    MAX_KEYS,
    SUM_KEYS,
    engine_weights,
    mismatch_metrics,
    mismatch_sums,
    on_full_support,
)
from grpolab.algo.entropy_bonus import EntropyControl, entropy_bonus
from grpolab.algo.loss import (
    entropy_threshold,
    high_entropy_mask,
    loss_token_mask,
    policy_loss,
)
from grpolab.common import distributed as dist_
from grpolab.common.batch import Batch, select
from grpolab.common.distributed import World
from grpolab.models.sampling_rules import SamplingRules
from grpolab.training.distill import SUMS as DISTILL_SUMS
from grpolab.training.distill import TeacherSignal
from grpolab.training.forward import TrainModule
from grpolab.training.micro_batches import (
    MicroBatchPlan,
    minibatch_rows,
    plan_micro_batches,
    rows_advantages,
    token_budget_chunks,
)
from grpolab.training.update_options import UpdateSections, loss_options, update_metrics


@dataclasses.dataclass
class WatchedTokens:
    """Per-token values of the rows ``--log-token-credit`` records, as the update saw them; ``[W, T]`` each."""

    rows: list[int]
    """The W rows (of this rank's batch)."""
    adv: torch.Tensor
    """The advantage the loss gave each token: the rollout's, times the loss mask and the entropy selection."""
    logp: torch.Tensor
    """log pi(o_t) under the weights before the update: the first pass's forward (a forward of its own for a row that
    carries no loss)."""
    ratio: torch.Tensor
    """pi / pi_old at the last of the mu passes (GSPO: the rollout's); NaN where the token carried no loss."""
    clipped: torch.Tensor
    """Whether the clipped branch was taken there."""
    teacher: torch.Tensor | None = None
    """With a --teacher: its per-token term (rkl-reward: the part of ``adv`` that is the teacher's; rkl, fkl, jsd:
    the divergence the loss carries there), from the first pass; NaN where the token carried no loss."""

    @property
    def slot(self) -> dict[int, int]:
        return {r: k for k, r in enumerate(self.rows)}


class _Inputs(NamedTuple):
    """What every pass of an update reads."""

    batch: Batch
    adv: torch.Tensor  # [n], or [n, T] per token (episodes)
    loss_mask: torch.Tensor  # [n, T]
    entropy: torch.Tensor | None  # [n, T]
    threshold: torch.Tensor | None  # the entropy selection's threshold, or None
    old_logp: dict[int, tuple[torch.Tensor, ...]]  # pass -> [rows, T] log-probs (and rules on: their offset)
    sampler_logp: torch.Tensor | None  # [n, T] the rollout engine's log-probs of the sampled tokens
    ref_logp: dict[int, torch.Tensor]
    num_seqs: int  # N, all ranks
    num_tokens: float  # loss-carrying tokens, all ranks
    watched: WatchedTokens | None = None
    bonus_tokens: float = 0.0  # the entropy bonus's tokens (loss-carrying, and selected by entropy), all ranks
    idle: bool = False  # the minibatch has rows that run no pass (advantage 0): their clipped share is 0
    # pass -> the teacher's forward on its rows (TeacherSignal.score); None without a teacher
    teacher_out: dict[int, torch.Tensor] | None = None


MISMATCH = tuple(f"mismatch_{k}" for k in SUM_KEYS)
SUMS = ("loss", "policy", "kl_tok", "clip_tok", "clip_low_tok", "clip_high_tok", "ratio_tok", "weight_tok", *MISMATCH)


class Updater:
    """Runs the update with the policy's training forward, optimizer and schedule, as the run's ``sections`` say.

    ``reference``: the frozen KL reference's forward (None without a KL term, or with LoRA, where
    ``reference_is_base`` says the reference is the policy with its adapter disabled). ``scaler``: fp16's loss scaler.
    ``teacher``: on-policy distillation's teacher and its term (:class:`grpolab.training.distill.TeacherSignal`).
    """

    def __init__(
        self,
        sections: UpdateSections,
        policy: TrainModule,
        optimizer: torch.optim.Optimizer,
        scheduler,
        world: World,
        eos_id: int,
        reference: TrainModule | None = None,
        reference_is_base: bool = False,
        scaler=None,
        teacher: TeacherSignal | None = None,
    ):
        self.objective, self.passes = sections.objective, sections.passes
        self.max_grad_norm, self.rules = sections.optimizer.max_grad_norm, SamplingRules.of(sections.generation)
        self.policy, self.optimizer, self.scheduler, self.world = policy, optimizer, scheduler, world
        self.eos_id, self.reference, self.reference_is_base = eos_id, reference, reference_is_base
        self.options = loss_options(sections.objective, sections.terms, sections.max_policy_tokens)
        """policy_loss's options from the run's config (:func:`loss_options`)."""
        self.entropy: EntropyControl | None = None
        """The entropy bonus's coefficient and schedule (--entropy-coef, --adaptive-entropy); None without one."""
        if (t := sections.terms).entropy_bonus:
            self.entropy = EntropyControl(
                t.entropy_coef, t.adaptive_entropy, t.entropy_target, t.entropy_coef_delta, t.entropy_coef_min,
                t.entropy_coef_max,
            )  # fmt: skip
        self._bonus_coef = 0.0  # the coefficient of the optimizer step being taken
        self.watched: WatchedTokens | None = None
        """The last update's :class:`WatchedTokens` (None unless it was given ``watch`` rows)."""
        self.teacher = teacher
        self.scaler = scaler
        """The loss scaler of --precision 16-mixed (``torch.amp.GradScaler``; checkpointed by the run), else None."""

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_is_base

    # ------------------------------------------------------------------ the update
    def __call__(
        self,
        batch: Batch,
        adv: torch.Tensor,
        entropy: torch.Tensor | None = None,
        sampler_logp: torch.Tensor | None = None,
        watch: list[int] | None = None,
        action: torch.Tensor | None = None,
        cut: torch.Tensor | None = None,
    ) -> dict:
        """mu passes of M optimizer steps on this rank's rows; with P ranks, the sum of their gradients.

        batch, adv: this rank's n token rows (rollouts, or an episode's sequences) and their advantages, ``[n]`` (one
        per row) or ``[n, T]`` (per token: an episode's turns); n may be 0.
        ``entropy`` ``[n, T]``: the sampling policy's token entropies, for --top-entropy-quantile.
        ``sampler_logp`` ``[n, T]``: the rollout engine's log-prob of each sampled token: the mismatch with the
        trainer's is measured (``engine/*``) and, with --engine-correction, corrected.
        ``watch``: rows whose per-token values to keep in :attr:`watched` (every rank passes its own; under FSDP the
        extra forwards are collectives).
        ``action`` ``[n, T]``: the policy's own tokens (episodes: the environment's carry no loss); default: every
        completion token. ``cut`` ``[n]``: rows of episodes cut by a limit (--mask-truncated drops them); default:
        rows without an end-of-sequence token.
        """
        obj, world = self.objective, self.world
        n = adv.shape[0]
        loss_mask, carries = self._loss_mask(batch, n, action, cut)  # [n, T], [n]
        N, num_tokens = dist_.all_sum([float(n), float(loss_mask.sum())], world)
        N = int(N)
        threshold = self._entropy_threshold(entropy, loss_mask, n)
        # With no KL term, a rollout whose advantage is exactly 0 contributes exactly 0
        # to the loss and its gradient (every term is ratio * 0), so it is not run at all; nor is a
        # rollout with no loss-carrying token. Normalisers stay those of the whole batch, so the gradient is unchanged.
        credited = adv != 0 if adv.dim() == 1 else ((adv != 0) & loss_mask[:, : adv.shape[1]].bool()).any(dim=1)
        every = obj.beta > 0 or self.entropy is not None or self.teacher is not None  # terms beside the advantage
        live = carries if every else carries & credited
        M = self.passes.minibatches  # optimizer steps per pass over the batch, each on its share of the normalisers
        parts = minibatch_rows(n, M, live.device)
        plans = [self._plan(batch, part[live[part]], N // M) for part in parts]
        self.watched = None if watch is None else self._watch(watch, batch, loss_mask, plans[0])
        bonus_tokens = self._bonus_tokens(entropy, loss_mask, threshold, n, num_tokens)
        inputs = []
        for plan, part in zip(plans, parts):
            old_logp, ref_logp = self._old_and_ref_logprobs(batch, plan)
            inputs.append(_Inputs(
                batch, adv, loss_mask, entropy, threshold, old_logp, sampler_logp, ref_logp, N // M, num_tokens / M,
                self.watched, bonus_tokens / M, bool((carries[part] & ~live[part]).any()), self._teacher(batch, plan),
            ))  # fmt: skip
        sums = dict.fromkeys(SUMS, 0.0) | dict.fromkeys(MAX_KEYS, 0.0) | {"clip_extremes": []}
        sums |= {f"distill_{k}": 0.0 for k in DISTILL_SUMS}
        grad_norm, skipped, overflows = self._optimizer_steps(plans, inputs, sums)
        rows = torch.cat([plan.rows for plan in plans])
        teacher = self.teacher.metrics(sums) if self.teacher is not None else {}
        return self._metrics(sums, rows, loss_mask, N, grad_norm, skipped) | self._scaler_metrics(overflows) | teacher

    def _optimizer_steps(self, plans: list[MicroBatchPlan], inputs: list[_Inputs], sums: dict) -> tuple:
        """mu times over the minibatches: each one's passes, then an optimizer step. Returns the mean gradient norm,
        the steps skipped for a non-finite loss or gradient, and those skipped for fp16's overflow."""
        params = [p for p in self.policy.module.model.parameters() if p.requires_grad]
        steps = self.objective.mu * len(plans)
        grad_norm, skipped, overflows = 0.0, 0, 0
        for it in range(self.objective.mu):
            for plan, x in zip(plans, inputs):
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                self._bonus_coef, sums["entropy_sum"] = (self.entropy.applied() if self.entropy else 0.0), 0.0
                sums["low_min_step"], sums["high_max_step"] = (0.0 if x.idle else math.inf), 0.0
                for c_i, idx in enumerate(plan.chunks):
                    finite = self._loss_and_backward(x, plan, c_i, idx, sums, first=it == 0) and finite
                sums["clip_extremes"] += [-sums["low_min_step"], sums["high_max_step"]]  # this rank's, negated low
                norm, overflow = self._optimizer_step(params, finite)
                if self.entropy is not None:
                    self._observe_entropy(sums, x.bonus_tokens, first=it == 0)
                if overflow:
                    overflows += 1
                elif norm is None:
                    skipped += 1
                else:
                    grad_norm += norm / steps
        return grad_norm, skipped, overflows

    def skip(self) -> dict:
        """A step with no group to learn from (--sampling filter, every round all-equal): the weights stay,
        the schedule moves on, and the step is counted (``sampling/short``)."""
        for _ in range(self.objective.mu * self.passes.minibatches):
            self.scheduler.step()
        return update_metrics(self.scheduler.get_last_lr()[0])

    # ------------------------------------------------------------------ its steps
    def _plan(self, batch: Batch, rows: torch.Tensor, N: int) -> MicroBatchPlan:
        """The passes over ``rows``: --micro-batch rows each, or --micro-batch-tokens tokens each."""
        budget, size = self.passes.micro_batch_tokens, self.passes.micro_batch or N
        if budget:
            p_lens, c_lens = batch.prompt_mask.sum(1).cpu(), batch.completion_mask.sum(1).cpu()  # [n], [n]
            chunks = token_budget_chunks(rows, p_lens, c_lens, budget, packed=self.policy.packing)
        else:
            chunks = [rows[i : i + size] for i in range(0, rows.numel(), size)]
        return plan_micro_batches(rows, chunks, self.world)

    def _loss_mask(
        self, batch: Batch, n: int, action: torch.Tensor | None = None, cut: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, T]`` the tokens that carry loss, and ``[n]`` whether a row has any.

        --mask-truncated drops completions with no end-of-sequence token (DAPO), by the rule the probes use, or the
        rows of episodes a limit cut (``cut``). ``action``: the policy's own tokens of an episode's rows.
        """
        mask = batch.completion_mask[:n]  # a rank with no rows of its own holds one stand-in row (rows.Rows)
        if action is not None:
            loss_mask = action[:n].to(mask.device, mask.dtype)  # [n, T]
            if self.objective.mask_truncated and cut is not None:
                loss_mask = loss_mask * (~cut[:n].to(mask.device))[:, None].to(mask.dtype)
            return loss_mask, loss_mask.bool().any(dim=1)
        loss_mask = loss_token_mask(
            batch.completion_ids[:n], mask, self.eos_id, mask_truncated=self.objective.mask_truncated
        ).to(mask.dtype)  # [n, T]
        if self.objective.mask_truncated:
            return loss_mask, loss_mask.bool().any(dim=1)
        return loss_mask, torch.ones(n, dtype=torch.bool, device=mask.device)

    def _entropy_threshold(self, entropy: torch.Tensor | None, loss_mask: torch.Tensor, n: int):
        """--top-entropy-quantile: one threshold over every loss-carrying token of the step, all ranks (else None)."""
        q = self.objective.top_entropy_quantile
        if q >= 1.0:
            return None
        local = entropy[:n].to(loss_mask.device)[loss_mask.bool()].float().cpu() if n else torch.zeros(0)
        return entropy_threshold(torch.cat(dist_.gather(local, self.world)), q)

    @torch.no_grad()
    def _old_and_ref_logprobs(self, batch: Batch, plan: MicroBatchPlan) -> tuple[dict, dict]:
        """Per pass: the sampling-time log-probs (mu > 1: the importance ratio's denominator,
        [U-statistic, App. A (ii)]) and the reference's (the KL term), before any weight moves."""
        old_logp, ref_logp = {}, {}
        for c_i, idx in enumerate(plan.chunks):
            sub = select(batch, idx)
            if self.objective.mu > 1 or self.passes.minibatches > 1:  # the weights move before the pass runs
                old_logp[c_i] = self.policy.scores(sub, rules=self.rules)  # [n, T] each
            if self.reference is not None:
                ref_logp[c_i] = self.reference.logprobs(sub)
            elif self.reference_is_base:
                with self.policy.module.model.disable_adapter():
                    ref_logp[c_i] = self.policy.logprobs(sub)
        return old_logp, ref_logp

    def _teacher(self, batch: Batch, plan: MicroBatchPlan) -> dict[int, torch.Tensor] | None:
        """Per pass: the teacher's forward on its rows (:meth:`TeacherSignal.score`), before any weight moves."""
        if self.teacher is None:
            return None
        return {c_i: self.teacher.score(select(batch, idx)) for c_i, idx in enumerate(plan.chunks)}

    def _loss_and_backward(
        self, x: _Inputs, plan: MicroBatchPlan, c_i: int, idx: torch.Tensor, sums: dict, first: bool
    ) -> bool:
        """One pass: its loss, backward, and its share of the loss statistics. Returns whether the loss was finite.
        ``first``: the first of the mu optimizer steps (the engine mismatch is measured there)."""
        train = self.policy
        padding = c_i >= plan.real
        sub = select(x.batch, idx)
        teacher, counts = self.teacher, None if padding or not first else sums  # the teacher's statistics: once
        full = teacher is not None and teacher.full
        with train.sync(c_i == len(plan.chunks) - 1):  # reduce over ranks once, after the last pass
            if full:  # [n, T] each: log-probs and the divergence from the teacher (no entropy bonus, no rules)
                logp, div = train.divergence(sub, (x.teacher_out[c_i], teacher.head, teacher.beta))
                cols = (logp,)
            else:
                cols = train.scores(sub, entropy=self.entropy is not None, rules=self.rules)  # [n, T] each
            logp, ent_now = cols[0], cols[1] if self.entropy is not None else None  # differentiable
            sub_mask = sub.completion_mask if padding else x.loss_mask[idx, : sub.completion_mask.shape[1]]
            weights = selection = None
            if x.threshold is not None:
                ent = (
                    torch.zeros_like(logp) if padding else x.entropy[idx.cpu(), : sub_mask.shape[1]].to(sub_mask.device)
                )
                weights = selection = high_entropy_mask(ent, sub_mask, x.threshold.to(ent.device))
            # [n, T] the trainer's log-probs at sampling time, and (rules on) its offset of the sampling distribution
            old, *old_offset = x.old_logp.get(c_i, (logp.detach(), *cols[2 if self.entropy is not None else 1 :]))
            sampler = None  # the rollout engine's log-probs of these rows, when it gave them
            if x.sampler_logp is not None and not padding:
                sampler = x.sampler_logp[idx.cpu(), : sub_mask.shape[1]].to(old.device)  # [n, T]
                if old_offset:  # the sampling distribution's log-probs on the whole vocabulary (engine_correction)
                    sampler = on_full_support(sampler, old_offset[0])
                correction = self._correction(old, sampler, sub_mask)
                if correction is not None:
                    weights = correction if weights is None else weights * correction
                if first:
                    self._count_mismatch(old, sampler, sub_mask, correction, sums)
            adv = rows_advantages(x.adv, idx, sub_mask.shape[1])  # [n] or [n, T]
            if teacher is not None:  # [n, T]: the teacher's term added to each token's (rkl-reward)
                t_out = None if full else x.teacher_out[c_i]
                adv = teacher.advantage(adv, t_out, old if sampler is None else sampler, sub_mask, counts)
            watching = x.watched is not None and not padding
            loss, st = self._loss(logp, old, adv, sub_mask, x, c_i, weights, sampler, watching)
            if full:
                loss = loss + teacher.divergence_loss(div, sub_mask, self.options, x, counts)
            if watching:
                self._keep_watched(x.watched, idx, logp.detach(), st, sub_mask, selection, first)
                if teacher is not None and first:
                    teacher.keep(x.watched, idx, sub_mask)
            if self.entropy is not None:  # - c H: this pass's share of the step's mean entropy
                h = entropy_bonus(ent_now, sub_mask if selection is None else sub_mask * selection, x.bonus_tokens)
                loss = loss - self._bonus_coef * h
                sums["entropy_sum"] += 0.0 if padding else float(h.detach()) * x.bonus_tokens
            if padding:
                loss = loss * 0.0
            # A non-finite loss still runs backward: the ranks stay in step, and the update is skipped.
            finite = bool(torch.isfinite(loss))
            scaled = loss * train.loss_scale
            (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
        if not padding:
            self._add_stats(sums, loss, st, float(sub_mask.sum()))
        return finite

    def _loss(self, logp, old, adv, mask, x: _Inputs, c_i: int, weights, sampler, watching: bool):
        """The pass's policy loss (grpolab.algo.loss.policy_loss) with the run's objective and the step's
        normalisers; ``watching``: with the per-token values --log-token-credit records."""
        return policy_loss(
            logp,
            old,
            adv,
            mask,
            ref_logp=x.ref_logp.get(c_i),
            num_seqs=x.num_seqs,
            num_tokens=x.num_tokens,
            token_weights=weights,
            token_values=watching,
            sampling_logp=sampler,
            **self.options,
        )

    def _bonus_tokens(self, entropy, loss_mask, threshold, n: int, num_tokens: float) -> float:
        """The entropy bonus's token count over all ranks: the loss-carrying tokens (those the entropy selection
        keeps, with --top-entropy-quantile); 0 without a bonus."""
        if self.entropy is None:
            return 0.0
        if threshold is None:
            return num_tokens
        ent = entropy[:n].to(loss_mask.device)
        return dist_.all_sum([float(high_entropy_mask(ent, loss_mask, threshold.to(ent.device)).sum())], self.world)[0]

    def _observe_entropy(self, sums: dict, bonus_tokens: float, first: bool) -> None:
        """After an optimizer step: its mean entropy (all ranks) moves the adaptive coefficient; the first one's
        (the sampling policy's) and its coefficient are the step's ``loss/entropy``, ``loss/entropy_coef``."""
        total = dist_.all_sum([sums["entropy_sum"]], self.world)[0]
        mean = total / max(bonus_tokens, 1.0)
        if first:
            sums["entropy_first"], sums["entropy_coef"] = mean, self._bonus_coef
        self.entropy.observe(mean)

    def _clip_extremes(self, local: list[float]) -> dict:
        """``loss/clip_low_min`` and ``loss/clip_high_max``: each optimizer step's least and greatest clipped share of
        one rollout over every rank (TRL's ``low_min`` and ``high_max``, which it takes per micro-batch), their means
        over the step's optimizer steps; ``local``: this rank's, ``[-low, high]`` per optimizer step, reduced at once."""
        every = dist_.all_max_floats(local, self.world)
        lows = [0.0 if math.isinf(v) else -v for v in every[0::2]]  # inf: no rollout with a token on any rank
        return {"loss/clip_low_min": sum(lows) / len(lows), "loss/clip_high_max": sum(every[1::2]) / len(lows)}

    def _add_stats(self, sums: dict, loss: torch.Tensor, st: dict, n_tok: float) -> None:
        """A pass's share of the step's loss statistics (means over the mu passes; token sums for token means). A
        minibatch's loss is divided by its share (1/M) of the step's normalisers: the M of them over M are one
        pass's."""
        mu, steps = self.objective.mu, self.objective.mu * self.passes.minibatches
        sums["loss"] += loss.item() / steps
        sums["policy"] += st["policy"].item() / steps
        sums["kl_tok"] += st["kl"].item() * n_tok / mu
        sums["clip_tok"] += st["clip_frac"].item() * n_tok / mu
        sums["clip_low_tok"] += st["clip_low"].item() * n_tok / mu
        sums["clip_high_tok"] += st["clip_high"].item() * n_tok / mu
        low, high = st["clip_low_min"].item(), st["clip_high_max"].item()  # NaN for a pass without a token
        sums["low_min_step"] = min(sums["low_min_step"], low) if low == low else sums["low_min_step"]
        sums["high_max_step"] = max(sums["high_max_step"], high) if high == high else sums["high_max_step"]
        sums["ratio_tok"] += st["ratio_mean"].item() * n_tok / mu

    @torch.no_grad()
    def _watch(self, rows, batch, loss_mask, plan: MicroBatchPlan) -> WatchedTokens:
        """The watched rows' records, to be filled by the passes from the loss's own values (:meth:`_keep_watched`),
        and the log-probs of the rows that run in no pass (a forward of their own now, before any weight moves; on
        every rank when any rank has one, as FSDP's forwards are collectives). A row runs in no pass only when no
        token of it carries both loss and credit, so its advantage stays 0 throughout."""
        rows = list(rows)
        n, T = len(rows), loss_mask.shape[1]
        zeros = torch.zeros(n, T, dtype=torch.float64, device=loss_mask.device)
        nan = torch.full((n, T), math.nan, dtype=torch.float64, device=loss_mask.device)
        watched = WatchedTokens(rows, zeros, nan.clone(), nan.clone(), torch.zeros(n, T, dtype=torch.bool))
        if self.teacher is not None:
            watched.teacher = nan.clone()
        running = set(plan.rows.tolist())
        missing = [r for r in rows if r not in running]
        if dist_.all_max(len(missing), self.world):
            sub = select(batch, torch.tensor(missing or [0], dtype=torch.long, device=loss_mask.device))
            logp = self.policy.logprobs(sub)  # [m, T']
            for j, r in enumerate(missing):
                watched.logp[watched.slot[r], : logp.shape[1]] = logp[j].to(torch.float64)
        return watched

    @torch.no_grad()
    def _keep_watched(self, w: WatchedTokens, idx, logp, st: dict, mask, selection, first: bool) -> None:
        """A pass's values of the watched rows among ``idx``, taken from the loss (``st``: its ``token_values``):
        log-probs at the first pass (the weights before the update); the advantage the loss credited (times the
        entropy ``selection``, if any), importance ratio and clipping at every pass (the last one stays)."""
        slot, T = w.slot, mask.shape[1]
        adv = st["token_advantage"] if selection is None else st["token_advantage"] * selection.to(logp.dtype)
        for j, r in enumerate(idx.tolist()):
            if r not in slot:
                continue
            k = slot[r]
            if first:
                w.logp[k, :T] = logp[j].to(torch.float64)
            w.adv[k, :T] = adv[j].to(torch.float64)
            w.ratio[k, :T] = torch.where(mask[j].bool(), st["token_ratio"][j].to(torch.float64), math.nan)
            w.clipped[k, :T] = st["token_clipped"][j].cpu()

    def _correction(self, old: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """--engine-correction: the policy term's weights pi_trainer / pi_sampler, truncated or masked ``[n, T]``
        (None with none)."""
        mode = self.objective.engine_correction
        if mode == "none":
            return None
        return engine_weights(old, sampler_logp, mask, mode, self.objective.engine_correction_cap)

    @staticmethod
    def _count_mismatch(old, sampler_logp, mask, correction: torch.Tensor | None, sums: dict) -> None:
        """Adds the pass's trainer/sampler mismatch over its loss tokens (:func:`mismatch_sums`; and the
        correction's weights) to the step's sums."""
        part = mismatch_sums(old, sampler_logp, mask)
        for k in SUM_KEYS:
            sums[f"mismatch_{k}"] += part[k]
        for k in MAX_KEYS:
            sums[k] = max(sums[k], part[k])
        if correction is not None:
            sums["weight_tok"] += float(correction.sum())

    def _optimizer_step(self, params: list[torch.Tensor], finite: bool) -> tuple[float | None, bool]:
        """Clip and step. Returns the gradient norm, or None when the loss or the gradient was not finite on some rank
        (then the weights stay and the gradient is dropped), and whether the step was skipped for a loss-scaled
        gradient's overflow (fp16: the scaler halves its scale; the loss itself was finite everywhere). The schedule
        moves on either way."""
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        # No pass ran when every advantage is 0: torch's AdamW skips a parameter whose grad is None, where TRL's
        # backward of zeros has it decay its moments, move by momentum and apply weight decay. Zeros take that step
        # (before the scaler's inf check, which needs a gradient); every rank has the same None grads (equal passes).
        for p in (p for p in params if p.grad is None):
            p.grad = torch.zeros_like(p)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # the true gradients, for the norm, the clip and the step
        norm = self.policy.clip_grad_norm(params, max_norm)
        # The gradient (and so its norm) is the same on every rank after the reduction; the loss flags are not.
        stepped = dist_.all_true(finite and math.isfinite(norm), self.world)
        overflow = False
        if stepped and self.scaler is None:
            self.optimizer.step()
        elif stepped:
            self.scaler.step(self.optimizer)  # unscaled above, and finite: it steps
        else:
            overflow = self.scaler is not None and dist_.all_true(finite, self.world)
            self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()  # every rank saw the same overflow (the reduced gradient; FSDP: a sharded scaler)
        self.scheduler.step()
        return (norm if stepped else None), overflow

    def _scaler_metrics(self, overflows: int) -> dict:
        """precision/*: the loss scale after the step and the optimizer steps skipped for an overflow (none without a
        scaler)."""
        if self.scaler is None:
            return {}
        return {"precision/loss_scale": float(self.scaler.get_scale()), "precision/overflow_skips": overflows}

    def _engine_metrics(self, totals: dict, sums: dict) -> dict:
        """engine/*: the sampler-trainer mismatch over the tokens the update scores (no sampler log-probs: none;
        :func:`grpolab.algo.engine_correction.mismatch_metrics`), and the correction's mean weight."""
        parts = {k: totals[f"mismatch_{k}"] for k in SUM_KEYS}
        if not parts["tok"]:
            return {}
        parts |= {k: dist_.all_max_float(sums[k], self.world) for k in MAX_KEYS}
        out = mismatch_metrics(parts)
        if self.objective.engine_correction != "none":
            out["engine/correction_weight_mean"] = totals["weight_tok"] / parts["tok"]
        return out

    def _metrics(self, sums: dict, rows: torch.Tensor, loss_mask, N: int, grad_norm: float, skipped: int) -> dict:
        """Whole-step values: this rank's sums plus the others'. ``rows``: the rows that ran."""
        local = [sums[k] for k in SUMS] + [rows.numel(), float(loss_mask[rows].sum())]
        totals = dict(zip([*SUMS, "active", "active_tok"], dist_.all_sum(local, self.world)))
        active_tokens = max(1.0, totals["active_tok"])
        bonus = {}
        if self.entropy is not None:
            bonus = {"loss/entropy": sums["entropy_first"], "loss/entropy_coef": sums["entropy_coef"]}
        return {
            **self._engine_metrics(totals, sums),
            **bonus,
            **update_metrics(
                self.scheduler.get_last_lr()[0],
                total=totals["loss"],
                policy=totals["policy"],
                kl=totals["kl_tok"] / active_tokens if self.has_reference else None,
                clip_frac=totals["clip_tok"] / active_tokens,
                ratio_mean=totals["ratio_tok"] / active_tokens if totals["active"] else 1.0,
                active_frac=totals["active"] / N,
                skipped=skipped,
                grad_norm=grad_norm,
            ),
            **{f"loss/clip_{side}_frac": totals[f"clip_{side}_tok"] / active_tokens for side in ("low", "high")},
            **self._clip_extremes(sums["clip_extremes"]),
        }
