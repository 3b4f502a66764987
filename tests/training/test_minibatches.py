"""--minibatches M: M optimizer steps in each pass over a step's batch (TRL's steps_per_generation beyond the
accumulation), against the same steps taken by hand with policy_loss, and the config's checks."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import model_and_batch

from grpolab.algo.loss import policy_loss
from grpolab.common.batch import select
from grpolab.common.distributed import SINGLE
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.models.logprobs import completion_logprobs
from grpolab.training.forward import TrainModule
from grpolab.training.micro_batches import minibatch_rows
from grpolab.training.update import Updater
from grpolab.training.update_options import UpdateSections

LR = 0.05


def _updated(model, batch, adv, **options):
    """The weights after one Updater call (SGD at LR, no clipping) under TrainConfig ``options``, and its metrics."""
    from transformers import get_scheduler

    m = copy.deepcopy(model)
    cfg = TrainConfig(max_grad_norm=0.0, **options)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    upd = Updater(UpdateSections.of(cfg), TrainModule(m, 1.0), opt, get_scheduler("constant", opt), SINGLE, eos_id=2)
    metrics = upd(batch, adv)
    return m, metrics


def _by_hand(model, batch, adv, M: int, mu: int, aggregation: str):
    """mu passes of M SGD steps, minibatch j the rows i with i mod M = j, each loss policy_loss with an M-th of the
    batch's normalisers (rows and loss tokens) and the sampling-time log-probs as the ratio's denominator."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    with torch.no_grad():
        old = completion_logprobs(m, batch)  # [N, T] before any step
    mask = batch.completion_mask
    N, tokens = mask.shape[0], float(mask.sum())
    for _ in range(mu):
        for j in range(M):
            rows = torch.arange(j, N, M)
            sub = select(batch, rows)
            T = sub.completion_ids.shape[1]
            opt.zero_grad()
            loss, _ = policy_loss(
                completion_logprobs(m, sub), old[rows, :T], adv[rows], sub.completion_mask,
                aggregation=aggregation, num_seqs=N // M, num_tokens=tokens / M,
            )  # fmt: skip
            loss.backward()
            opt.step()
    return m


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mu", [1, 2])
def test_m_minibatches_are_m_optimizer_steps_on_their_rows(aggregation, mu):
    model, batch = model_and_batch()
    model = model.double()
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5, 0.8, -0.1], dtype=torch.float64)
    ours, metrics = _updated(model, batch, adv, minibatches=2, mu=mu, aggregation=aggregation, micro_batch=2)
    theirs = _by_hand(model, batch, adv, M=2, mu=mu, aggregation=aggregation)
    one_step, _ = _updated(model, batch, adv, mu=mu, aggregation=aggregation)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    moved = [(a - c).abs().max() for a, c in zip(ours.parameters(), one_step.parameters())]
    assert max(moved) > 1e-6, "M steps on parts must differ from one step on the whole batch"
    assert metrics["loss/active_frac"] == 1.0 and metrics["loss/skipped_updates"] == 0


def test_minibatch_rows_spread_each_group():
    assert [r.tolist() for r in minibatch_rows(8, 2, "cpu")] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [r.tolist() for r in minibatch_rows(3, 1, "cpu")] == [[0, 1, 2]]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(prompts_per_step=3, group_size=2, minibatches=4), "do not split into 4 equal minibatches"),
        (dict(prompts_per_step=4, group_size=4, minibatches=2, sampling="filter"), "--sampling: not built"),
        (dict(prompts_per_step=4, group_size=4, minibatches=2, entropy_coef=0.1), "--entropy-coef: not built"),
        (dict(prompts_per_step=4, group_size=4, minibatches=2, log_token_credit=2), "--log-token-credit: not built"),
        (dict(minibatches=0), "minibatches"),
    ],
)
def test_the_config_refuses_what_minibatches_do_not_support(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options).validate()


def test_each_process_s_rollouts_split_into_the_minibatches():
    cfg = TrainConfig(prompts_per_step=2, group_size=3, minibatches=2)
    cfg.validate()
    with pytest.raises(ConfigError, match="must split into 2 equal minibatches"):
        cfg.validate_world(2)  # 3 rollouts a process
