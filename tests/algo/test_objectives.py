"""The policy terms other than the clipped ratio (--loss-type cispo, sapo, luspo, vespo) and DeepSeek-V3.2's off-policy
sequence mask, each against values computed here by hand, element by element, from the papers' formulas; and
micro-batches of any size giving the whole batch's gradient for each. (Against TRL's own loss: algo/test_vs_trl.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.algo.advantages import batch_standardise, normalize_then_sum
from grpolab.algo.entropy_bonus import EntropyControl, entropy_bonus
from grpolab.algo.loss import (
    LOSS_TYPES,
    aggregate,
    cispo_term,
    effective_aggregation,
    off_policy_mask,
    policy_loss,
    sapo_term,
    vespo_weight,
)
from grpolab.config.objective import TermSection
from grpolab.config.train import ConfigError, TrainConfig

TERMS = TermSection().term_params()  # the policy terms' constants at the options' defaults


def _random(seed: int, N: int = 6, T: int = 7, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    logp = (old + spread * torch.randn(N, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logp, old, mask, adv


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------- each term by hand


def test_cispo_term_hand_computed():
    # three tokens: ratio 0.5 (kept), 1.0 (kept), 3.0 (truncated at cap 2)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ratio = torch.tensor([[0.5, 1.0, 3.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0]], dtype=torch.float64)
    term, truncated = cispo_term(ratio, logp, adv, cap=2.0)
    assert term.tolist() == [[0.5 * 2 * -1.0, 1.0 * 2 * -2.0, 2.0 * 2 * -0.5]]
    assert truncated.tolist() == [[False, False, True]]
    term.sum().backward()  # the weight is a constant: d/dlogp = min(ratio, cap) * A, the truncated token included
    assert logp.grad.tolist() == [[1.0, 2.0, 4.0]]


def test_sapo_term_hand_computed_and_its_gradient_at_ratio_one_is_grpo_s():
    ratio = torch.tensor([[0.7, 1.0, 1.4], [0.7, 1.0, 1.4]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.5], [-0.5]], dtype=torch.float64)
    tp, tn = 1.0, 1.05
    term, clipped = sapo_term(ratio, adv, tp, tn)
    for i, (a, tau) in enumerate([(1.5, tp), (-0.5, tn)]):
        for t, r in enumerate([0.7, 1.0, 1.4]):
            assert term[i, t].item() == pytest.approx(4 / tau * _sigmoid(tau * (r - 1)) * a, rel=1e-14)
    assert not clipped.any()
    term.sum().backward()
    for i, (a, tau) in enumerate([(1.5, tp), (-0.5, tn)]):
        for t, r in enumerate([0.7, 1.0, 1.4]):
            s = _sigmoid(tau * (r - 1))
            assert ratio.grad[i, t].item() == pytest.approx(4 * s * (1 - s) * a, rel=1e-12)
    assert ratio.grad[0, 1].item() == pytest.approx(1.5, rel=1e-14)  # at ratio 1: A, as GRPO
    assert ratio.grad[1, 1].item() == pytest.approx(-0.5, rel=1e-14)
    # the gate fades away from 1: a token far off-policy moves less than one near it
    assert abs(ratio.grad[0, 2]) < abs(ratio.grad[0, 1]) and abs(ratio.grad[0, 0]) < abs(ratio.grad[0, 1])


def test_vespo_weight_hand_computed():
    p = TERMS
    # rollout 0: two tokens, log ratios 0.1 and 0.2 (w = e^0.3), A > 0; rollout 1: one token (second masked), log
    # ratio -0.4, A < 0; rollout 2: on-policy (w = 1): phi = 1
    log_ratio = torch.tensor([[0.1, 0.2], [-0.4, 9.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv = torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    phi = vespo_weight(log_ratio, mask, adv, p)

    def by_hand(w: float, k: float, lam: float) -> float:  # phi(w) = e^lam w^k e^(-lam w)
        return math.exp(lam) * w**k * math.exp(-lam * w)

    assert phi[0, 0].item() == pytest.approx(by_hand(math.exp(0.3), p.vespo_k_pos, p.vespo_lambda_pos), rel=1e-12)
    assert phi[1, 0].item() == pytest.approx(by_hand(math.exp(-0.4), p.vespo_k_neg, p.vespo_lambda_neg), rel=1e-12)
    assert phi[2, 0].item() == pytest.approx(1.0, rel=1e-15)
    assert phi[0, 0] < 1 and phi[1, 0] < 1  # the weight falls off on both sides of w = 1


def test_vespo_term_is_phi_times_a_logp_with_phi_detached():
    logp, old, mask, adv = _random(3, spread=0.05)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="vespo", aggregation="token-mean", params=TERMS)
    m = mask.double()
    expected, grad = 0.0, torch.zeros_like(old)
    for i in range(len(m)):
        n = int(m[i].sum())
        w = math.exp(float((logp.detach()[i, :n] - old[i, :n]).sum()))
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phi = math.exp(lam + k * math.log(w) - lam * w)
        expected += -(phi * adv[i] * logp[i, :n]).sum().item()
        grad[i, :n] = -phi * adv[i]
    total = m.sum().item()
    assert loss.item() == pytest.approx(expected / total, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad / total, rtol=1e-12, atol=0)


def test_luspo_sums_each_rollout_s_clipped_terms():
    logp, old, mask, adv = _random(4)
    a = policy_loss(logp, old, adv, mask, loss_type="luspo", aggregation="seq-mean-token-sum", clip_high=0.28)[0]
    expected = 0.0
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        r = torch.exp(logp[i, :n] - old[i, :n])
        expected += -torch.minimum(r * adv[i], r.clamp(0.8, 1.28) * adv[i]).sum().item()
    assert a.item() == pytest.approx(expected / mask.shape[0], rel=1e-12)
    # sequence ratio (the paper's setting): each rollout's term times its length
    s = policy_loss(
        logp, old, adv, mask, loss_type="luspo", aggregation="seq-mean-token-sum", importance_sampling="sequence"
    )[0]
    expected = 0.0
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        r = torch.exp((logp[i, :n] - old[i, :n]).mean())
        expected += -n * torch.minimum(r * adv[i], r.clamp(0.8, 1.2) * adv[i]).item()
    assert s.item() == pytest.approx(expected / mask.shape[0], rel=1e-12)


def test_seq_mean_token_sum_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(7 / 7)


def test_off_policy_mask_drops_negative_advantages_that_drifted_only():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    sampled = torch.tensor([[-0.2, -0.4], [-0.2, -0.4], [-0.95, -1.0], [-0.2, math.nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1]])
    adv = torch.tensor([[-1.0], [1.0], [-1.0], [-1.0]], dtype=torch.float64)
    # mean gaps: 0.7, 0.7, 0.025, (0.8 + 0) / 2 = 0.4 (a NaN sampler log-prob counts 0)
    keep = off_policy_mask(adv, logp, sampled, mask, threshold=0.5)
    assert keep.tolist() == [[0.0], [1.0], [1.0], [1.0]]
    assert off_policy_mask(adv, logp, sampled, mask, threshold=0.3).tolist() == [[0.0], [1.0], [1.0], [0.0]]


def test_the_off_policy_mask_removes_the_masked_rollout_from_the_loss_and_keeps_the_normaliser():
    logp, old, mask, adv = _random(6)
    adv[0] = -abs(adv[0])
    sampled = old.clone()
    sampled[0] = logp.detach()[0] + 1.0  # rollout 0 drifted far: mean gap 1 > 0.5
    masked, _ = policy_loss(logp, old, adv, mask, off_policy_threshold=0.5, sampling_logp=sampled)
    weights = torch.ones_like(old)
    weights[0] = 0
    by_weights, _ = policy_loss(logp, old, adv, mask, token_weights=weights)
    assert masked.item() == pytest.approx(by_weights.item(), rel=1e-14)
    unmasked, _ = policy_loss(logp, old, adv, mask, off_policy_threshold=0.5)  # vs old: no gap reaches 0.5 here
    assert unmasked.item() == pytest.approx(policy_loss(logp, old, adv, mask)[0].item(), rel=1e-14)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo", "luspo"])
def test_at_ratio_one_every_term_has_grpo_s_gradient(loss_type):
    logp, _, mask, adv = _random(7)
    agg = "seq-mean-token-sum" if loss_type == "luspo" else "token-mean"
    ours, _ = policy_loss(logp, logp.detach(), adv, mask, loss_type=loss_type, aggregation=agg, params=TERMS)
    (g_ours,) = torch.autograd.grad(ours, logp)
    clip, _ = policy_loss(logp, logp.detach(), adv, mask, aggregation=agg)
    (g_clip,) = torch.autograd.grad(clip, logp)
    torch.testing.assert_close(g_ours, g_clip, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_off_policy_the_terms_differ_from_the_clip(loss_type):
    logp, old, mask, adv = _random(8)
    (g,) = torch.autograd.grad(policy_loss(logp, old, adv, mask, loss_type=loss_type, params=TERMS)[0], logp)
    (g_clip,) = torch.autograd.grad(policy_loss(logp, old, adv, mask)[0], logp)
    assert (g - g_clip).abs().max() > 1e-3


def test_an_unknown_loss_type_is_refused():
    logp, old, mask, adv = _random(0)
    with pytest.raises(ValueError, match="unknown loss type"):
        policy_loss(logp, old, adv, mask, loss_type="ppo2")


# ---------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("sizes", [[1, 5], [2, 3, 1], [4, 2]])
def test_micro_batches_of_any_size_give_the_whole_batch_gradient(loss_type, sizes):
    g = torch.Generator().manual_seed(11)
    N, T = 6, 7
    lengths = [7, 2, 3, 1, 5, 4]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    old = torch.randn(N, T, generator=g, dtype=torch.float64) - 2
    ref = old + 0.5 * torch.randn(N, T, generator=g, dtype=torch.float64)
    logp0 = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    sampled = old + 0.5 * torch.rand(N, T, generator=g, dtype=torch.float64)  # some rollouts past the threshold
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    aggregation = "seq-mean-token-sum" if loss_type == "luspo" else "token-mean"
    common = dict(
        beta=0.04,
        loss_type=loss_type,
        aggregation=aggregation,
        params=TermSection(cispo_cap=1.1).term_params(),
        clip_high=0.28,
    )
    common |= dict(off_policy_threshold=0.2)
    whole = logp0.clone().requires_grad_(True)
    loss, _ = policy_loss(whole, old, adv, mask, ref_logp=ref, sampling_logp=sampled, **common)
    loss.backward()
    micro = logp0.clone().requires_grad_(True)
    total, start = 0.0, 0
    for size in sizes:
        idx = torch.arange(start, start + size)
        start += size
        cols = int(mask[idx].sum(0).nonzero().max()) + 1  # the pass's trailing padding cut, as the trainer's
        sl = (idx[:, None], torch.arange(cols)[None, :])
        part, _ = policy_loss(
            micro[sl], old[sl], adv[idx], mask[sl], ref_logp=ref[sl], sampling_logp=sampled[sl], **common,
            num_seqs=N, num_tokens=float(mask.sum()),
        )  # fmt: skip
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(micro.grad, whole.grad, rtol=1e-12, atol=1e-15)
    assert whole.grad.abs().sum() > 0


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "over,field",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(loss_type="luspo", aggregation="token-mean"), "aggregation"),
        (dict(loss_type="sapo", clip_delta=2.0), "clip_delta"),
        (dict(loss_type="vespo", engine_correction="token-truncate"), "engine_correction"),
        (dict(loss_type="cispo", cispo_cap=0.0), "cispo_cap"),
        (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg"),
        (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold"),
    ],
)
def test_invalid_objective_options_name_the_field(over, field):
    with pytest.raises(ConfigError, match="--" + field.replace("_", "-")):
        TrainConfig(**over).validate()


@pytest.mark.parametrize("trl,aggregation", [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean")])
def test_trl_s_aggregation_loss_types_point_to_aggregation(trl, aggregation):
    with pytest.raises(ConfigError, match=f"--loss-type: TRL's .* --aggregation {aggregation} "):
        TrainConfig(loss_type=trl).validate()


def test_luspo_aggregates_by_the_rollout_s_sum():
    assert effective_aggregation("luspo", "seq-mean-token-mean") == "seq-mean-token-sum"
    assert effective_aggregation("cispo", "token-mean") == "token-mean"


# ---------------------------------------------------------------- GDPO: each reward normalised, then summed


def _gdpo_by_hand(components: list[list[float]], weights: list[float], G: int, bessel: bool = False) -> list[float]:
    """GDPO as TRL's normalize_then_sum computes it, element by element: per group and function (c - mean) /
    (std + 1e-4), the weighted sum, then (s - mean) / (std + 1e-4) over the batch; ``bessel``: TRL's sample std."""
    n, K = len(components), len(weights)

    def std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - (1 if bessel else 0)))

    summed = [0.0] * n
    for start in range(0, n, G):
        for k in range(K):
            col = [components[i][k] for i in range(start, start + G)]
            m, s = sum(col) / G, std(col)
            for j, i in enumerate(range(start, start + G)):
                summed[i] += weights[k] * (col[j] - m) / (s + 1e-4)
    m, s = sum(summed) / n, std(summed)
    return [(x - m) / (s + 1e-4) for x in summed]


