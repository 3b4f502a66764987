"""On-policy distillation in the update (--teacher): its gradient against the formula built by hand from full logits,
the teacher's refusals, and a resumed distilling run."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.cli import run_cli
from helpers.models import builtin_teacher
from helpers.runs import assert_identical_runs, quiet, small_cfg

from grpolab.algo.distill import token_divergence
from grpolab.algo.loss import aggregate, policy_loss
from grpolab.common.distributed import SINGLE
from grpolab.config.train import TrainConfig
from grpolab.models.logprobs import completion_hidden, completion_logprobs
from grpolab.models.policy import load_policy
from grpolab.rollout.sampler import sample
from grpolab.training.distill import TeacherSignal
from grpolab.training.forward import TrainModule
from grpolab.training.update import Updater
from grpolab.training.update_options import UpdateSections


@pytest.fixture(scope="module")
def pair():
    """The built-in policy in float64, a perturbed copy of it as teacher, 8 sampled rollouts and their advantages."""
    policy = load_policy("builtin", torch.float64)
    teacher = copy.deepcopy(policy.model).requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    prompts = [policy.prompt_ids({"question": q}) for q in ("12+7-3", "23*7", "45-(12+7)", "161/7")]
    batch = sample(
        policy.model, [p for p in prompts for _ in range(2)], [(2, i) for i in range(8)], max_new_tokens=12,
        temperature=1.0, top_p=1.0, eos_id=policy.eos_id, pad_id=policy.pad_id,
    )  # fmt: skip
    adv = torch.tensor([0.5, -0.2, 0.0, 0.0, 1.0, -0.7, 0.0, 0.0], dtype=torch.float64)  # two groups all equal
    return policy, teacher, batch, adv


def _update_gradient(policy, teacher, batch, adv, **options) -> list[torch.Tensor]:
    """The gradient the Updater leaves on the policy's weights for one step at lr 0 and no clipping."""
    cfg = TrainConfig(teacher="t", lr=0.0, max_grad_norm=0.0, warmup_steps=0, max_new_tokens=12, **options)
    model = policy.model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    signal = TeacherSignal(cfg.distill, TrainModule(teacher, 1.0), SINGLE)
    updater = Updater(UpdateSections.of(cfg), TrainModule(model, 1.0), optimizer, scheduler, SINGLE, policy.eos_id,
                      teacher=signal)  # fmt: skip
    metrics = updater(batch, adv, watch=[0, 3])  # --log-token-credit's rows: the teacher's term kept beside
    assert metrics["time/teacher_s"] > 0
    metrics["watched"] = updater.watched
    return [p.grad.clone() for p in params], metrics


def _close(ours: list[torch.Tensor], hand: list[torch.Tensor]) -> None:
    num = sum(float((a - b).norm() ** 2) for a, b in zip(ours, hand)) ** 0.5
    den = sum(float(b.norm() ** 2) for b in hand) ** 0.5
    assert den > 0 and num / den < 1e-9


@pytest.mark.parametrize("task_reward", [True, False])
def test_rkl_reward_adds_the_clipped_teacher_gap_to_each_token_s_advantage(pair, task_reward):
    policy, teacher, batch, adv = pair
    ours, metrics = _update_gradient(policy, teacher, batch, adv, distill_coef=0.7, distill_clip=0.5,
                                     task_reward=task_reward)  # fmt: skip
    model, mask = policy.model, batch.completion_mask
    logp = completion_logprobs(model, batch)
    with torch.no_grad():
        t_logp = completion_logprobs(teacher, batch)
    term = 0.7 * (t_logp - logp.detach()).clamp(-0.5, 0.5) * mask  # by hand
    base = adv[:, None] * mask if task_reward else torch.zeros_like(term)
    loss, _ = policy_loss(logp, logp.detach(), base + term, mask)
    hand = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    _close(ours, hand)
    watched, keep = metrics["watched"], mask[[0, 3]].bool()
    assert torch.allclose(watched.teacher[keep], term[[0, 3]][keep].double())  # the token-credit record's column
    assert torch.allclose(watched.adv[keep], (base + term)[[0, 3]][keep].double())
    gap = (logp.detach() - t_logp)[mask.bool()]
    assert metrics["distill/kl"] == pytest.approx(float(gap.mean()), rel=1e-9)
    assert 0 < metrics["distill/clip_frac"] < 1  # c = 0.5 clips some tokens, not all: the clip is tested
    if task_reward:  # the advantage against the teacher's term over the loss tokens (the doctor's fight sign)
        pair = torch.stack([base[mask.bool()], term[mask.bool()]])
        assert metrics["distill/reward_corr"] == pytest.approx(float(torch.corrcoef(pair)[0, 1]), abs=1e-9)
    else:
        assert "distill/reward_corr" not in metrics


