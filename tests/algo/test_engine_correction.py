"""The engine-mismatch weights against a per-token formula written out in float64, token by token; the mismatch
statistics against hand-computed values; an exact engine's weights at top-p 0.9, top-k, min-p and a repetition
penalty (the sampling distribution put on the trainer's scale) against 1."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.algo.engine_correction import (
    CORRECTIONS,
    engine_weights,
    mismatch_metrics,
    mismatch_sums,
    on_full_support,
)


def _expected(trainer, engine, mask, mode: str, cap: float) -> list[list[float]]:
    """The module docstring's definitions, one number at a time."""
    out = []
    for t_row, e_row, m_row in zip(trainer.tolist(), engine.tolist(), mask.tolist()):
        ratios = [math.exp(t - e) for t, e, m in zip(t_row, e_row, m_row) if m]
        seq = math.prod(ratios)
        row = []
        for t, e, m in zip(t_row, e_row, m_row):
            r = seq if mode.startswith("sequence") else math.exp(t - e)
            if not m:
                w = 0.0
            elif mode == "none":
                w = 1.0
            elif mode.endswith("truncate"):
                w = min(r, cap)
            else:
                w = 1.0 if 1 / cap <= r <= cap else 0.0
            row.append(w)
        out.append(row)
    return out


@pytest.mark.parametrize("mode", CORRECTIONS)
def test_weights_equal_the_formula(mode):
    gen = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3  # [N, T] log-probs
    engine = trainer + torch.randn(6, 9, generator=gen, dtype=torch.float64) * 0.8  # a mismatch of ~0.8 nats
    mask = torch.ones(6, 9, dtype=torch.long)
    mask[1, 5:] = 0
    mask[4, 2:] = 0
    weights = engine_weights(trainer, engine, mask, mode, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor(_expected(trainer, engine, mask, mode, 2.0), dtype=torch.float64))
    if mode not in ("none",):  # the cap bit at least once, so the test tells the modes apart
        assert (weights[mask.bool()] != 1).any()


def test_equal_log_probs_weigh_every_token_one_and_a_huge_ratio_is_capped_without_overflow():
    logp = -torch.rand(3, 5, dtype=torch.float64)
    mask = torch.ones(3, 5)
    for mode in CORRECTIONS:
        assert torch.equal(engine_weights(logp, logp, mask, mode, cap=2.0), mask.double())
    far = logp - 800.0  # the engine gave these tokens almost no probability: r = e^800
    assert torch.equal(engine_weights(logp, far, mask, "sequence-truncate", cap=3.0), torch.full((3, 5), 3.0).double())
    assert torch.equal(engine_weights(logp, far, mask, "token-mask", cap=3.0), torch.zeros(3, 5).double())