def test_normalize_then_sum_hand_computed():
    # two groups of 3; function 0 is 0/1, function 1 ten times wider; group 2's function 0 is constant
    comps = [[1.0, 30.0], [0.0, 10.0], [0.0, 20.0], [1.0, 0.0], [1.0, 40.0], [1.0, 20.0]]
    weights = [1.0, 0.5]
    summed = normalize_then_sum(torch.tensor(comps), torch.tensor(weights), [3, 3])
    adv = batch_standardise(summed, float(summed.sum()), float(summed.pow(2).sum()), 6.0)
    assert adv.tolist() == pytest.approx(_gdpo_by_hand(comps, weights, 3), rel=1e-9, abs=1e-12)
    # a function constant within a group adds exactly 0 there: group 2 is moved by function 1 alone
    g2 = normalize_then_sum(torch.tensor(comps)[3:, 1:], torch.tensor([0.5]), [3])
    assert torch.equal(summed[3:], g2)


def test_normalize_then_sum_with_trl_s_sample_std_differs_by_one_factor():
    """TRL divides by the sample std (n - 1) at both stages. Within groups of one size G the factor is common to every
    value and cancels in the batch division; the batch's own, sqrt(n / (n - 1)) over the step's n rollouts, stays:
    TRL's advantages are grpolab's times sqrt((n - 1) / n) (up to the 1e-4 terms)."""
    g = torch.Generator().manual_seed(2)
    comps = torch.cat([torch.randint(0, 2, (32, 1), generator=g), torch.rand(32, 1, generator=g) * 5], dim=1)
    summed = normalize_then_sum(comps, torch.tensor([1.0, 2.0]), [8] * 4)
    ours = batch_standardise(summed, float(summed.sum()), float(summed.pow(2).sum()), 32.0)
    trl = _gdpo_by_hand(comps.tolist(), [1.0, 2.0], 8, bessel=True)
    assert (ours * math.sqrt(31 / 32)).tolist() == pytest.approx(trl, rel=1e-3, abs=1e-4)
    assert ours.tolist() != pytest.approx(trl, rel=1e-3, abs=1e-4)


