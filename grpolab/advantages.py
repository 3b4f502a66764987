"""Per-rollout advantages from group rewards: the baselines of the GRPO family.

Every estimator maps rewards ``[B, G]`` (B prompts, G rollouts each) to one
scalar per rollout, shape ``[B, G]``. The same scalar multiplies every token of
the rollout in the loss: uniform token credit [Foundations, Thm 3.1].
"""

from __future__ import annotations

import torch

ESTIMATORS = ("vanilla", "grpo", "grpo_std", "rloo", "oracle")
STD_EPS = 1e-4  # added to the group std before dividing [RLVR essay, Sec. 3.5]


def compute_advantages(rewards: torch.Tensor, estimator: str, values: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages ``[B, G]`` for rewards ``[B, G]``.

    - ``vanilla``:  A = r (REINFORCE, no baseline).
    - ``grpo``:     A = r - mean_j r_j [Foundations, Eq. 14-15]. Sums to 0 in each group.
    - ``grpo_std``: A = (r - mean) / (std + 1e-4), std the *population* std
      sqrt(mean((r - mean)^2)) [RLVR essay, Sec. 3.5]. A group whose rewards are
      all equal has r - mean = 0 exactly, so A = 0, never NaN.
    - ``rloo``:     A_i = r_i - mean_{j != i} r_j [U-statistic, Eq. 4]
      = G/(G-1) * (r_i - mean), which is how it is computed.
    - ``oracle``:   A = r - v(prompt), ``values`` ``[B]`` the true values [U-statistic, Table 1].
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    G = rewards.shape[1]
    if estimator == "vanilla":
        return rewards.clone()
    if estimator == "oracle":
        if values is None or values.shape != rewards.shape[:1]:
            raise ValueError(
                f"oracle needs values of shape [B]={tuple(rewards.shape[:1])}, got {values if values is None else tuple(values.shape)}"
            )
        return rewards - values.float()[:, None]
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {ESTIMATORS}")
    if G < 2:
        raise ValueError(f"estimator {estimator!r} needs a group of at least 2 rollouts, got G={G}")
    # Centre on the first reward before averaging: the result is the same number,
    # but a group whose rewards are all equal gives exactly 0 (r - mean(r) in float32
    # can be 1 ulp off, e.g. eight rewards of 0.1), and an exactly-0 advantage means
    # exactly no gradient from that group.
    shifted = rewards - rewards[:, :1]  # [B, G]
    centred = shifted - shifted.mean(dim=1, keepdim=True)  # [B, G]
    if estimator == "grpo":
        return centred
    if estimator == "rloo":
        return centred * (G / (G - 1))
    std = centred.pow(2).mean(dim=1, keepdim=True).sqrt()  # [B, 1] population std
    return centred / (std + STD_EPS)


def ragged_advantages(groups: list[torch.Tensor], estimator: str) -> torch.Tensor:
    """Advantages of groups of different sizes (``--sampling adaptive``), concatenated: ``[sum of sizes]``.

    Each group ``[n_b]`` gets the estimator of its own size; equal sizes give exactly
    ``compute_advantages`` of the stacked groups. ``oracle`` needs values and is not offered here.
    """
    if estimator == "oracle":
        raise ValueError("the oracle estimator needs each prompt's value; it is for probes, not training")
    if not groups:
        return torch.zeros(0)
    return torch.cat([compute_advantages(g[None, :], estimator)[0] for g in groups])


SCALES = ("group", "batch", "none")


def estimator_for_scale(estimator: str, scale: str) -> str:
    """``--scale-rewards``: which standard deviation divides grpo_std's centred advantages. ``group`` is grpo_std
    itself; ``batch`` and ``none`` start from the group-mean advantage (``grpo``); ``batch`` then divides it by
    :func:`batch_std`. Other estimators are left as they are (the config refuses the combination)."""
    return "grpo" if estimator == "grpo_std" and scale in ("batch", "none") else estimator


def batch_std(rewards: torch.Tensor) -> torch.Tensor:
    """The population standard deviation of every reward of the step (all groups, all ranks): a scalar.
    (TRL's scale_rewards='batch' uses the sample standard deviation, n - 1 in the denominator; grpolab keeps the
    population form of its group option, [RLVR essay, Sec. 3.5].)"""
    r = rewards.double().flatten()
    return (r - r.mean()).pow(2).mean().sqrt().float()
