"""On-policy distillation in the update: the frozen teacher, its forward on the sampled tokens, and its term of the
loss (--teacher, --distill-loss; docs/distillation.md).

The teacher runs once per update pass's rows, before any weight moves, as the KL reference does: for ``rkl-reward``
its log-probs of the sampled tokens (the training forward's own paths: the shared prefix, packing), which
:func:`grpolab.algo.distill.teacher_advantage` turns into each token's advantage term; for ``rkl``, ``fkl`` and
``jsd`` its hidden states at the sampled positions, which the student's forward projects through the teacher's LM
head beside its own, chunk by chunk (:func:`grpolab.models.logprobs.completion_divergence`).
"""

from __future__ import annotations

import time

import torch

from grpolab.algo.distill import correlation, divergence_beta, moment_sums, teacher_advantage
from grpolab.algo.loss import aggregate
from grpolab.common import distributed as dist_
from grpolab.common.batch import Batch
from grpolab.common.distributed import World
from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given
from grpolab.config.distill import DistillSection
from grpolab.models.policy import Policy, load_policy
from grpolab.training.forward import TrainModule

MOMENTS = ("n", "x", "y", "xx", "yy", "xy")
SUMS = ("tok", "kl", "term", "clipped", *(f"m{k}" for k in MOMENTS))
"""The teacher's per-pass sums: loss tokens, the teacher KL's estimate, the advantage term, clipped tokens, and the
moments of (the rollout's advantage, the teacher's term) over the loss tokens (:func:`moment_sums`)."""


def load_teacher(
    section: DistillSection, policy: Policy, dtype: torch.dtype, device, given: Given = NOTHING, log=print
):
    """The teacher model, frozen and in ``dtype`` on ``device``; a :class:`ConfigError` in one line, before any step,
    when its tokenizer's vocabulary is not ``policy``'s."""
    t0 = time.perf_counter()
    log(f"loading the teacher {section.teacher} ...")
    teacher = load_policy(
        section.teacher,
        dtype,
        gguf_file=section.teacher_gguf_file,
        revision=section.teacher_revision,
        device=device,
        given=given,
        flag="--teacher",
    )
    check_vocabulary(policy, teacher)
    n_params = sum(p.numel() for p in teacher.model.parameters()) / 1e6
    log(f"teacher {teacher.source}: {n_params:.1f} M parameters, {dtype}, in {time.perf_counter() - t0:.0f} s")
    return teacher.model.eval().requires_grad_(False)


def check_vocabulary(policy: Policy, teacher: Policy) -> None:
    """A teacher must score the policy's token ids: the same tokenizer vocabulary (token -> id) and LM head size."""
    mine, theirs = policy.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    heads = [m.get_output_embeddings().weight.shape[0] for m in (policy.model, teacher.model)]
    if mine != theirs or heads[0] != heads[1]:
        differ = sum(1 for k, v in mine.items() if theirs.get(k) != v) + len(theirs.keys() - mine.keys())
        raise ConfigError(
            f"--teacher: {teacher.source} has another vocabulary than the policy {policy.source} ({len(theirs)} tokens "
            f"and a {heads[1]}-row head against {len(mine)} and {heads[0]}; {differ} token ids differ): a teacher must "
            "share the policy's tokenizer"
        )