def test_a_run_with_normalize_then_sum_credits_gdpo_s_advantages(tmp_path, monkeypatch):
    """Two reward functions of different spread: the logged advantages are GDPO's of the logged completions' rewards
    (recomputed here by hand), and not the summed reward's group-normalised ones."""
    import json

    from helpers.runs import train_cli
    from reward_fixtures import code_sum_mod4, odd_code_sum

    fns = ["--reward-fn", "reward_fixtures:odd_code_sum", "--reward-fn", "reward_fixtures:code_sum_mod4"]
    gdpo = ["--reward-weights", "1", "5", "--reward-normalisation", "normalize-then-sum", "--format-weight", "0"]
    run = train_cli(tmp_path, "gdpo", 1, *fns, *gdpo)
    rows = [json.loads(line) for line in open(run / "rollouts.jsonl")]
    texts = [r["completion"] for r in rows]
    comps = [list(c) for c in zip(odd_code_sum(texts, None), code_sum_mod4(texts, None))]
    expected = _gdpo_by_hand(comps, [1.0, 5.0], 4)
    assert [r["advantage"] for r in rows] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    plain = []
    for start in range(0, len(rows), 4):  # sum, then grpo_std per group
        total = [1.0 * a + 5.0 * b for a, b in comps[start : start + 4]]
        m = sum(total) / 4
        s = math.sqrt(sum((x - m) ** 2 for x in total) / 4)
        plain += [(x - m) / (s + 1e-4) for x in total]
    assert [r["advantage"] for r in rows] != pytest.approx(plain, abs=1e-3)


