"""The engine-mismatch weights against a per-token formula written out in float64, token by token."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.algo.engine_correction import CORRECTIONS, engine_weights, mismatch


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


def test_mismatch_over_the_masked_tokens_and_bad_settings():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    engine = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert mismatch(trainer, engine, mask) == (pytest.approx(1.75), 5, pytest.approx(1.0))
    with pytest.raises(ValueError, match="unknown engine correction"):
        engine_weights(trainer, engine, mask, "token", cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 1"):
        engine_weights(trainer, engine, mask, "token-mask", cap=1.0)
