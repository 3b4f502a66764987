"""On-policy distillation: a teacher's per-token signal on the student's own samples.

The student samples a completion o ~ pi_S; a frozen teacher pi_T scores every token of it. Two ways to learn from
that score:

- ``rkl-reward`` (tinker, prime-rl): the reverse KL as a per-token reward. Its one-sample estimate at token t is
  log pi_T(o_t) - log pi_S(o_t) = -k1, so each token's advantage gets ``coef * clip(log pi_T - log pi_sampler, +-c)``
  (:func:`teacher_advantage`) and the policy-gradient loss does the rest: ``E[(log pi_T - log pi_S) grad log pi_S]``
  is minus the gradient of KL(pi_S || pi_T) at that position [GKD]. Unlike the group's advantage, which is the same
  for every token of a rollout [Foundations, Thm 3.1], it differs token by token, and it is there in a group whose
  rewards are all equal.
- ``rkl``, ``fkl``, ``jsd``: the divergence over the whole vocabulary at each sampled position, backpropagated
  (:func:`token_divergence`): TRL's generalized Jensen-Shannon divergence with mixture
  ``m = (1 - beta) p_S + beta p_T``, ``beta * KL(p_T || m) + (1 - beta) * KL(p_S || m)``; ``beta = 0`` is the forward
  KL(p_T || p_S), ``beta = 1`` the reverse KL(p_S || p_T). (TRL's DistillationTrainer names beta so; its GKD trainer
  puts beta on the other side of the mixture.)

The per-token reverse-KL estimators :func:`k1` and :func:`k3` (Schulman) are what the probes compare with the exact
full-vocabulary gradient.
"""

from __future__ import annotations

import math

import torch

from grpolab.algo.names import DISTILL_LOSSES  # noqa: F401 - re-exported


def teacher_advantage(
    teacher_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, coef: float, clip: float
) -> torch.Tensor:
    """``[N, T]`` the teacher's term of each token's advantage: ``coef * clip(log pi_T(o_t) - log pi_sampler(o_t), -c,
    c)`` on the tokens ``mask`` keeps, 0 elsewhere. No gradient: it is an advantage (tinker's and prime-rl's form).

    ``teacher_logp``, ``sampler_logp``, ``mask``: ``[N, T]``; ``sampler_logp`` is the policy that sampled the tokens
    (the rollout engine's, or the trainer's at sampling time). ``clip`` c > 0 bounds one token's term: a token the
    teacher finds near impossible would otherwise outweigh a whole rollout's reward.
    """
    gap = (teacher_logp.detach().double() - sampler_logp.detach().double()).clamp(-clip, clip)  # [N, T]
    return (coef * gap * mask.double()).to(teacher_logp.dtype)  # a float dtype whatever the mask's


def token_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """``[...]`` the generalized JSD between the student's and the teacher's next-token distributions at each position
    (TRL's DistillationTrainer's divergence): ``beta * KL(p_T || m) + (1 - beta) * KL(p_S || m)`` with
    ``m = (1 - beta) p_S + beta p_T``; ``beta = 0``: KL(p_T || p_S), ``beta = 1``: KL(p_S || p_T).

    ``student_logits``, ``teacher_logits``: ``[..., V]`` over one vocabulary, both divided by ``temperature``.
    Differentiable in the student's logits (the teacher's carry no gradient); computed in fp32 (fp64 logits: fp64).
    """
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)  # [..., V]
    log_t = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))  # [..., V] log of the mixture
    kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def divergence_beta(loss: str, jsd_beta: float) -> float:
    """The generalized JSD's beta of a full-vocabulary ``--distill-loss``: fkl 0, rkl 1, jsd ``jsd_beta``."""
    return {"fkl": 0.0, "rkl": 1.0, "jsd": jsd_beta}[loss]


def k1(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-token one-sample estimate of KL(pi_S || pi_T) from o_t ~ pi_S: ``log pi_S(o_t) - log pi_T(o_t)``
    (unbiased, may be negative)."""
    return student_logp - teacher_logp


def k3(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi_S || pi_T) from o_t ~ pi_S: ``r - log r - 1`` with ``r = pi_T / pi_S`` (unbiased and
    >= 0)."""
    log_r = teacher_logp - student_logp
    return torch.exp(log_r) - log_r - 1.0


def moment_sums(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """``[n, sum x, sum y, sum x^2, sum y^2, sum xy]`` of paired values ``x``, ``y`` (1-D, float64 sums): what
    :func:`correlation` needs, summable over passes and processes."""
    x, y = x.double().flatten(), y.double().flatten()
    return [float(x.numel()), float(x.sum()), float(y.sum()), float((x * x).sum()), float((y * y).sum()),
            float((x * y).sum())]  # fmt: skip


def correlation(sums: list[float]) -> float | None:
    """Pearson's correlation from :func:`moment_sums` (summed); None when either side has no spread."""
    n, sx, sy, sxx, syy, sxy = sums
    if n < 2:
        return None
    vx, vy = sxx - sx * sx / n, syy - sy * sy / n
    if vx <= 1e-12 * max(sxx, 1.0) or vy <= 1e-12 * max(syy, 1.0):
        return None
    return (sxy - sx * sy / n) / math.sqrt(vx * vy)