@pytest.mark.parametrize(
    "over",
    [
        dict(reward_normalisation="normalize-then-sum", estimator="rloo"),
        dict(reward_normalisation="normalize-then-sum", scale_rewards="batch"),
        dict(reward_normalisation="normalize-then-sum", task="arith-multiturn"),
        dict(reward_normalisation="sum-then-normalise"),
    ],
)
def test_invalid_reward_normalisation_is_refused(over):
    with pytest.raises(ConfigError, match="--reward-normalisation"):
        TrainConfig(**over).validate()


# ---------------------------------------------------------------- the entropy bonus


def test_entropy_bonus_is_the_step_s_token_mean_share():
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_bonus(ent, mask, 3.0).item() == pytest.approx((1 + 2 + 4) / 3)
    assert entropy_bonus(ent, mask, 10.0).item() == pytest.approx(7 / 10)  # a micro-batch of a 10-token step


def test_the_adaptive_coefficient_on_a_scripted_entropy_sequence():
    """target 0.5, delta 0.1, c in [0, 0.25]: the bonus applies only after a step at or below the target, and c
    rises on such steps, falls on the others, within its bounds."""
    control = EntropyControl(0.1, adaptive=True, target=0.5, delta=0.1, low=0.0, high=0.25)
    applied, coefs = [], []
    for h in [0.9, 0.4, 0.3, 0.2, 0.6, 0.7, 0.8, 0.5]:
        applied.append(control.applied())
        control.observe(h)
        coefs.append(control.coef)
    assert applied == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.25, 0.0, 0.0, 0.0])
    assert coefs == pytest.approx([0.0, 0.1, 0.2, 0.25, 0.15, 0.05, 0.0, 0.1])
    fixed = EntropyControl(0.3)
    fixed.observe(0.0)
    assert fixed.applied() == 0.3 and fixed.coef == 0.3


