"""Per-rollout advantages from group rewards: the baselines of the GRPO family.

Every estimator maps rewards ``[B, G]`` (B prompts, G rollouts each) to one
scalar per rollout, shape ``[B, G]``. The same scalar multiplies every token of
the rollout in the loss: uniform token credit [Foundations, Thm 3.1].
"""

from __future__ import annotations

import torch

from grpolab.algo.groups import common_size
from grpolab.algo.names import CREDITS, ESTIMATORS, SCALES  # noqa: F401 - re-exported

STD_EPS = 1e-4  # added to the group std before dividing [RLVR essay, Sec. 3.5]


def compute_advantages(
    rewards: torch.Tensor, estimator: str, values: torch.Tensor | None = None, sample_std: bool = False
) -> torch.Tensor:
    """Advantages ``[B, G]`` for rewards ``[B, G]``.

    - ``vanilla``:  A = r (REINFORCE, no baseline).
    - ``grpo``:     A = r - mean_j r_j [Foundations, Eq. 14-15]. Sums to 0 in each group.
    - ``grpo_std``: A = (r - mean) / (std + 1e-4), std the *population* std
      sqrt(mean((r - mean)^2)) [RLVR essay, Sec. 3.5]. A group whose rewards are
      all equal has r - mean = 0 exactly, so A = 0, never NaN.
    - ``rloo``:     A_i = r_i - mean_{j != i} r_j [U-statistic, Eq. 4]
      = G/(G-1) * (r_i - mean), which is how it is computed.
    - ``oracle``:   A = r - v(prompt), ``values`` ``[B]`` the true values [U-statistic, Table 1].

    ``sample_std``: grpo_std divides by the sample std sqrt(sum((r - mean)^2) / (G - 1)) instead, as TRL does
    (``--reward-std sample``).
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
    return centred / (_std(centred, sample_std, dim=1) + STD_EPS)  # std [B, 1]


def _std(centred: torch.Tensor, sample: bool, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of values already centred on their mean, over ``dim`` (kept) or all of them: the
    population one (the mean square), or the sample one (the sum of squares over n - 1, torch.std's)."""
    squares = centred.pow(2)
    if dim is None:
        return (squares.sum() / max(centred.numel() - 1, 1)).sqrt() if sample else squares.mean().sqrt()
    n = centred.shape[dim]
    return (
        (squares.sum(dim=dim, keepdim=True) / (n - 1)).sqrt() if sample else squares.mean(dim=dim, keepdim=True).sqrt()
    )


def ragged_advantages(groups: list[torch.Tensor], estimator: str, sample_std: bool = False) -> torch.Tensor:
    """Advantages of groups of different sizes (``--sampling adaptive``), concatenated: ``[sum of sizes]``.

    Each group ``[n_b]`` gets the estimator of its own size; equal sizes give exactly
    ``compute_advantages`` of the stacked groups. ``oracle`` needs values and is not offered here.
    """
    if estimator == "oracle":
        raise ValueError("the oracle estimator needs each prompt's value; it is for probes, not training")
    if not groups:
        return torch.zeros(0)
    return torch.cat([compute_advantages(g[None, :], estimator, sample_std=sample_std)[0] for g in groups])


def scorable_advantages(
    groups: list[torch.Tensor], unscorable: list[torch.Tensor], estimator: str, sample_std: bool = False
) -> torch.Tensor:
    """Advantages of groups some of whose rollouts have no reward (every reward function returned None for them:
    TRL's NaN rewards), concatenated ``[sum of sizes]``: each group's estimator over its scored rollouts alone (their
    baseline, their std), and 0 for the rollouts without a reward. A group with fewer than two scored rollouts has no
    baseline to measure against: 0 throughout (``vanilla``: the reward itself). TRL 1.16 computes the same with
    ``nanmean``/``nanstd`` and then ``nan_to_num``."""
    out = []
    for r, u in zip(groups, unscorable):
        adv = torch.zeros(r.shape, dtype=torch.float32, device=r.device)
        keep = ~u
        if estimator == "vanilla":
            adv[keep] = r[keep].float()
        elif int(keep.sum()) >= 2:
            adv[keep] = compute_advantages(r[keep][None, :], estimator, sample_std=sample_std)[0]
        out.append(adv)
    return torch.cat(out) if out else torch.zeros(0)


