"""Unit tests of grpolab.loss: aggregations, KL estimators, clipping, gradients, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import model_and_batch

from grpolab.algo.loss import AGGREGATIONS, aggregate, aggregation_weights, kl_penalty, policy_loss

# A 2x3 example with padding: row 0 has 2 tokens, row 1 has 1.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


# ---------------------------------------------------------------- aggregate


def test_seq_mean_token_mean_hand_computed():
    # row 0: (1 + 2) / 2 = 1.5; row 1: 4 / 1 = 4; mean over 2 rows: 5.5 / 2 = 2.75
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)


def test_token_mean_hand_computed():
    # (1 + 2 + 4) / 3 unmasked tokens = 7/3
    assert aggregate(VALUES, MASK, "token-mean").item() == pytest.approx(7 / 3)


def test_seq_mean_token_sum_norm_hand_computed():
    # (1 + 2 + 4) / (2 rows * max_len 5) = 0.7; without max_len, T = 3: 7 / 6
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(0.7)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)


def test_whole_batch_normalisers_override_the_batch_ones():
    # num_seqs=4: seq-mean: (1.5 + 4) / 4 = 1.375; token-mean with num_tokens=10: 7/10;
    # sum-norm: 7 / (4 * 5) = 0.35
    assert aggregate(VALUES, MASK, "seq-mean-token-mean", num_seqs=4).item() == pytest.approx(1.375)
    assert aggregate(VALUES, MASK, "token-mean", num_tokens=10).item() == pytest.approx(0.7)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_len=5, num_seqs=4).item() == pytest.approx(0.35)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_padding_values_do_not_count(mode):
    junk = VALUES.clone()
    junk[0, 2] = 1e6
    junk[1, 1:] = -3e5
    assert aggregate(junk, MASK, mode, max_len=5).item() == pytest.approx(
        aggregate(VALUES, MASK, mode, max_len=5).item()
    )


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("whole", [{}, {"max_len": 9, "num_seqs": 7, "num_tokens": 23.0}])
def test_aggregation_weights_are_the_weights_aggregate_puts_on_each_token(mode, whole):
    """One truth for the loss's per-token weights: aggregate(v) == sum(v * w), with this batch's or the whole
    batch's normalisers (a micro-batch); the gradient probes take their weights from the same function."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 6, generator=g) < 0.7).double()
    mask[2] = 0.0  # a rollout with no tokens contributes nothing
    w = aggregation_weights(mask, mode, **whole)
    assert float((values * w).sum()) == pytest.approx(float(aggregate(values, mask, mode, **whole)), rel=1e-14)
    assert (w[mask == 0] == 0).all()


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(VALUES, MASK, "mean")


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_computed():
    # pi = 0.5, pi_ref = 0.25: ref - logp = log(0.5) = -ln 2
    #   k1 = logp - ref = ln 2;  k2 = (ln 2)^2 / 2;  k3 = exp(-ln 2) + ln 2 - 1 = 0.5 + ln 2 - 1
    # pi = 0.2, pi_ref = 0.6: ref - logp = ln 3
    #   k1 = -ln 3;  k2 = (ln 3)^2 / 2;  k3 = 3 - ln 3 - 1 = 2 - ln 3
    # pi = pi_ref: all zero
    logp = torch.log(torch.tensor([0.5, 0.2, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.6, 0.3]))
    ln2, ln3 = math.log(2), math.log(3)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([ln2, -ln3, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([ln2**2 / 2, ln3**2 / 2, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 + ln2 - 1, 2 - ln3, 0.0]))


def test_k3_is_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_unknown_kl_raises():
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


# ---------------------------------------------------------------- policy_loss values


def test_policy_loss_hand_computed_with_k1_penalty():
    # ratio 1 everywhere (logp == old_logp), A = [1, -2] per row, beta 0.1, k1 = logp - ref:
    #   k1 = [[0.5, 1.0, (9)], [2.0, (9), (9)]]   (parenthesised entries are padding)
    #   per-token = -A + 0.1 * k1 = [[-0.95, -0.90, .], [2.2, ., .]]
    logp = torch.full((2, 3), -1.0)
    ref = logp - torch.tensor([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]])
    adv = torch.tensor([1.0, -2.0])
    kw = dict(ref_logp=ref, beta=0.1, kl="k1")
    # seq-mean-token-mean: ((-0.95 - 0.9) / 2 + 2.2) / 2 = (-0.925 + 2.2) / 2 = 0.6375
    loss, st = policy_loss(logp, logp, adv, MASK, aggregation="seq-mean-token-mean", **kw)
    assert loss.item() == pytest.approx(0.6375, abs=1e-6)
    # surrogate part alone: (-1 + 2) / 2 = 0.5; KL token mean over 3 real tokens: 3.5 / 3
    assert st["policy"].item() == pytest.approx(0.5, abs=1e-6)
    assert st["kl"].item() == pytest.approx(3.5 / 3, abs=1e-6)
    assert st["clip_frac"].item() == 0.0
    assert st["ratio_mean"].item() == pytest.approx(1.0)
    # token-mean: (-0.95 - 0.9 + 2.2) / 3 = 0.35 / 3
    loss, _ = policy_loss(logp, logp, adv, MASK, aggregation="token-mean", **kw)
    assert loss.item() == pytest.approx(0.35 / 3, abs=1e-6)
    # Dr. GRPO: 0.35 / (2 * max_len 4) = 0.04375
    loss, _ = policy_loss(logp, logp, adv, MASK, aggregation="seq-mean-token-sum-norm", max_len=4, **kw)
    assert loss.item() == pytest.approx(0.04375, abs=1e-6)