def _updater_gradient(model, batch, adv, **options) -> dict[str, torch.Tensor]:
    """The gradient one Updater pass leaves (lr 0, so the weights stay) under TrainConfig ``options``."""
    import copy

    from transformers import get_scheduler

    from grpolab.common.distributed import SINGLE
    from grpolab.training.forward import TrainModule
    from grpolab.training.update import Updater
    from grpolab.training.update_options import UpdateSections

    m = copy.deepcopy(model)
    cfg = TrainConfig(max_grad_norm=0.0, **options)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    policy = TrainModule(m, 1.0)
    upd = Updater(UpdateSections.of(cfg), policy, opt, get_scheduler("constant", opt), SINGLE, eos_id=2)
    metrics = upd(batch, adv)
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}, metrics


def test_the_entropy_bonus_s_gradient_is_the_same_in_micro_batches_and_reaches_rows_without_advantage():
    from helpers.models import model_and_batch

    from grpolab.models.logprobs import completion_logprobs

    model, batch = model_and_batch()
    model = model.double()
    adv = torch.tensor([1.0, 0.0, 0.25, 0.0, 0.8, -0.1], dtype=torch.float64)  # two rows carry no advantage
    bonus = dict(entropy_coef=0.1, aggregation="token-mean")
    whole, metrics = _updater_gradient(model, batch, adv, **bonus)
    micro, _ = _updater_gradient(model, batch, adv, micro_batch=2, **bonus)
    for name in whole:
        torch.testing.assert_close(micro[name], whole[name], rtol=1e-10, atol=1e-14)
    # the same gradient by hand: the policy term plus -c H, H over every completion token (both zero rows too)
    m = model
    m.zero_grad()
    both = completion_logprobs(m, batch, entropy=True)
    logp, ent = both[..., 0], both[..., 1]
    mask = batch.completion_mask
    loss = policy_loss(logp, logp.detach(), adv, mask, aggregation="token-mean")[0] - 0.1 * entropy_bonus(
        ent, mask, float(mask.sum())
    )
    loss.backward()
    for name, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(whole[name], p.grad, rtol=1e-10, atol=1e-14)
    m.zero_grad()
    assert metrics["loss/entropy"] == pytest.approx(float(entropy_bonus(ent, mask, float(mask.sum()))), rel=1e-12)
    assert metrics["loss/entropy_coef"] == 0.1


