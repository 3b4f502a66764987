"""grpolab's policy_loss against TRL's GRPO loss on the same tensors (trl is in the `test` extra: this runs, never
skips, in `make test`).

TRL's `grpo` is `seq-mean-token-mean`, `bnpo` is `token-mean`, `dr_grpo` is
`seq-mean-token-sum-norm`. Both losses and their gradients must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from grpolab.algo.loss import policy_loss
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import load_policy
from grpolab.rollout.sampler import sample

PAIRS = [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = load_policy("builtin")
    prompts = [policy.prompt_ids({"question": q}) for q in ("12+7-3", "23*7", "45-(12+7)", "161/7")]
    batch = sample(
        policy.model,
        [p for p in prompts for _ in range(2)],
        [(11, i) for i in range(8)],
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        eos_id=policy.eos_id,
        pad_id=policy.pad_id,
    )
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.0, 0.0])
    trainers = {}
    for loss_type, _ in PAIRS:
        cfg = GRPOConfig(
            output_dir=str(tmp_path_factory.mktemp(loss_type)),
            per_device_train_batch_size=8,
            num_generations=2,
            max_completion_length=12,
            beta=0.0,
            use_cpu=True,
            bf16=False,
            loss_type=loss_type,
            report_to="none",
            save_strategy="no",
            gradient_checkpointing=False,
        )
        trainers[loss_type] = GRPOTrainer(
            model=policy.model,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=cfg,
            train_dataset=Dataset.from_list([{"prompt": "1+1\n"}] * 8),
            processing_class=policy.tokenizer,
        )
    return policy, batch, adv, trainers


@pytest.mark.parametrize("loss_type,aggregation", PAIRS)
@pytest.mark.slow
def test_loss_and_gradient_equal_trl(setup, loss_type, aggregation):
    policy, batch, adv, trainers = setup
    model = policy.model
    trainer = trainers[loss_type]
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = {
        "prompt_ids": batch.prompt_ids,
        "prompt_mask": batch.prompt_mask,
        "completion_ids": batch.completion_ids,
        "completion_mask": batch.completion_mask,
        "advantages": adv,
        "old_per_token_logps": None,
        "num_items_in_batch": batch.completion_mask.sum(),
    }
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop; one step, no accumulation
    trl_loss = trainer._compute_loss(model, inputs)
    trl_grad = torch.autograd.grad(trl_loss, params, allow_unused=True)
    logp = completion_logprobs(model, batch)
    ours, _ = policy_loss(logp, logp.detach(), adv, batch.completion_mask, aggregation=aggregation, max_len=12)
    our_grad = torch.autograd.grad(ours, params, allow_unused=True)
    assert float(ours) == pytest.approx(float(trl_loss), abs=1e-5)
    for a, b in zip(our_grad, trl_grad):
        if a is not None and b is not None:
            assert torch.allclose(a, b, atol=1e-5)


# ---------------------------------------------------------------- the options TRL shares

VARIANTS = {
    "sequence": dict(importance_sampling_level="sequence"),
    "delta": dict(delta=1.3),
    "sequence-delta": dict(importance_sampling_level="sequence", delta=1.3, epsilon=0.05, epsilon_high=0.08),
    "entropy": dict(top_entropy_quantile=0.3),
    "mask-truncated": dict(mask_truncated_completions=True),
}


@pytest.fixture(scope="module")
def variant_trainers(setup, tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = setup[0]
    out = {}
    for name, extra in VARIANTS.items():
        cfg = GRPOConfig(
            output_dir=str(tmp_path_factory.mktemp(name)),
            per_device_train_batch_size=8,
            num_generations=2,
            max_completion_length=12,
            beta=0.0,
            use_cpu=True,
            bf16=False,
            loss_type="grpo",
            report_to="none",
            save_strategy="no",
            gradient_checkpointing=False,
            **extra,
        )
        out[name] = GRPOTrainer(
            model=policy.model,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=cfg,
            train_dataset=Dataset.from_list([{"prompt": "1+1\n"}] * 8),
            processing_class=policy.tokenizer,
        )
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.slow
def test_variant_loss_and_gradient_equal_trl(setup, variant_trainers, name):
    """Ratios away from 1 (old log-probs shifted per token), so clipping and GSPO's sequence ratio matter."""
    from grpolab.algo.loss import loss_token_mask

    policy, batch, adv, _ = setup
    model, trainer = policy.model, variant_trainers[name]
    if name == "mask-truncated":  # completions long enough that some end before the limit
        prompts = [policy.prompt_ids({"question": q}) for q in ("12+7-3", "23*7", "45-(12+7)", "161/7")]
        batch = sample(
            model,
            [p for p in prompts for _ in range(2)],
            [(12, i) for i in range(8)],
            max_new_tokens=20,
            temperature=1.0,
            top_p=1.0,
            eos_id=policy.eos_id,
            pad_id=policy.pad_id,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    with torch.no_grad():
        logp0 = completion_logprobs(model, batch)
    g = torch.Generator().manual_seed(7)
    old = (logp0 + 0.4 * torch.randn(logp0.shape, generator=g)).detach()
    mask = batch.completion_mask
    if name == "mask-truncated":  # TRL zeroes a truncated completion's mask when it generates; ours is the same rule
        mask = loss_token_mask(batch.completion_ids, mask, policy.eos_id, mask_truncated=True).long()
        assert 0 < mask.any(1).sum() < mask.shape[0], "the batch must hold truncated and finished completions"
    inputs = {
        "prompt_ids": batch.prompt_ids,
        "prompt_mask": batch.prompt_mask,
        "completion_ids": batch.completion_ids,
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    trainer.current_gradient_accumulation_steps = 1
    trl_loss = trainer._compute_loss(model, inputs)
    trl_grad = torch.autograd.grad(trl_loss, params, allow_unused=True)
    cfg = trainer.args
    weights = None
    if name == "entropy":  # the entropies TRL computed in this forward, fed to grpolab's threshold and mask
        with torch.no_grad():
            input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
            attn = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
            _, ent, _ = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attn, batch.completion_ids.shape[1], compute_entropy=True
            )
        weights = loss_token_mask(batch.completion_ids, mask, policy.eos_id, entropy=ent, top_entropy_quantile=0.3)
        assert 0 < weights.sum() < mask.sum()
    logp = completion_logprobs(model, batch)
    eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon  # TRL's default: symmetric
    ours, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=cfg.epsilon,
        clip_high=eps_high,
        importance_sampling=cfg.importance_sampling_level,
        clip_delta=cfg.delta,
        token_weights=weights,
    )
    our_grad = torch.autograd.grad(ours, params, allow_unused=True)
    assert ours.item() == pytest.approx(trl_loss.item(), abs=1e-5)
    if name != "mask-truncated":  # the option changes the loss on this batch: the comparison is not vacuous
        assert ours.item() != pytest.approx(policy_loss(logp, old, adv, mask)[0].item(), abs=1e-6)
    for a, b in zip(our_grad, trl_grad):
        if a is not None and b is not None:
            assert torch.allclose(a, b, atol=1e-5)