def test_kl_ratio_weights_each_token_s_kl_by_its_importance_ratio_hand_computed():
    # A = 0 (only the KL term), beta 0.1, k1 = logp - ref = [[0.5, 1.0], [2.0]] on the real tokens, token-mean.
    # Token ratios r = exp(logp - old) = [[2, 1], [0.5]]: loss = 0.1 * (2 * 0.5 + 1 * 1.0 + 0.5 * 2.0) / 3 = 0.1,
    # and d/dlogp (r k1) = r k1 + r: gradient 0.1 / 3 * [[3, 2], [1.5]].
    # GSPO's rollout ratios s = exp(mean_t log r) = [sqrt 2, 0.5]: loss = 0.1 * (sqrt2 * 1.5 + 0.5 * 2) / 3, and
    # d s_i / d logp_it = s_i / |o_i|: gradient 0.1 / 3 * s_i * (1 + sum_t k1_it / |o_i|) = [[1.75 sqrt2] * 2, [1.5]].
    logp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    old = -1.0 - torch.tensor([[math.log(2.0), 0.0, 7.0], [math.log(0.5), 7.0, 7.0]], dtype=torch.float64)
    ref = -1.0 - torch.tensor([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]], dtype=torch.float64)
    adv = torch.zeros(2, dtype=torch.float64)
    kw = dict(ref_logp=ref, beta=0.1, kl="k1", aggregation="token-mean")
    loss, st = policy_loss(logp, old, adv, MASK, kl_ratio=True, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.1, abs=1e-12)
    assert st["kl"].item() == pytest.approx(1.0, abs=1e-12)  # the weighted KL, as TRL logs it
    assert torch.allclose(grad, 0.1 / 3 * torch.tensor([[3.0, 2.0, 0.0], [1.5, 0.0, 0.0]], dtype=torch.float64))
    loss, _ = policy_loss(logp, old, adv, MASK, kl_ratio=True, importance_sampling="sequence", **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.1 * (math.sqrt(2) * 1.5 + 1.0) / 3, abs=1e-12)
    s2 = 1.75 * math.sqrt(2)
    assert torch.allclose(grad, 0.1 / 3 * torch.tensor([[s2, s2, 0.0], [1.5, 0.0, 0.0]], dtype=torch.float64))
    # off (the default): the plain token mean of k1, 3.5 / 3, whatever the ratios
    loss, st = policy_loss(logp, old, adv, MASK, **kw)
    assert loss.item() == pytest.approx(0.1 * 3.5 / 3, abs=1e-12)
    assert st["kl"].item() == pytest.approx(3.5 / 3, abs=1e-12)


def test_beta_without_reference_raises():
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), MASK, beta=0.1)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="must match"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2), MASK)


# ---------------------------------------------------------------- clipping