@pytest.mark.slow  # three runs: 3 s
def test_a_run_with_the_adaptive_entropy_bonus_resumes_exactly(tmp_path):
    """Stopped after 2 steps and resumed, a run with --adaptive-entropy gives the uninterrupted run's metrics and
    weights: the coefficient and the last entropy are in the checkpoint."""
    from helpers.runs import assert_same_metrics, assert_same_params, train_cli

    from grpolab.training.runlog import read_metrics

    ent = ["--entropy-coef", "0.05", "--adaptive-entropy", "--entropy-target", "5", "--entropy-coef-delta", "0.02"]
    ent += ["--mu", "2", "--save-every", "2"]
    whole = train_cli(tmp_path, "whole", 3, *ent)
    train_cli(tmp_path, "split", 2, *ent)
    split = train_cli(tmp_path, "split", 3, *ent, resume=True)
    assert_same_metrics(whole, split)
    assert_same_params(whole, split, step=3)
    coefs = [r["loss/entropy_coef"] for r in read_metrics(whole / "metrics.jsonl")[1:]]
    assert coefs == pytest.approx([0.0, 0.09, 0.13])  # none before a measurement; then +2 delta a step (mu 2)


@pytest.mark.parametrize(
    "path",
    [dict(), dict(chunk_tokens=3), dict(shared_prefix=True), dict(packed=True), dict(packed=True, chunk_tokens=2)],
)
def test_the_training_forward_s_entropies_equal_the_sampler_s_on_every_path(path):
    """completion_logprobs(entropy=True) on each path of the update's forward (plain, LM head in chunks, shared
    prompt, packed rows): its log-probs and entropies are the plain path's in float64, and its entropies are
    completion_entropy's (which computes in float32)."""
    from helpers.models import model_and_batch

    from grpolab.models.logprobs import completion_entropy, completion_logprobs

    model, batch = model_and_batch()
    model = model.double().eval()
    both = completion_logprobs(model, batch, entropy=True, **path)  # [N, T, 2]
    plain = completion_logprobs(model, batch, entropy=True)
    torch.testing.assert_close(both, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both[..., 0], completion_logprobs(model, batch), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both[..., 1], completion_entropy(model, batch).double(), rtol=1e-6, atol=1e-6)
    assert both[..., 1][batch.completion_mask.bool()].min() > 0


