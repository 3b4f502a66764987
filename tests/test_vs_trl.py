"""grpolab's policy_loss against TRL's GRPO loss on the same tensors (needs the `bench` extra: trl).

TRL's `grpo` is `seq-mean-token-mean`, `bnpo` is `token-mean`, `dr_grpo` is
`seq-mean-token-sum-norm`. Both losses and their gradients must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from grpolab.loss import policy_loss  # noqa: E402
from grpolab.policy import load_policy  # noqa: E402
from grpolab.rollout import completion_logprobs, sample  # noqa: E402

PAIRS = [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = load_policy("builtin")
    prompts = [policy.prompt_ids({"question": q}) for q in ("12+7-3", "23*7", "45-(12+7)", "161/7")]
    batch = sample(policy.model, [p for p in prompts for _ in range(2)], [(11, i) for i in range(8)], max_new_tokens=12,
                   temperature=1.0, top_p=1.0, eos_id=policy.eos_id, pad_id=policy.pad_id)
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.0, 0.0])
    trainers = {}
    for loss_type, _ in PAIRS:
        cfg = GRPOConfig(output_dir=str(tmp_path_factory.mktemp(loss_type)), per_device_train_batch_size=8, num_generations=2,
                         max_completion_length=12, beta=0.0, use_cpu=True, bf16=False, loss_type=loss_type,
                         report_to="none", save_strategy="no", gradient_checkpointing=False)
        trainers[loss_type] = GRPOTrainer(model=policy.model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                          args=cfg, train_dataset=Dataset.from_list([{"prompt": "1+1\n"}] * 8),
                                          processing_class=policy.tokenizer)
    return policy, batch, adv, trainers


@pytest.mark.parametrize("loss_type,aggregation", PAIRS)
def test_loss_and_gradient_equal_trl(setup, loss_type, aggregation):
    policy, batch, adv, trainers = setup
    model = policy.model
    trainer = trainers[loss_type]
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask, "completion_ids": batch.completion_ids,
              "completion_mask": batch.completion_mask, "advantages": adv, "old_per_token_logps": None,
              "num_items_in_batch": batch.completion_mask.sum()}
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