def _leaf_logp(old: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    return (old + torch.log(ratio)).requires_grad_(True)


def test_clipping_zeroes_the_gradient_where_the_clipped_branch_is_active():
    # eps = 0.2, so the trust region is [0.8, 1.2]. Row 0 has A = +1 and 3 real tokens, row 1 A = -1 and 4.
    #   row 0: ratio 1.5 -> min(1.5, 1.2)   = 1.2  clipped   (grad 0)
    #          ratio 0.5 -> min(0.5, 0.8)   = 0.5  unclipped (grad -A*r/(N*len) = -0.5/6 = -1/12)
    #          ratio 1.0 -> inside                 (grad -1/6)
    #          ratio 1.5 -> padding                (grad 0, not counted)
    #   row 1: ratio 1.5 -> min(-1.5, -1.2) = -1.5 unclipped (grad +1.5/8)
    #          ratio 0.5 -> min(-0.5, -0.8) = -0.8 clipped   (grad 0)
    #          ratio 1.1 -> inside                 (grad +1.1/8)
    #          ratio 0.7 -> min(-0.7, -0.8) = -0.8 clipped   (grad 0)
    # clip_frac = 3 clipped real tokens / 7 real tokens.
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, -2.5, -0.3]])
    ratio = torch.tensor([[1.5, 0.5, 1.0, 1.5], [1.5, 0.5, 1.1, 0.7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    logp = _leaf_logp(old, ratio)
    loss, st = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    expected = torch.tensor([[0.0, -1 / 12, -1 / 6, 0.0], [1.5 / 8, 0.0, 1.1 / 8, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)
    assert st["clip_frac"].item() == pytest.approx(3 / 7)
    # loss: row 0: -(1.2 + 0.5 + 1.0) / 3 = -0.9; row 1: -(-1.5 - 0.8 - 1.1 - 0.8) / 4 = 1.05; mean 0.075
    assert loss.item() == pytest.approx(0.075, abs=1e-6)


def test_asymmetric_clip_bounds():
    # clip_low 0.1, clip_high 0.3: region [0.9, 1.3].
    #   A = +1: ratio 1.25 inside (grad), 1.35 clipped (0).   A = -1: ratio 0.95 inside (grad), 0.85 clipped (0).
    old = torch.zeros(2, 2)
    ratio = torch.tensor([[1.25, 1.35], [0.95, 0.85]])
    logp = _leaf_logp(old, ratio)
    loss, st = policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), clip_low=0.1, clip_high=0.3)
    loss.backward()
    # grad = -A * r / (N * len) = -A * r / 4
    expected = torch.tensor([[-1.25 / 4, 0.0], [0.95 / 4, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)
    assert st["clip_frac"].item() == pytest.approx(2 / 4)


def test_vector_advantages_equal_broadcast_matrix_advantages():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=g) - 2
    logp1 = (old + 0.3 * torch.randn(4, 5, generator=g)).requires_grad_(True)
    logp2 = logp1.detach().clone().requires_grad_(True)
    mask = (torch.rand(4, 5, generator=g) > 0.3).long()
    adv = torch.randn(4, generator=g)
    for aggregation in AGGREGATIONS:
        logp1.grad = logp2.grad = None
        l1, s1 = policy_loss(logp1, old, adv, mask, aggregation=aggregation)
        l2, s2 = policy_loss(logp2, old, adv[:, None].expand(4, 5), mask, aggregation=aggregation)
        l1.backward()
        l2.backward()
        assert l1.item() == pytest.approx(l2.item(), abs=1e-7)
        torch.testing.assert_close(logp1.grad, logp2.grad)
        assert s1["clip_frac"].item() == s2["clip_frac"].item()
        assert logp1.grad.abs().sum() > 0


def test_gradient_at_ratio_one_is_minus_a_over_n_len():
    # d/d logp_it of -(1/N) sum_i (1/len_i) sum_t m_it * exp(logp_it - old_it) * A_i at ratio 1
    # is -A_i / (N * len_i) on real tokens and 0 on padding.
    g = torch.Generator().manual_seed(4)
    N, T = 5, 6
    logp = (torch.randn(N, T, generator=g) - 1).requires_grad_(True)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    )
    lengths = [6, 2, 1, 3, 5]
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.25])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, beta=0.0, aggregation="seq-mean-token-mean")
    loss.backward()
    expected = torch.tensor(
        [[-adv[i].item() / (N * lengths[i]) * mask[i, t].item() for t in range(T)] for i in range(N)]
    )
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- micro-batching