# ---------------------------------------------------------------- the probe's rows for any objective


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="clip", aggregation="seq-mean-token-mean"),
        dict(loss_type="cispo", aggregation="token-mean", params=TermSection(cispo_cap=1.01).term_params()),
        dict(loss_type="sapo", aggregation="seq-mean-token-mean", params=TERMS),
        dict(loss_type="luspo", aggregation="seq-mean-token-sum", importance_sampling="sequence"),
        dict(loss_type="vespo", aggregation="token-mean", params=TERMS),
    ],
    ids=lambda o: o["loss_type"],
)
def test_the_gram_of_logp_weights_is_the_gram_of_explicit_per_rollout_gradients(options):
    """Away from ratio 1 (old log-probs shifted): the score Gram matrix with logp_weights' weights equals the Gram
    matrix of each rollout's own gradient of the objective's loss, computed by a backward of its own (float64,
    built-in model), to 1e-8."""
    from helpers.models import model_and_batch

    from grpolab.algo.loss import logp_weights
    from grpolab.common.batch import select
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.probes.gram import score_gram

    model, batch = model_and_batch()
    model = model.double().eval()
    N = batch.completion_ids.shape[0]
    with torch.no_grad():
        logp = completion_logprobs(model, batch)
    g = torch.Generator().manual_seed(3)
    old = logp + 0.2 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.8, -0.1], dtype=torch.float64)
    mask = batch.completion_mask
    w = logp_weights(logp, old, adv, mask, **options)
    psi = score_gram(model, batch, w)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(N):  # rollout i's gradient: the loss's terms of row i alone (whole-batch normalisers)
        sub = select(batch, torch.tensor([i]))
        lp = completion_logprobs(model, sub)
        T = lp.shape[1]
        loss, _ = policy_loss(lp, old[i : i + 1, :T], adv[i : i + 1], sub.completion_mask, **options, num_seqs=N,
                              num_tokens=float(mask.sum()))  # fmt: skip
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(
            torch.cat([(gr if gr is not None else torch.zeros_like(p)).flatten() for gr, p in zip(grads, params)])
        )
    explicit = torch.stack(rows) @ torch.stack(rows).T
    torch.testing.assert_close(psi.double(), explicit, rtol=1e-8, atol=1e-8 * float(explicit.abs().max()))


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_the_rank_probe_and_the_token_credit_view_take_every_objective(tmp_path, loss_type):
    """A run with each --loss-type, mu = 2, the online probe and the token-credit records: the probe measures its
    groups (at ratio 1 each term's gradient is the clip's with the loss's aggregation) and the credit view records
    the watched rollouts' tokens with the loss's own ratios; their values are finite."""
    import json

    from helpers.runs import train_cli

    from grpolab.training.runlog import read_metrics

    extra = ["--importance-sampling", "sequence"] if loss_type == "luspo" else []
    run = train_cli(
        tmp_path, loss_type, 1, "--loss-type", loss_type, *extra, "--mu", "2", "--probe-every", "1",
        "--probe-groups", "2", "--log-token-credit", "2", "--reward-fn", "reward_fixtures:odd_code_sum",
        "--format-weight", "0",
    )  # fmt: skip
    rows = read_metrics(run / "metrics.jsonl")[1:]
    assert all(r["probe/groups_measured"] > 0 and math.isfinite(r["probe/eff_rank"]) for r in rows)
    assert all(math.isfinite(r["credit/abs_mean"]) for r in rows)
    records = [json.loads(line) for line in open(run / "token_credit.jsonl")]
    assert len(records) == 2 and all(len(r["ratio"]) == len(r["dlogp"]) for r in records)
    assert any(abs(x - 1.0) > 1e-6 for r in records for x in r["ratio"] if x is not None)  # mu 2: off ratio 1