def group_advantages(
    rewards: torch.Tensor,
    sizes: list[int],
    estimator: str,
    sample_std: bool = False,
    unscorable: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``[n]`` of rollouts whose rewards ``[n]`` sit group after group (``sizes``, in order): the
    estimator of each group (:func:`compute_advantages` for equal sizes, :func:`ragged_advantages` otherwise);
    with ``unscorable`` ``[n]`` (rollouts without a reward), or groups of one rollout, :func:`scorable_advantages`."""
    G = common_size(sizes)
    if not sizes:
        return torch.zeros(0, device=rewards.device)
    if unscorable is not None or (G is not None and G < 2):  # G = 1: no baseline (an evaluation's, as TRL's)
        declined = unscorable if unscorable is not None else torch.zeros(len(rewards), dtype=torch.bool)
        return scorable_advantages(list(rewards.split(sizes)), list(declined.to(rewards.device).split(sizes)),
                                   estimator, sample_std)  # fmt: skip
    if G is not None:
        return compute_advantages(rewards.view(len(sizes), G), estimator, sample_std=sample_std).reshape(-1)
    return ragged_advantages(list(rewards.split(sizes)), estimator, sample_std)


def normalize_then_sum(components: torch.Tensor, weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """GDPO's decoupled normalisation (``--reward-normalisation normalize-then-sum``): each reward function's values
    standardised within each group, ``(c_k - mean_group c_k) / (std_group c_k + 1e-4)`` (population std, as
    ``grpo_std``), then summed with the functions' weights: components ``[n, K]``, weights ``[K]``, the groups'
    sizes (in order) -> ``[n]`` (float64). Summing first (the usual) lets the function with the widest spread set the
    advantage; here each function moves it by the same amount per group standard deviation of its own.

    Each group's result sums to 0, so the step's mean is 0: :func:`batch_standardise` divides by the std alone. A
    function constant within a group contributes exactly 0 to it (centred on its first value, as
    :func:`compute_advantages` is)."""
    w = weights.double()
    parts = []
    for g in components.double().split(sizes):  # [n_b, K]
        shifted = g - g[:1]
        centred = shifted - shifted.mean(dim=0, keepdim=True)
        std = centred.pow(2).mean(dim=0, keepdim=True).sqrt()  # [1, K]
        parts.append((centred / (std + STD_EPS)) @ w)  # [n_b]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def batch_standardise(summed: torch.Tensor, total: float, total_sq: float, count: float) -> torch.Tensor:
    """GDPO's second normalisation: ``summed`` ``[n]`` divided by the population std of the whole step's values
    (all ranks: their ``total``, ``total_sq`` = sum of squares and ``count``) plus 1e-4. The mean is not subtracted:
    it is 0 by construction (:func:`normalize_then_sum`); TRL subtracts it, which differs by rounding only. TRL divides
    by sample stds (n - 1) at both stages: its advantages are these times sqrt((n - 1) / n) over the step's n
    rollouts (the groups' factor cancels), up to the 1e-4 terms; grpolab keeps the population form of grpo_std."""
    mean = total / max(count, 1.0)
    std = max(total_sq / max(count, 1.0) - mean * mean, 0.0) ** 0.5
    return summed / (std + STD_EPS)


def estimator_for_scale(estimator: str, scale: str) -> str:
    """``--scale-rewards``: which standard deviation divides grpo_std's centred advantages. ``group`` is grpo_std
    itself; ``batch`` and ``none`` start from the group-mean advantage (``grpo``); ``batch`` then divides it by
    :func:`batch_std`. Other estimators are left as they are (the config refuses the combination)."""
    return "grpo" if estimator == "grpo_std" and scale in ("batch", "none") else estimator


def batch_std(rewards: torch.Tensor, sample: bool = False) -> torch.Tensor:
    """The population standard deviation of every reward of the step (all groups, all ranks): a scalar.
    ``sample``: the sample standard deviation (n - 1 in the denominator), TRL's scale_rewards='batch'; grpolab's
    default keeps the population form of its group option [RLVR essay, Sec. 3.5]."""
    r = rewards.double().flatten()
    return _std(r - r.mean(), sample).float()


def turn_advantages(
    rewards: torch.Tensor,
    turns: torch.Tensor,
    estimator: str,
    credit: str = "grpo",
    values: torch.Tensor | None = None,
    sample_std: bool = False,
) -> torch.Tensor:
    """Advantages ``[G, H]`` of each turn of a group's G episodes, from their per-turn rewards ``[G, H]`` (0 after an
    episode's last turn) and turn counts ``turns`` ``[G]``; 0 after each episode's last turn.

    - ``grpo``: every turn gets the episode's advantage under ``estimator`` (:func:`compute_advantages` of the
      returns R_i = sum_h r_ih): uniform credit, the total return minus a baseline of the initial state
      [Foundations, Eq. 22]. With one turn this is the single-turn advantage, exactly.
    - ``rtg-group``: turn h gets its reward-to-go G_ih = sum_{h' >= h} r_ih' minus the estimator's baseline of the
      initial state: none (vanilla), the group mean of returns (grpo, grpo_std) or the mean of the others' (rloo).
      Past rewards no longer leak into a turn's credit; the value mismatch v(s_h) - v(s_1) of Eq. 23 stays.
    - ``rtg-mc``: G_ih minus ``values`` ``[G, H]``, a Monte Carlo value of the state before turn h (both parts of
      Eq. 23's bias removed, up to the values' noise).

    ``grpo_std`` divides the reward-to-go credits by the population std of the group's reward-to-go values over all
    its turns, plus 1e-4 (with one turn: the returns' std, as grpo_std itself). Not the returns' std: a group whose
    returns are equal can still differ turn by turn, and that std would be 0.
    """
    if rewards.dim() != 2 or turns.shape != rewards.shape[:1]:
        raise ValueError(f"rewards must be [G, H] and turns [G], got {tuple(rewards.shape)} and {tuple(turns.shape)}")
    G, H = rewards.shape
    live = torch.arange(H)[None, :] < turns[:, None]  # [G, H]
    r = rewards.double() * live
    rtg = r.flip(1).cumsum(1).flip(1)  # [G, H] reward-to-go
    returns = rtg[:, 0]  # [G]
    if credit == "grpo":
        return compute_advantages(returns.float()[None, :], estimator, sample_std=sample_std)[0][:, None] * live
    if credit not in CREDITS:
        raise ValueError(f"unknown --advantage {credit!r}; choose from {CREDITS}")
    if credit == "rtg-mc":
        if values is None or values.shape != rewards.shape:
            raise ValueError("rtg-mc needs a Monte Carlo value [G, H] of the state before each turn")
        base = values.double()
    elif estimator == "vanilla":
        base = torch.zeros(G, 1, dtype=torch.float64)
    elif estimator in ("grpo", "grpo_std", "rloo"):
        if G < 2:
            raise ValueError(f"estimator {estimator!r} needs a group of at least 2 episodes, got G={G}")
        if estimator == "rloo":
            base = ((returns.sum() - returns) / (G - 1))[:, None]  # [G, 1] the others' mean
        else:  # centred on the first: all-equal returns give exactly their value
            base = (returns[0] + (returns - returns[0]).mean()).expand(G)[:, None]  # [G, 1]
    else:
        raise ValueError(f"estimator {estimator!r} has no reward-to-go form; use grpo, grpo_std, rloo or vanilla")
    adv = (rtg - base) * live
    if estimator == "grpo_std":
        values_live = rtg[live]
        mean = values_live[0] + (values_live - values_live[0]).mean()
        adv = adv / (_std(values_live - mean, sample_std) + STD_EPS)
    return adv.float()


def token_advantages(turn_adv: list[torch.Tensor], turn: torch.Tensor, action: torch.Tensor, rows: list[int]):
    """``[m, T]`` each policy token's advantage: its turn's, from ``turn_adv`` (one ``[H_i]`` per episode), for token
    rows ``turn`` and ``action`` ``[m, T]`` where episode i holds ``rows[i]`` consecutive rows. 0 off the policy's
    tokens."""
    out = torch.zeros((sum(rows), turn.shape[1]), dtype=torch.float32)  # no rows: a stand-in row carries nothing
    r = 0
    for adv, k in zip(turn_adv, rows):
        for _ in range(k):
            t = turn[r].clamp(min=0).cpu()
            on = action[r].bool().cpu() & (turn[r].cpu() >= 0)
            if adv.numel():
                out[r] = torch.where(on, adv.float()[t.clamp(max=adv.numel() - 1)], 0.0)
            r += 1
    return out
