"""On a vision-language model, grpolab's log-probs, loss and gradient equal what TRL 1.16's GRPOTrainer computes on
the same completions of the same pictures (the built-in tiny LLaVA, in float64).

TRL's ``_generate_and_score_completions`` samples a batch from rows in TRL's vision form (a conversational prompt with
an ``image`` column): its processor-expanded prompt ids, the completions, the pixel values and the advantages. grpolab
encodes the same rows with its own processing (:meth:`grpolab.models.policy.Policy.prompt_inputs`): the same ids, bit
for bit, and its images as a ``Media`` bundle per row. TRL's forward with the pixel values gives the same per-token
log-probs as grpolab's (to TRL's float32 head: 1e-5), and grpolab's float64 ones then stand in so that the loss
comparison measures the objective, as in tests/trl/test_trl_objective.py: the loss to 1e-6 relative and the gradient
of every trained parameter (the projector's too) to 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

from grpolab.algo.loss import policy_loss
from grpolab.common.batch import Batch, left_pad
from grpolab.config.train import TrainConfig
from grpolab.data.shapes import draw
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import BUILTIN_VLM, load_policy
from grpolab.training.update import loss_options
from grpolab.trl import GRPOConfig as DropInConfig
from grpolab.trl.config import to_options

pytestmark = pytest.mark.slow
G = 4


def common(rows: int) -> dict:
    """The GRPOConfig keywords both sides take (TRL's defaults otherwise: loss_type dapo, epsilon 0.2, beta 0)."""
    return dict(per_device_train_batch_size=rows * G, num_generations=G, max_completion_length=8, use_cpu=True,
                bf16=False, report_to="none", save_strategy="no", gradient_checkpointing=False)  # fmt: skip


def count_is_right(completions, solution, **kwargs) -> list[float]:
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: the reply
    return [float(t.strip().endswith(f"#### {s}")) for t, s in zip(texts, solution)]


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = load_policy(BUILTIN_VLM)
    policy.system = ""  # prompt data: no system instruction (a run sets it from --format, as here)
    policy.model.double()
    policy.family.freeze_tower(policy.model)
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
            "image": r["image"],
            "solution": r["answer"],
        }
        for r in draw(seed=1, step=0, n=3)
    ]
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), **common(len(rows)))
    trainer = GRPOTrainer(
        model=policy.model, processing_class=policy.processor, reward_funcs=count_is_right, args=args,
        train_dataset=Dataset.from_list(rows),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    policy.model.train()
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([r for r in rows for _ in range(G)])
    return policy, trainer, rows, out


def _ours(policy, rows, out) -> Batch:
    """grpolab's batch of TRL's completions: the rows encoded by grpolab, which must give TRL's prompt ids."""
    encoded = [policy.prompt_inputs(r) for r in rows for _ in range(G)]
    ids, mask = left_pad([e[0] for e in encoded], policy.pad_id)
    assert torch.equal(ids, out["prompt_ids"]) and torch.equal(mask, out["prompt_mask"])
    media = tuple(encoded[i * G][1] for i in range(len(rows)) for _ in range(G))  # a group shares its bundle
    return Batch(ids, mask, out["completion_ids"], out["completion_mask"], media)


def test_trl_and_grpolab_score_the_same_pictures_alike_and_their_loss_and_gradient_agree(side_by_side):
    policy, trainer, rows, out = side_by_side
    model = policy.model
    batch = _ours(policy, rows, out)
    assert out["advantages"].abs().sum() > 0, "some group must carry signal"
    forward = trainer._get_per_token_logps_and_entropies

    def in_float64(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux = forward(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        ours = completion_logprobs(model, batch, entropy=True)  # [N, T, 2], with the rows' pictures
        m = batch.completion_mask.bool()
        assert (logps.double()[m] - ours[..., 0][m]).abs().max() < 1e-5  # TRL's fp32 head: the same, rounded
        return ours[..., 0], ours[..., 1], aux

    trainer._get_per_token_logps_and_entropies = in_float64
    with torch.no_grad():
        logp0 = completion_logprobs(model, batch)
    g = torch.Generator().manual_seed(7)
    old = (logp0 + 0.3 * torch.randn(logp0.shape, generator=g, dtype=torch.float64)).detach()  # ratios off 1
    trl_loss = trainer._compute_loss(model, out | {"old_per_token_logps": old})
    params = [p for p in model.parameters() if p.requires_grad]
    trl_grad = torch.autograd.grad(trl_loss, params)

    cfg = TrainConfig().replace(**to_options(DropInConfig(output_dir="unused", **common(len(rows))), train_rows=12))
    logp = completion_logprobs(model, batch)
    mask = batch.completion_mask
    options = loss_options(cfg.objective, cfg.terms, cfg.max_policy_tokens)
    ours, _ = policy_loss(logp, old, out["advantages"], mask, num_seqs=mask.shape[0], num_tokens=float(mask.sum()),
                          **options)  # fmt: skip
    our_grad = torch.autograd.grad(ours, params)
    assert abs(ours.item() - trl_loss.item()) <= 1e-6 * max(abs(trl_loss.item()), 1e-3)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("multi_modal_projector" in n for n in names)
    for name, a, b in zip(names, our_grad, trl_grad, strict=True):
        assert float((a - b).norm()) <= 1e-6 * max(float(b.norm()), 1e-12), name