def _chunks_with_trimmed_columns(mask: torch.Tensor, sizes: list[int]):
    """Row chunks, each with trailing all-padding columns cut (as the trainer's micro-batches are)."""
    start = 0
    for size in sizes:
        idx = torch.arange(start, start + size)
        cols = int((mask[idx].sum(0) > 0).nonzero().max()) + 1
        yield idx, cols
        start += size


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_micro_batches_sum_to_the_whole_batch_gradient(aggregation, beta):
    g = torch.Generator().manual_seed(5)
    N, T, max_len = 6, 7, 9
    lengths = [7, 2, 3, 1, 5, 4]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    old = torch.randn(N, T, generator=g) - 2
    ref = old + 0.5 * torch.randn(N, T, generator=g)
    logp0 = old + 0.3 * torch.randn(N, T, generator=g)  # ratios spread over and beyond [0.8, 1.2]
    adv = torch.randn(N, generator=g)
    common = dict(
        clip_low=0.2, clip_high=0.28, ref_logp=None, beta=beta, kl="k3", aggregation=aggregation, max_len=max_len
    )

    whole = logp0.clone().requires_grad_(True)
    loss, st = policy_loss(whole, old, adv, mask, **{**common, "ref_logp": ref})
    loss.backward()
    assert 0 < st["clip_frac"].item() < 1  # both branches are exercised

    micro = logp0.clone().requires_grad_(True)
    total, num_tokens = 0.0, float(mask.sum())
    for idx, cols in _chunks_with_trimmed_columns(mask, [2, 3, 1]):
        lp = micro[idx, :cols]
        l_c, _ = policy_loss(
            lp,
            old[idx, :cols],
            adv[idx],
            mask[idx, :cols],
            **{**common, "ref_logp": ref[idx, :cols]},
            num_seqs=N,
            num_tokens=num_tokens,
        )
        l_c.backward()
        total += l_c.item()
    assert total == pytest.approx(loss.item(), abs=1e-6)
    torch.testing.assert_close(micro.grad, whole.grad, rtol=1e-5, atol=1e-7)
    assert whole.grad.abs().sum() > 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_micro_batches_through_a_real_model_give_the_whole_batch_gradient(aggregation, beta):
    from grpolab.common.batch import select
    from grpolab.models.logprobs import completion_logprobs

    model, batch = model_and_batch()
    N, max_len = batch.completion_ids.shape[0], 8
    mask = batch.completion_mask
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        base = completion_logprobs(model, batch)  # [N, T]
    old = base + 0.3 * torch.randn(base.shape, generator=g) * mask
    ref = base + 0.5 * torch.randn(base.shape, generator=g) * mask
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.8, -0.1])
    kw = dict(
        clip_low=0.2,
        clip_high=0.2,
        beta=beta,
        kl="k3",
        aggregation=aggregation,
        max_len=max_len,
        num_seqs=N,
        num_tokens=float(mask.sum()),
    )

    def grads():
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, batch)
    loss, st = policy_loss(logp, old, adv, mask, ref_logp=ref, **kw)
    loss.backward()
    whole = grads()
    assert 0 < st["clip_frac"].item() < 1

    model.zero_grad(set_to_none=True)
    total = 0.0
    for idx in (torch.tensor([0, 1]), torch.tensor([2, 3, 4]), torch.tensor([5])):
        sub = select(batch, idx)  # trims left prompt padding and right completion padding
        Tc = sub.completion_ids.shape[1]
        logp_c = completion_logprobs(model, sub)
        l_c, _ = policy_loss(logp_c, old[idx, :Tc], adv[idx], sub.completion_mask, ref_logp=ref[idx, :Tc], **kw)
        l_c.backward()
        total += l_c.item()
    micro = grads()

    assert total == pytest.approx(loss.item(), abs=1e-6)
    assert whole.keys() == micro.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(micro[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    assert sum(float(v.abs().sum()) for v in whole.values()) > 1e-3


def test_token_budget_chunks_cover_every_row_once_within_the_budget():
    from grpolab.training.micro_batches import token_budget_chunks

    rows = torch.tensor([0, 2, 3, 5, 6, 7])
    p_lens = torch.tensor([3, 9, 5, 6, 1, 2, 8, 4])
    c_lens = torch.tensor([4, 9, 6, 3, 9, 5, 40, 2])
    budget = 30
    chunks = token_budget_chunks(rows, p_lens, c_lens, budget)
    assert sorted(int(r) for c in chunks for r in c) == rows.tolist()  # every row, once
    for c in chunks:
        cost = len(c) * (int(p_lens[c].max()) + int(c_lens[c].max()))
        assert cost <= budget or len(c) == 1  # row 6 (48 tokens) runs alone
    # longest first (48 | 11, 9 | 7, 7, 6 tokens): a pass grows while rows x (longest prompt + completion) <= 30
    assert [c.tolist() for c in chunks] == [[6], [2, 3], [0, 5, 7]]
    # --packing: a pass costs its rows' own tokens (11 + 9 + 7 = 27 <= 30; + 7 would be 34)
    packed = token_budget_chunks(rows, p_lens, c_lens, budget, packed=True)
    assert [c.tolist() for c in packed] == [[6], [0, 2, 3], [5, 7]]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_a_token_budget_plan_gives_the_whole_batch_gradient(aggregation, packing):
    """The update planned by --micro-batch-tokens (passes of different sizes, rows out of order; with --packing each
    pass packed without padding) and the update of the whole padded batch in one pass leave the same gradient, in
    float64."""
    import copy

    from transformers import get_scheduler

    from grpolab.common.distributed import SINGLE
    from grpolab.config.train import TrainConfig
    from grpolab.training.forward import TrainModule
    from grpolab.training.micro_batches import token_budget_chunks
    from grpolab.training.update import Updater
    from grpolab.training.update_options import UpdateSections

    model, batch = model_and_batch()
    model = model.double()
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.8, -0.1], dtype=torch.float64)

    def gradient(packing: bool = False, **plan) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model)
        cfg = TrainConfig(aggregation=aggregation, beta=0.04, max_grad_norm=0.0, **plan)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        sched = get_scheduler("constant", opt)
        ref = TrainModule(copy.deepcopy(model).eval().requires_grad_(False), 1.0, packing=packing)
        policy = TrainModule(m, 1.0, packing=packing)
        assert policy.packing == packing
        Updater(UpdateSections.of(cfg), policy, opt, sched, SINGLE, eos_id=2, reference=ref)(batch, adv)
        return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}

    lens = (batch.prompt_mask.sum(1), batch.completion_mask.sum(1))
    plan = token_budget_chunks(torch.arange(6), *lens, 20, packed=packing)
    assert [c.tolist() for c in plan] == ([[2, 3], [0, 4], [1, 5]] if packing else [[2], [0, 3], [4, 5], [1]])
    whole, budgeted = gradient(), gradient(packing, micro_batch_tokens=20)
    assert whole.keys() == budgeted.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(budgeted[name], whole[name], rtol=1e-10, atol=1e-13, msg=name)
    assert sum(float(v.abs().sum()) for v in whole.values()) > 1e-3