def test_each_mode_on_a_scripted_mismatch_by_hand():
    """Two rows: log r = (0.5, -0.2, 1.0) and (-1.5, 0.1) (and a masked token), cap 2: the weights worked out on
    paper. log R = 1.3 (R = 3.67) and -1.4 (R = 0.247)."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-2.0, -1.0, -7.0, -7.0]], dtype=torch.float64)
    engine = trainer - torch.tensor([[0.5, -0.2, 1.0, 3.0], [-1.5, 0.1, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    e = math.exp
    by_hand = {
        "none": [[1, 1, 1, 0], [1, 1, 0, 0]],
        "token-truncate": [[e(0.5), e(-0.2), 2.0, 0], [e(-1.5), e(0.1), 0, 0]],
        "token-mask": [[1, 1, 0, 0], [0, 1, 0, 0]],  # e^1 = 2.72 > 2 and e^-1.5 = 0.22 < 1/2 are masked
        "sequence-truncate": [[2.0, 2.0, 2.0, 0], [e(-1.4), e(-1.4), 0, 0]],
        "sequence-mask": [[0, 0, 0, 0], [0, 0, 0, 0]],  # R = 3.67 > 2 and R = 0.247 < 1/2
    }
    for mode, want in by_hand.items():
        got = engine_weights(trainer, engine, mask, mode, cap=2.0)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_mismatch_statistics_by_hand_and_bad_settings():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    engine = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    sums = mismatch_sums(trainer, engine, mask)  # log r = (0.5, 0, -1) and (0, -0.25); the masked -9 is not read
    logs = [0.5, 0.0, -1.0, 0.0, -0.25]
    r = [math.exp(x) for x in logs]
    metrics = mismatch_metrics(sums)
    approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731
    mean_r = sum(r) / 5
    assert metrics == {
        "engine/logprob_diff_mean": approx(1.75 / 5),
        "engine/logprob_diff_max": approx(1.0),
        "engine/logratio_mean": approx(-0.75 / 5),
        "engine/logratio_std": approx((sum(x * x for x in logs) / 5 - (0.15) ** 2) ** 0.5),
        "engine/ratio_std": approx((sum(x * x for x in r) / 5 - mean_r**2) ** 0.5),
        "engine/ratio_outside_frac": approx(3 / 5),  # e^0.5, e^-1 and e^-0.25 = 0.78 leave [0.9, 1.1]
        "engine/seq_logratio_mean": approx((-0.5 - 0.25) / 2),  # log R = -0.5 and -0.25
        "engine/seq_logratio_std": approx(0.125),
        "engine/seq_logratio_max": approx(0.5),
    }
    assert mismatch_metrics(mismatch_sums(trainer, engine, torch.zeros_like(mask))) == {}
    with pytest.raises(ValueError, match="unknown engine correction"):
        engine_weights(trainer, engine, mask, "token", cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 1"):
        engine_weights(trainer, engine, mask, "token-mask", cap=1.0)


RULES = {
    "plain": {},
    "top-p": dict(top_p=0.9),
    "top-k": dict(top_k=5),
    "min-p": dict(min_p=0.1),
    "penalty": dict(repetition_penalty=1.2),
    "all": dict(top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
}


@pytest.mark.parametrize("name", list(RULES))
def test_an_exact_engine_weighs_every_token_one_under_any_sampling_rules_in_float64(name, char_tokenizer):
    """grpolab's sampler in float64 on the trainer's own float64 weights, at top-p 0.9, top-k 5, min-p 0.1, a
    repetition penalty of 1.2 and all four together: its log-probs of the distribution it sampled from, put on the
    whole vocabulary with the trainer's offset (log pi_T - log p_sampling, from the trainer's own logits), give every
    correction weight 1: exactly for the masks; for the truncations to the sampler's rounding (it reports its
    log-probs in fp32: 1e-6 a token, 1e-6 x T a sequence). Compared directly, the log-ratio would be the offset
    itself (for top-p, the log kept mass: the trap of TRL's issue 6789), and that comparison is made to fail here.
    The chunked, packed and shared-prefix forwards give the offset the plain one gives (the penalty's history
    travels with each token through their reshaping)."""
    from helpers.models import qwen2

    from grpolab.models.logprobs import completion_logprobs
    from grpolab.models.sampling_rules import SamplingRules
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings

    tok, rules = char_tokenizer, SamplingRules(**RULES[name])
    torch.manual_seed(2)
    model = qwen2(len(tok), eos_token_id=tok.eos_token_id).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)  # logits of std ~1.6 (from ~0.1): min-p and top-k drop tokens
    engine = HFEngine(model, EngineSpec(tok.eos_token_id, tok.pad_token_id))
    prompts = [[tok.bos_token_id, 5 + i, 9, 13, 9] for i in range(3) for _ in range(4)]
    settings = SamplingSettings(16, 1.0, **RULES[name])
    out = engine.generate(prompts, [(1, i) for i in range(12)], settings)
    with torch.no_grad():
        both = completion_logprobs(model, out.batch, 1.0, rules=rules)
        for variant in (dict(chunk_tokens=7), dict(packed=True), dict(shared_prefix=True)):
            again = completion_logprobs(model, out.batch, 1.0, rules=rules, **variant)
            assert float((again - both).abs().max()) < 1e-12, variant
    trainer, offset = (both, torch.zeros_like(both)) if rules.full_support else (both[..., 0], both[..., 1])
    mask = out.batch.completion_mask
    engine_logp = on_full_support(out.logprobs.double(), offset)
    for mode in CORRECTIONS:
        w = engine_weights(trainer, engine_logp, mask, mode, cap=1.5)[mask.bool()]
        if mode.endswith("mask") or mode == "none":
            assert bool((w == 1).all()), mode
        tol = 1e-6 * (mask.shape[1] if mode.startswith("sequence") else 1)
        assert float((w - 1).abs().max()) <= tol, mode
    naive = (trainer - out.logprobs.double())[mask.bool()]  # the offset on every token
    if rules.full_support:
        assert float(naive.abs().max()) <= 1e-6
    elif rules.penalised:  # the penalty moves the seen tokens' logits either way
        assert float(naive.abs().mean()) > 0.01
    else:  # a truncation: the log kept mass, <= 0
        assert float(naive.mean()) < -0.01 and bool((naive < 1e-6).all())


@pytest.mark.parametrize("mu, rules", [(1, dict(top_p=0.9)), (2, RULES["all"])])
def test_a_float64_run_at_top_p_reports_no_mismatch_and_weights_of_one(tmp_path, mu, rules):
    """The update itself puts the sampler's log-probs on its own scale: a float64 run of the built-in model at top-p
    0.9 (and at mu 2, at top-k 20, top-p 0.9, min-p 0.05 and a repetition penalty of 1.1) with every rollout drawn by
    the exact sampler logs a log-ratio of 0 (it would be the log kept mass, about -0.1, without) and a correction
    weight of 1, at mu 1 and at mu 2 (the offset from the pre-update pass)."""
    from helpers.runs import metrics_by_step, quiet, small_cfg

    from grpolab.training.recipe import train

    out = train(
        small_cfg(tmp_path / "run", steps=1, dtype="float64", mu=mu, engine_correction="token-truncate", **rules),
        log=quiet,
    )
    m = metrics_by_step(out)[1]
    assert abs(m["engine/logratio_mean"]) < 1e-6 and m["engine/logprob_diff_max"] < 1e-5
    assert m["engine/correction_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["engine/ratio_outside_frac"] == 0.0


def test_auto_is_none_for_an_exact_engine_and_the_measured_mode_elsewhere():
    from grpolab.algo.engine_correction import AUTO, resolve_correction

    assert AUTO in CORRECTIONS and AUTO != "none"
    assert resolve_correction("auto", exact_engine=True) == "none"
    assert resolve_correction("auto", exact_engine=False) == AUTO
    assert resolve_correction("auto", exact_engine=False, loss_type="vespo") == "none"
    for mode in CORRECTIONS:
        assert resolve_correction(mode, exact_engine=True) == mode


@pytest.mark.hardware
def test_a_bf16_sampler_is_measured_corrected_and_recorded_as_resolved(tmp_path):
    """--rollout-dtype bfloat16 on the built-in model: the run samples with a bf16 copy, logs a mismatch the fp32
    sampler does not have, weighs it with auto's mode, and config.json records what auto resolved to (a resumed run
    takes those values)."""
    import json

    from helpers.runs import metrics_by_step, quiet, small_cfg

    from grpolab.algo.engine_correction import AUTO
    from grpolab.training.recipe import train

    low = train(small_cfg(tmp_path / "bf16", steps=1, rollout_dtype="bfloat16"), log=quiet)
    exact = train(small_cfg(tmp_path / "fp32", steps=1), log=quiet)
    saved = {k: json.loads((run / "config.json").read_text()) for k, run in (("bf16", low), ("fp32", exact))}
    assert (saved["bf16"]["rollout_dtype"], saved["bf16"]["engine_correction"]) == ("bfloat16", AUTO)
    assert (saved["fp32"]["rollout_dtype"], saved["fp32"]["engine_correction"]) == ("float32", "none")
    m_low, m_exact = metrics_by_step(low)[1], metrics_by_step(exact)[1]
    assert m_low["engine/logratio_std"] > 100 * m_exact["engine/logratio_std"]
    assert 0 < m_low["engine/correction_weight_mean"] != 1.0
    assert "engine/correction_weight_mean" not in m_exact
