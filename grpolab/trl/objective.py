"""TRL's ``GRPOTrainer`` helpers of the objective, by TRL 1.16's names and signatures, computed by grpolab's own
functions (:mod:`grpolab.algo.loss`): ``get_high_entropy_mask`` (a method: TRL takes the quantile over every
process's tokens), ``get_off_policy_mask`` and ``get_gamma_weights`` (static). Each returns what TRL's returns, in
its dtype and shape."""

from __future__ import annotations

import torch

from grpolab.algo.loss import entropy_threshold, high_entropy_mask, off_policy_mask, vespo_weight
from grpolab.config.objective import TermSection


def get_high_entropy_mask(trainer, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """True on the real tokens whose entropy is at least the ``threshold``-quantile of every process's real tokens.

    Args:
        trainer: the :class:`grpolab.trl.GRPOTrainer` (its ``accelerator`` says this process's place).
        entropies (torch.Tensor): ``[N, T]`` per-token entropies.
        mask (torch.Tensor): ``[N, T]`` 1 on real tokens, 0 on padding.
        threshold (float): the quantile in [0, 1] (TRL passes ``1 - top_entropy_quantile``).

    Returns:
        torch.Tensor: ``[N, T]`` bool; all False when no process has a real token.
    """
    import torch.distributed as dist

    from grpolab.common import distributed

    local = entropies[mask.bool()].float()  # [M] this process's real tokens
    world = distributed.SINGLE
    if dist.is_available() and dist.is_initialized():
        acc = trainer.accelerator
        world = distributed.World(acc.process_index, acc.num_processes, acc.local_process_index)
    every = torch.cat([t.to(local.device) for t in distributed.gather(local.cpu(), world)])
    # grpolab's quantile names the top fraction kept: TRL's threshold q keeps the top 1 - q
    cut = entropy_threshold(every, 1.0 - threshold)
    return high_entropy_mask(entropies, mask, cut.to(entropies.device)).bool()


def get_off_policy_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    off_policy_threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (:func:`grpolab.algo.loss.off_policy_mask`): 1 to keep a rollout,
    0 to drop one whose advantage is negative and whose mean per-token ``sampling - current`` log-prob exceeds
    ``off_policy_threshold``.

    Args:
        advantages (torch.Tensor): ``[N, 1]``.
        per_token_logps (torch.Tensor): ``[N, T]`` the current policy's log-probs.
        sampling_per_token_logps (torch.Tensor): ``[N, T]`` the sampler's (NaN where it could not score a token).
        mask (torch.Tensor): ``[N, T]`` 1 on real tokens.
        off_policy_threshold (float): the mean log-prob gap above which a negative rollout is dropped.

    Returns:
        torch.Tensor: ``[N, 1]`` in ``mask``'s dtype.
    """
    keep = off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)
    return keep.to(mask.dtype)


def get_gamma_weights(
    advantages: torch.Tensor,
    log_ratio_per_token: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's gamma weight phi(w) of each rollout's importance weight (:func:`grpolab.algo.loss.vespo_weight`),
    detached.

    Args:
        advantages (torch.Tensor): ``[N, 1]``.
        log_ratio_per_token (torch.Tensor): ``[N, T]`` log(pi / pi_old).
        mask (torch.Tensor): ``[N, T]`` 1 on real tokens.
        importance_sampling_ratio: None only (grpolab's vespo folds no sampler correction into the weight).
        k_pos, lambda_pos, k_neg, lambda_neg (float): phi's constants where A >= 0 and where A < 0.

    Returns:
        torch.Tensor: ``[N, 1]``.

    Raises:
        ValueError: an ``importance_sampling_ratio`` given.
    """
    if importance_sampling_ratio is not None:
        raise ValueError(
            "get_gamma_weights(importance_sampling_ratio=...): grpolab's vespo folds no sampler correction into its "
            "sequence weight; pass None"
        )
    terms = TermSection(vespo_k_pos=k_pos, vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg, vespo_lambda_neg=lambda_neg)
    params = terms.term_params()
    return vespo_weight(log_ratio_per_token, mask, advantages, params)
