"""The sampling distribution (grpolab.models.sampling_rules) against vLLM 0.32's steps written out as its code takes
them, hand-computed cases of the penalty, top-k's ties and the replay's offset, and the sampler's draws: only kept
tokens, at the kept distribution's frequencies. A wrong order (min-p before the temperature, top-p before top-k)
gives other distributions here, and weights away from 1, so these tests tell the orders apart."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpolab.models.sampling_rules import (
    SamplingRules,
    processed_logits,
    sample_processed,
    sampling_log_offset,
    seen_tokens,
)


def _vllm_steps(z, temperature, rules: SamplingRules, seen, order: str = "vllm") -> torch.Tensor:
    """``[n, V]`` log-probs of vLLM's sampling distribution, step by step as vLLM 0.32 writes them (Sampler's
    apply_penalties, apply_temperature, MinPLogitsProcessor.apply, apply_top_k_top_p_pytorch: an ascending sort,
    top-k by the k-th largest logit, top-p masking the ascending cumulative mass <= 1 - p). ``order``: "min-p first"
    (before the temperature) or "top-p first" (before top-k), the wrong orders."""
    z = z.clone()
    if rules.repetition_penalty != 1.0:
        rho = rules.repetition_penalty
        z = z * torch.where(seen, torch.where(z > 0, 1.0 / rho, rho), 1.0)

    def min_p(z):
        p = z.softmax(-1)
        return z.masked_fill(p < rules.min_p * p.amax(-1, keepdim=True), -math.inf) if rules.min_p else z

    def top_k(zs):  # zs ascending
        return zs.masked_fill(zs < zs[:, -rules.top_k :][:, :1], -math.inf) if rules.top_k else zs

    def top_p(zs):
        if rules.top_p >= 1:
            return zs
        drop = zs.softmax(-1).cumsum(-1) <= 1 - rules.top_p
        drop[:, -1] = False
        return zs.masked_fill(drop, -math.inf)

    z = min_p(z) if order == "min-p first" else z
    z = z / temperature
    z = z if order == "min-p first" else min_p(z)
    zs, idx = z.sort(dim=-1)
    zs = top_k(top_p(zs)) if order == "top-p first" else top_p(top_k(zs))
    return z.scatter(1, idx, zs).log_softmax(-1)


CASES = {
    "top-k": SamplingRules(top_k=4),
    "top-p": SamplingRules(top_p=0.8),
    "min-p": SamplingRules(min_p=0.1),
    "penalty": SamplingRules(repetition_penalty=1.5),
    "all": SamplingRules(top_k=6, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_distribution_is_vllms_and_a_wrong_order_is_another(name):
    rules = CASES[name]
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(16, 30, generator=gen, dtype=torch.float64) * 2  # [n, V]
    seen = torch.rand(16, 30, generator=gen) < 0.3
    ours = processed_logits(z, 0.7, rules, seen).log_softmax(-1)
    theirs = _vllm_steps(z, 0.7, rules, seen)
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert float((ours - theirs)[ours.isfinite()].abs().max()) < 1e-12
    wrong = {"min-p": "min-p first", "all": "top-p first"}.get(name)  # the threshold at T; top-p after top-k
    if wrong:
        assert not torch.equal(_vllm_steps(z, 0.7, rules, seen, wrong).isinf(), ours.isinf())


def test_top_k_keeps_ties_the_penalty_by_hand_and_the_offset_of_a_dropped_token_is_finite():
    z = torch.tensor([[2.0, 2.0, 1.0, -1.0, 0.5]], dtype=torch.float64)
    seen = seen_tokens(torch.tensor([[2, 3, 3, 0]]), torch.tensor([[True, True, True, False]]), 5)  # 0: padding
    assert seen.tolist() == [[False, False, True, True, False]]
    rules = SamplingRules(top_k=1, repetition_penalty=2.0)
    kept = processed_logits(z, 1.0, rules, seen)  # penalised [2, 2, 0.5, -2, 0.5]: the two tied 2s kept
    assert kept[0, :2].tolist() == [2.0, 2.0] and bool(kept[0, 2:].isinf().all())
    full = z.log_softmax(-1)[0]
    offset = sampling_log_offset(z.expand(2, -1), torch.tensor([0, 3]), 1.0, rules, seen.expand(2, -1))
    assert offset[0].item() == pytest.approx(full[0].item() - math.log(0.5), abs=1e-12)
    # token 3, dropped: its own penalised logit against the kept set's normaliser (-1 -> -2)
    assert offset[1].item() == pytest.approx(full[3].item() - (-2.0 - math.log(2 * math.exp(2.0))), abs=1e-12)
    # greedy (T = 0) takes the argmax of the penalised logits: token 1's 3.0 becomes 1.0 < 2.0
    z0 = torch.tensor([[2.0, 3.0, 0.0]], dtype=torch.float64)
    tok, _ = sample_processed(
        z0, torch.zeros(1), 0.0, SamplingRules(repetition_penalty=3.0), torch.tensor([[0, 1, 0]]).bool()
    )
    assert tok.tolist() == [0]


PROBS = np.array([0.05, 0.25, 0.12, 0.40, 0.15, 0.03])


def test_the_sampler_draws_kept_tokens_only_at_their_frequencies_and_a_wrong_order_weighs_them_off_one():
    """T = 0.5, min-p 0.1: the probabilities are p^2 / sum p^2 and min-p keeps (p / 0.4)^2 >= 0.1, tokens 3, 1, 4
    (token 2's 0.09 is dropped); before the temperature it would keep p / 0.4 >= 0.1, tokens 0 to 4."""
    n, rules = 40_000, SamplingRules(min_p=0.1)
    logits = torch.log(torch.tensor(PROBS)).expand(n, -1)  # [n, V]
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, logp = sample_processed(logits, u, 0.5, rules)
    expected = np.zeros_like(PROBS)
    expected[[3, 1, 4]] = PROBS[[3, 1, 4]] ** 2 / (PROBS[[3, 1, 4]] ** 2).sum()
    freq = np.bincount(tok.numpy(), minlength=len(PROBS)) / n
    assert set(tok.tolist()) == {1, 3, 4}
    np.testing.assert_allclose(freq, expected, atol=0.01)  # 4 sigma at n = 40000
    np.testing.assert_allclose(logp.numpy(), np.log(expected[tok.numpy()]), atol=1e-12)
    # the trainer's replay: its log-prob at T = 0.5 minus its offset is the sampler's, so the weight is 1 ...
    trainer = (logits / 0.5).log_softmax(-1).gather(1, tok[:, None]).squeeze(1)
    offset = sampling_log_offset(logits, tok, 0.5, rules)
    assert float((trainer - (logp + offset)).abs().max()) < 1e-12
    # ... and a sampler that applied min-p before the temperature reports other log-probs: weights off 1
    wrong = _vllm_steps(logits[:1], 0.5, rules, None, "min-p first")[0, tok]
    assert float((trainer - (wrong + offset)).exp().sub(1).abs().min()) > 0.01
