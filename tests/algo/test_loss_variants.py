"""The loss variants TRL and verl users reach for, each against an independent formula written here:
GSPO's sequence-level ratio, two-sided clipping (delta), high-entropy token selection, DAPO's
overlong punishment, the batch-std advantage scale, and the sampler's token entropies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpolab.algo.advantages import STD_EPS, batch_std, compute_advantages, estimator_for_scale
from grpolab.algo.loss import AGGREGATIONS, entropy_threshold, high_entropy_mask, policy_loss, sequence_log_ratio
from grpolab.rewards.builtin import overlong_penalty


def _random(seed: int, N: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, T, generator=g) * 3).double().requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logp, old, mask, adv


def _aggregate_by_hand(per_token: torch.Tensor, mask: torch.Tensor, mode: str, T: int) -> torch.Tensor:
    m = mask.double()
    if mode == "seq-mean-token-mean":
        return torch.stack([(per_token[i] * m[i]).sum() / m[i].sum() for i in range(len(m))]).mean()
    if mode == "token-mean":
        return (per_token * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return torch.stack([(per_token[i] * m[i]).sum() for i in range(len(m))]).mean()
    return (per_token * m).sum() / (len(m) * T)


# ---------------------------------------------------------------- GSPO


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_sequence_ratio_loss_against_the_gspo_formula(aggregation):
    logp, old, mask, adv = _random(0)
    eps_lo, eps_hi = 0.05, 0.08
    loss, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=eps_lo,
        clip_high=eps_hi,
        aggregation=aggregation,
        importance_sampling="sequence",
        max_len=7,
    )
    # GSPO: s_i = (prod_t pi/pi_old)^(1/|o_i|), one clipped term per rollout, the same on each of its tokens
    rows = []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        s = torch.exp((logp[i, :n] - old[i, :n]).sum() / n)
        term = -torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * adv[i])
        rows.append(term.expand(logp.shape[1]))
    expected = _aggregate_by_hand(torch.stack(rows), mask, aggregation, 7)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_sequence_log_ratio_is_the_length_normalised_sum():
    logp, old, mask, _ = _random(1)
    lr = sequence_log_ratio(logp, old, mask)
    assert lr.shape == (6, 1)
    for i in range(6):
        n = int(mask[i].sum())
        assert float(lr[i, 0]) == pytest.approx(float((logp[i, :n] - old[i, :n]).mean()))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_at_ratio_one_sequence_and_token_ratios_give_the_same_gradient(aggregation):
    """The first update of a step (old = current): GSPO's gradient is GRPO's, for every aggregation."""
    logp, _, mask, adv = _random(2)
    grads = []
    for level in ("token", "sequence"):
        loss, _ = policy_loss(
            logp, logp.detach(), adv, mask, aggregation=aggregation, importance_sampling=level, max_len=7
        )
        grads.append(torch.autograd.grad(loss, logp)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def test_unknown_importance_sampling_level_raises():
    logp, old, mask, adv = _random(3)
    with pytest.raises(ValueError, match="importance sampling"):
        policy_loss(logp, old, adv, mask, importance_sampling="tokens")


# ---------------------------------------------------------------- two-sided clipping


def test_clip_delta_caps_the_ratio_of_negative_advantages_only():
    ratio = torch.tensor([[3.0, 0.5, 3.0, 1.1]], dtype=torch.float64)
    logp = torch.log(ratio).requires_grad_(True)
    old = torch.zeros_like(ratio)
    mask = torch.ones_like(ratio, dtype=torch.long)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    per_token = []
    for delta in (None, 2.0):
        loss, _ = policy_loss(
            logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_delta=delta, aggregation="token-mean"
        )
        per_token.append(float(loss) * 4)
    # no delta: -min(rA, clip(r)A) = [3, 0.8, -1.2, 1.1]; delta 2: the first becomes -min(2 * -1, 1.2 * -1) = 2
    assert per_token[0] == pytest.approx(3 + 0.8 - 1.2 + 1.1)
    assert per_token[1] == pytest.approx(2 + 0.8 - 1.2 + 1.1)


def test_clip_delta_agrees_with_an_elementwise_formula():
    logp, old, mask, adv = _random(4)
    adv = adv * 3
    old = old - 1.0  # ratios up to e^2: some exceed delta
    delta = 1.6
    loss, _ = policy_loss(logp, old, adv, mask, clip_delta=delta, aggregation="token-mean")
    r = torch.exp(logp - old)
    a = adv[:, None]
    expected = _aggregate_by_hand(
        -torch.minimum(torch.clamp(r, max=delta) * a, torch.clamp(r, 0.8, 1.2) * a), mask, "token-mean", 7
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert (r[mask.bool()] > delta).any()


# ---------------------------------------------------------------- high-entropy tokens


def test_entropy_threshold_is_numpys_quantile_and_selects_the_top_fraction():
    values = torch.arange(1.0, 11.0)  # 1..10
    th = entropy_threshold(values, 0.2)
    assert float(th) == pytest.approx(float(np.quantile(values.numpy(), 0.8)))  # 8.2
    ent = values.view(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    sel = high_entropy_mask(ent, mask, th)
    assert sel.sum() == 2 and sel[1, 3] == 1 and sel[1, 4] == 1  # 9 and 10: the top 20 %
    mask[1, 4] = 0
    assert high_entropy_mask(ent, mask, th)[1, 4] == 0  # padding never selected
    g = torch.Generator().manual_seed(0)
    many = torch.rand(10_000, generator=g)
    for q in (0.05, 0.2, 0.5):
        frac = float((many >= entropy_threshold(many, q)).double().mean())
        assert frac == pytest.approx(q, abs=1e-3)


def test_token_weights_remove_the_policy_term_but_keep_the_kl_and_the_normaliser():
    logp, old, mask, adv = _random(5)
    ref = logp.detach() - 0.2
    w = (torch.rand(6, 7, generator=torch.Generator().manual_seed(1)) > 0.5).double()
    loss, st = policy_loss(
        logp, old, adv, mask, ref_logp=ref, beta=0.1, aggregation="seq-mean-token-mean", token_weights=w
    )
    r = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    expected = _aggregate_by_hand(-surrogate * w + 0.1 * kl, mask, "seq-mean-token-mean", 7)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


# ---------------------------------------------------------------- DAPO overlong punishment


def test_overlong_penalty_is_zero_then_linear_to_minus_the_penalty():
    lengths = torch.tensor([5, 16, 17, 20, 24])
    pen = overlong_penalty(lengths, max_len=24, buffer=8, penalty=0.5)
    # expected length 24 - 8 = 16: -(L - 16) / 8 * 0.5 beyond it
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.0625, -0.25, -0.5]))
    assert overlong_penalty(lengths, 24, 0, 0.5).abs().sum() == 0


# ---------------------------------------------------------------- --scale-rewards


def test_scale_rewards_group_batch_none():
    g = torch.Generator().manual_seed(3)
    rewards = (torch.rand(4, 6, generator=g) > 0.5).float() + 0.1 * torch.rand(4, 6, generator=g)
    r = rewards.double().numpy()
    centred = r - r.mean(axis=1, keepdims=True)
    group = compute_advantages(rewards, estimator_for_scale("grpo_std", "group"))
    np.testing.assert_allclose(group.numpy(), centred / (r.std(axis=1, keepdims=True) + STD_EPS), rtol=1e-5, atol=1e-6)
    none = compute_advantages(rewards, estimator_for_scale("grpo_std", "none"))
    np.testing.assert_allclose(none.numpy(), centred, rtol=1e-5, atol=1e-6)
    batch = none / (batch_std(rewards) + STD_EPS)
    np.testing.assert_allclose(
        batch.numpy(), centred / (r.std() + STD_EPS), rtol=1e-5, atol=1e-6
    )  # numpy: population std
    assert estimator_for_scale("rloo", "batch") == "rloo"


# ---------------------------------------------------------------- the sampler's token entropies


def test_sampler_entropies_and_logprobs_equal_a_teacher_forced_forward():
    from grpolab.models.policy import load_policy
    from grpolab.rollout.sampler import sample, sample_with_stats

    policy = load_policy("builtin")
    prompts = [policy.prompt_ids({"question": q}) for q in ("12+7", "3*(4+5)")] * 2
    keys = [(9, i) for i in range(4)]
    kw = dict(max_new_tokens=16, temperature=0.7, top_p=0.9, eos_id=policy.eos_id, pad_id=policy.pad_id)
    batch, logp, ent = sample_with_stats(policy.model, prompts, keys, **kw)
    plain = sample(policy.model, prompts, keys, **kw)
    assert all(torch.equal(a, b) for a, b in zip(batch.tensors, plain.tensors))  # the same tokens
    with torch.no_grad():
        for i in range(4):
            p = [t for t, m in zip(batch.prompt_ids[i].tolist(), batch.prompt_mask[i].tolist()) if m]
            c = batch.completion_ids[i][batch.completion_mask[i].bool()].tolist()
            logits = policy.model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)].double() / 0.7
            probs = torch.softmax(logits, -1)
            expected = -(probs * torch.log(probs)).sum(-1)
            torch.testing.assert_close(ent[i, : len(c)].double(), expected, rtol=1e-4, atol=1e-4)
            assert (ent[i, len(c) :] == 0).all()
            # the sampler's log-prob of each sampled token: under the distribution it sampled from, softmax(logits / T)
            # cut to the top-p nucleus (the fewest most likely tokens holding >= 0.9) and renormalised
            for t, tok in enumerate(c):
                p_sorted, order = probs[t].sort(descending=True)
                n_keep = int((p_sorted.cumsum(0) < 0.9).sum()) + 1
                nucleus = order[:n_keep].tolist()
                assert tok in nucleus
                expected_lp = math.log(probs[t, tok] / p_sorted[:n_keep].sum())
                assert float(logp[i, t]) == pytest.approx(expected_lp, abs=1e-4)
            assert (logp[i, len(c) :] == 0).all()