def test_theclip_sides_and_their_extremes_by_hand():
    """Each side's clipped share as TRL's clip_ratio counts it (below 1 - eps with A < 0, above 1 + eps with A > 0),
    token means over the mask, and the least and greatest share of one rollout (a rollout without a token left out)."""
    from grpolab.algo.loss import clip_sides

    ratio = torch.tensor([[0.5, 1.0, 1.5], [1.3, 1.3, 1.0], [0.7, 0.7, 0.9], [0.1, 9.0, 0.1]])  # [N=4, T=3]
    adv = torch.tensor([[-1.0], [1.0], [-1.0], [1.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    st = clip_sides(ratio, adv, 0.2, 0.2, mask)
    # low: row 0 token 0, row 2 tokens 0-1 (3 of 8 tokens); high: row 1 tokens 0-1 (2 of 8); row 3 has no token
    assert st["clip_low"].item() == pytest.approx(3 / 8) and st["clip_high"].item() == pytest.approx(2 / 8)
    assert st["clip_low_min"].item() == pytest.approx(0.0)  # row 1's low share
    assert st["clip_high_max"].item() == pytest.approx(1.0)  # row 1: both of its tokens
    seq = clip_sides(torch.tensor([[0.5], [1.0]]), torch.tensor([[-1.0], [-1.0]]), 0.2, 0.2, mask[:2])
    assert (seq["clip_low_min"].item(), seq["clip_low"].item()) == (0.0, pytest.approx(3 / 5))  # GSPO's [N, 1]