@pytest.mark.parametrize("loss,beta", [("rkl", 1.0), ("fkl", 0.0), ("jsd", 0.3)])
def test_full_vocabulary_divergence_is_added_to_the_policy_loss(pair, loss, beta):
    policy, teacher, batch, adv = pair
    ours, metrics = _update_gradient(policy, teacher, batch, adv, distill_loss=loss, distill_beta=0.3,
                                     distill_coef=0.4, aggregation="token-mean")  # fmt: skip
    model, mask = policy.model, batch.completion_mask
    head = model.get_output_embeddings()
    with torch.no_grad():
        t_logits = teacher.get_output_embeddings()(completion_hidden(teacher, batch))  # [M, V]
    # One forward gives both terms, as the update's does: summed over two forwards of the same float64 model, the
    # gradient differed from one forward's by 2e-7 relative here (measured), more than this test's tolerance
    s_logits = head(completion_hidden(model, batch))  # [M, V]: the whole logits, no chunks
    keep = mask.bool()
    div = torch.zeros(mask.shape, dtype=torch.float64).index_put((keep,), token_divergence(s_logits, t_logits, beta))
    tokens = torch.log_softmax(s_logits, -1).gather(-1, batch.completion_ids[keep][:, None])[:, 0]  # [M]
    logp = torch.zeros(mask.shape, dtype=torch.float64).index_put((keep,), tokens)
    total = policy_loss(logp, logp.detach(), adv, mask, aggregation="token-mean")[0]
    total = total + 0.4 * aggregate(div, mask, "token-mean")
    hand = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    _close(ours, hand)
    assert metrics["distill/kl"] == pytest.approx(float(div.detach()[mask.bool()].mean()), rel=1e-9)


def test_teacher_options_are_refused_without_a_teacher():
    from grpolab.common.errors import ConfigError

    for flag in ({"distill_loss": "rkl"}, {"distill_coef": 0.5}, {"task_reward": False}):
        with pytest.raises(ConfigError, match="give --teacher MODEL"):
            TrainConfig(**flag).validate()
    with pytest.raises(ConfigError, match="--sampling"):
        TrainConfig(teacher="builtin", sampling="filter").validate()


@pytest.mark.slow
def test_teacher_of_another_vocabulary_is_one_line_and_exit_2_before_any_step(tmp_path):
    other = builtin_teacher(tmp_path / "other", extra_token="<tool>")
    res = run_cli(["train", "--out", str(tmp_path / "r"), "--steps", "1", "--teacher", str(other)], cwd=tmp_path)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert "another vocabulary" in last and str(other) in last and "arith-sft" in last
    assert (
        not (tmp_path / "r" / "metrics.jsonl").exists() or "step" not in (tmp_path / "r" / "metrics.jsonl").read_text()
    )


@pytest.mark.slow
def test_a_distilling_run_resumed_equals_the_uninterrupted_run(tmp_path):
    from grpolab.training.recipe import train

    teacher = builtin_teacher(tmp_path / "teacher")
    common = dict(save_every=2, eval_every=2, warmup_steps=3, lr=1e-3, teacher=str(teacher), log_rollouts=True)
    a = train(small_cfg(tmp_path / "A", steps=4, **common), log=quiet)
    train(small_cfg(tmp_path / "B", steps=2, **common), log=quiet)
    b = train(small_cfg(tmp_path / "B", steps=4, resume=True, **common), log=quiet)
    assert_identical_runs(a, b, step=4)