class TeacherSignal:
    """The teacher's part of an update: its forward on a pass's rows, its advantage term or divergence, its metrics.

    ``teacher``: the teacher's training forward (frozen; no DDP). ``task_reward`` False: the rollouts' own advantages
    are dropped, leaving the teacher's signal alone.
    """

    def __init__(self, section: DistillSection, teacher: TrainModule, world: World):
        self.section, self.teacher, self.world = section, teacher, world
        self.full = section.full_vocabulary
        self.beta = divergence_beta(section.loss, section.distill_beta) if self.full else None
        self.head = teacher.module.model.get_output_embeddings()
        self.seconds = 0.0
        self.last: torch.Tensor | None = None
        """``[n, T]`` the last pass's per-token term: the advantage's (rkl-reward) or the divergence."""

    @torch.no_grad()
    def score(self, sub: Batch) -> torch.Tensor:
        """The teacher's forward on a pass's rows: ``[n, T]`` its log-probs of the sampled tokens (rkl-reward), or
        ``[M, d_t]`` its hidden states at the M real ones (the full-vocabulary divergences)."""
        t0 = time.perf_counter()
        out = self.teacher.hidden(sub) if self.full else self.teacher.logprobs(sub)
        self.seconds += time.perf_counter() - t0
        return out

    def advantage(self, adv, teacher_logp, sampler_logp, mask, sums: dict | None) -> torch.Tensor:
        """``[n, T]`` each token's advantage: the rollout's (``adv`` ``[n]``, or ``[n, T]`` an episode's; none when
        the task reward is off) plus, for rkl-reward, the teacher's term; ``sums`` (a pass that counts) gets its
        statistics."""
        base = adv if adv.dim() == 2 else adv[:, None].expand(mask.shape)  # [n, T]
        base = base if self.section.task_reward else torch.zeros_like(base)
        if self.full:
            return base
        s = self.section
        term = teacher_advantage(teacher_logp, sampler_logp, mask, s.distill_coef, s.distill_clip)  # [n, T]
        term = term.to(device=base.device, dtype=base.dtype)
        self.last = term
        if sums is not None:
            m = mask.bool()
            gap = (sampler_logp - teacher_logp).detach()[m]  # k1 of KL(pi_sampler || pi_teacher)
            sums["distill_tok"] += float(m.sum())
            sums["distill_kl"] += float(gap.sum())
            sums["distill_term"] += float(term[m].sum())
            sums["distill_clipped"] += float((gap.abs() > s.distill_clip).sum())
            if s.task_reward:  # does the teacher's term run with the task's advantage, or against it
                for k, v in zip(MOMENTS, moment_sums(base[m], term[m])):
                    sums[f"distill_m{k}"] += v
        return base + term

    def divergence_loss(self, div: torch.Tensor, mask, options: dict, x, sums: dict | None) -> torch.Tensor:
        """``coef`` x the divergences ``div`` ``[n, T]`` aggregated as the policy loss is (the run's --aggregation and
        the step's normalisers ``x``); ``sums`` gets their token sum."""
        self.last = div.detach()
        if sums is not None:
            m = mask.bool()
            sums["distill_tok"] += float(m.sum())
            sums["distill_kl"] += float(div.detach()[m].sum())
        agg = aggregate(
            div, mask, options["aggregation"], max_len=options.get("max_len"), num_seqs=x.num_seqs,
            num_tokens=x.num_tokens,
        )  # fmt: skip
        return self.section.distill_coef * agg

    @torch.no_grad()
    def keep(self, watched, idx: torch.Tensor, mask: torch.Tensor) -> None:
        """The last pass's per-token term for the rows ``--log-token-credit`` watches (``watched``: the update's
        :class:`grpolab.training.update.WatchedTokens`) among ``idx``; NaN off the loss tokens."""
        slot, T = watched.slot, mask.shape[1]
        for j, r in enumerate(idx.tolist()):
            if r in slot:
                row = torch.where(mask[j].bool(), self.last[j].double(), torch.nan)
                watched.teacher[slot[r], :T] = row.to(watched.teacher.device)

    def metrics(self, sums: dict) -> dict:
        """distill/*: the teacher's KL from the policy per token (rkl-reward: the one-sample k1 of
        KL(pi_sampler || pi_teacher); else the divergence the loss carries), the mean advantage term and the share of
        tokens whose gap was clipped (rkl-reward), and with the task reward the correlation over loss tokens of the
        rollout's advantage and the teacher's term (reward_corr: negative, the teacher fights the reward), over every
        rank; time/teacher_s: this rank's teacher forwards."""
        tok, kl, term, clipped, *moments = dist_.all_sum([sums[f"distill_{k}"] for k in SUMS], self.world)
        tok = max(tok, 1.0)
        out = {"distill/kl": kl / tok, "time/teacher_s": self.seconds}
        if not self.full:
            out |= {"distill/term_mean": term / tok, "distill/clip_frac": clipped / tok}
        if not self.full and self.section.task_reward and (corr := correlation(moments)) is not None:
            out["distill/reward_corr"] = corr
        self.seconds = 0.0
        return out
