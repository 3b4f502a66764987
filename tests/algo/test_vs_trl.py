"""grpolab's policy_loss against TRL's GRPO loss on the same tensors (trl is in the `test` extra: this runs, never
skips, in `make test`).

TRL's `grpo` is `seq-mean-token-mean`, `bnpo` is `token-mean`, `dr_grpo` is
`seq-mean-token-sum-norm`. Both losses and their gradients must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from helpers.trl_scoring import trl_scores_in_float64

from grpolab.algo.loss import policy_loss
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import load_policy
from grpolab.rollout.sampler import sample

PAIRS = [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")]


def _sampled(policy, seed: int, max_new_tokens: int = 12):
    """8 rollouts (4 arithmetic prompts x 2) of the built-in policy, drawn from streams (seed, i)."""
    prompts = [policy.prompt_ids({"question": q}) for q in ("12+7-3", "23*7", "45-(12+7)", "161/7")]
    return sample(
        policy.model,
        [p for p in prompts for _ in range(2)],
        [(seed, i) for i in range(8)],
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        eos_id=policy.eos_id,
        pad_id=policy.pad_id,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    policy = load_policy("builtin")
    batch = _sampled(policy, 11)
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.0, 0.0])
    trainers = {lt: _trl_trainer(policy, tmp_path_factory.mktemp(lt), loss_type=lt) for lt, _ in PAIRS}
    return policy, batch, adv, trainers


@pytest.mark.parametrize("loss_type,aggregation", PAIRS)
@pytest.mark.slow
def test_loss_and_gradient_equal_trl(setup, loss_type, aggregation):
    policy, batch, adv, trainers = setup
    model = policy.model
    trainer = trainers[loss_type]
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = _trl_inputs(batch, batch.completion_mask, adv, None)
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
    policy = setup[0]
    return {
        name: _trl_trainer(policy, tmp_path_factory.mktemp(name), loss_type="grpo", **extra)
        for name, extra in VARIANTS.items()
    }


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.slow
def test_variant_loss_and_gradient_equal_trl(setup, variant_trainers, name):
    """Ratios away from 1 (old log-probs shifted per token), so clipping and GSPO's sequence ratio matter."""
    from grpolab.algo.loss import loss_token_mask

    policy, batch, adv, _ = setup
    model, trainer = policy.model, variant_trainers[name]
    if name == "mask-truncated":  # completions long enough that some end before the limit
        batch = _sampled(policy, 12, max_new_tokens=20)
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
    inputs = _trl_inputs(batch, mask, adv, old)
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


# ---------------------------------------------------------------- the objectives TRL added (float64)

# name: (TRL's GRPOConfig options, grpolab's policy_loss options). Ratios away from 1 (old log-probs shifted per
# token), so each term's off-policy shape is what is compared; at ratio 1 they all have GRPO's gradient.
OBJECTIVES = {
    "cispo": (dict(loss_type="cispo", epsilon_high=1.2), dict(loss_type="cispo", cispo_cap=1.2, agg="token-mean")),
    # TRL's default epsilon_high (= epsilon = 0.2) is CISPO's cap itself: every weight is truncated to 0.2
    "cispo-trl-default": (dict(loss_type="cispo"), dict(loss_type="cispo", cispo_cap=0.2, agg="token-mean")),
    "sapo": (dict(loss_type="sapo"), dict(loss_type="sapo", agg="seq-mean-token-mean")),
    "luspo": (
        dict(loss_type="luspo", importance_sampling_level="sequence"),
        dict(loss_type="luspo", importance_sampling="sequence", agg="seq-mean-token-sum"),
    ),
    "luspo-token": (dict(loss_type="luspo"), dict(loss_type="luspo", agg="seq-mean-token-sum")),
    "vespo": (dict(loss_type="vespo"), dict(loss_type="vespo", agg="token-mean")),
    "off-policy-mask": (
        dict(loss_type="grpo", off_policy_mask_threshold=0.05),
        dict(off_policy_threshold=0.05, agg="seq-mean-token-mean"),
    ),
    # the entropy bonus: L - c H, H the token mean entropy whatever the aggregation
    "entropy-bonus": (dict(loss_type="dapo", entropy_coef=0.05), dict(agg="token-mean", entropy_coef=0.05)),
}


@pytest.fixture(scope="module")
def float64_setup():
    """The built-in model in float64 and a sampled batch of 8 rollouts (4 prompts x 2)."""
    policy = load_policy("builtin")
    policy.model.double()
    batch = _sampled(policy, 13)
    return policy, batch


def _trl_trainer(policy, tmp_path, **options):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=12,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        **options,
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=cfg,
        train_dataset=Dataset.from_list([{"prompt": "1+1\n"}] * 8),
        processing_class=policy.tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop; one step, no accumulation
    return trainer


def _trl_inputs(batch, mask, adv, old) -> dict:
    """The batch as TRL's _compute_loss takes it: ``mask`` the completion mask, ``old`` the old log-probs (None:
    on-policy), the token count of the whole batch as num_items_in_batch."""
    return {
        "prompt_ids": batch.prompt_ids,
        "prompt_mask": batch.prompt_mask,
        "completion_ids": batch.completion_ids,
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.slow
def test_each_objective_s_loss_and_gradient_equal_trl_s_in_float64(float64_setup, tmp_path, name):
    from grpolab.algo.entropy_bonus import entropy_bonus
    from grpolab.config.objective import TermSection

    policy, batch = float64_setup
    model = policy.model
    trl_options, ours_options = OBJECTIVES[name]
    trainer = _trl_trainer(policy, tmp_path, **trl_options)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    with torch.no_grad():
        logp0 = completion_logprobs(model, batch)
    g = torch.Generator().manual_seed(7)
    old = (logp0 + 0.3 * torch.randn(logp0.shape, generator=g, dtype=torch.float64)).detach()
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.0, 0.7], dtype=torch.float64)
    mask = batch.completion_mask
    inputs = _trl_inputs(batch, mask, adv, old)
    trl_scores_in_float64(trainer)  # TRL's forward checked against grpolab's, then grpolab's float64 stands in
    trl_loss = trainer._compute_loss(model, inputs)
    assert trl_loss.dtype == torch.float64
    trl_grad = torch.autograd.grad(trl_loss, params)

    opts = dict(ours_options)
    aggregation = opts.pop("agg")
    terms = TermSection(cispo_cap=opts.pop("cispo_cap", TermSection.cispo_cap))
    coef = opts.pop("entropy_coef", 0.0)
    both = completion_logprobs(model, batch, entropy=True)
    logp, entropy = both[..., 0], both[..., 1]
    ours, st = policy_loss(logp, old, adv, mask, aggregation=aggregation, params=terms.term_params(), **opts)
    ours = ours - coef * entropy_bonus(entropy, mask, float(mask.sum()))
    our_grad = torch.autograd.grad(ours, params, retain_graph=True)
    assert abs(ours.item() - trl_loss.item()) <= 1e-6 * abs(trl_loss.item())
    for a, b in zip(our_grad, trl_grad):
        assert _relative(a, b) <= 1e-6
    # the comparison is not vacuous: the objective's gradient differs from the plain clipped one's (GRPO's, the
    # default aggregation: luspo differs from it by its aggregation alone)
    plain, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean" if "luspo" in name else aggregation)
    if name == "entropy-bonus":
        plain = plain - 0.0 * entropy.sum()  # the same graph without the bonus
    plain_grad = torch.autograd.grad(plain, params)
    assert max(_relative(a, b) for a, b in zip(our_grad, plain_grad)) > 1e-3
    if name == "cispo":
        assert 0 < st["clip_frac"].item() < 1, "some weights must be truncated, some not"


@pytest.mark.slow
def test_the_adaptive_entropy_coefficient_follows_trl_s_step_by_step(float64_setup, tmp_path):
    """TRL's use_adaptive_entropy over five optimizer steps on the same batch, the target placed between the batch's
    entropy and a value it never reaches: grpolab's EntropyControl applies and moves the coefficient as TRL does
    (no bonus at the first step, then c, c + delta, ...), and each step's loss equals TRL's."""
    from grpolab.algo.entropy_bonus import EntropyControl, entropy_bonus

    policy, batch = float64_setup
    model = policy.model
    mask = batch.completion_mask
    with torch.no_grad():
        h = float(entropy_bonus(completion_logprobs(model, batch, entropy=True)[..., 1], mask, float(mask.sum())))
    options = dict(entropy_coef=0.02, entropy_coef_delta=0.01, entropy_coef_max=0.045, entropy_target=h + 0.1)
    trainer = _trl_trainer(policy, tmp_path, loss_type="dapo", use_adaptive_entropy=True, **options)
    trl_scores_in_float64(trainer)  # TRL's forward checked against grpolab's, then grpolab's float64 stands in
    control = EntropyControl(0.02, adaptive=True, target=h + 0.1, delta=0.01, high=0.045)
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.3, -0.3, 0.0, 0.7], dtype=torch.float64)
    inputs = _trl_inputs(batch, mask, adv, None)
    applied = []
    model.train()
    for _ in range(5):
        trl_loss = trainer._compute_loss(model, inputs)
        both = completion_logprobs(model, batch, entropy=True)
        logp, ent = both[..., 0], both[..., 1]
        bonus = entropy_bonus(ent, mask, float(mask.sum()))
        ours = policy_loss(logp, logp.detach(), adv, mask, aggregation="token-mean")[0] - control.applied() * bonus
        assert abs(ours.item() - trl_loss.item()) <= 1e-9 * abs(trl_loss.item())
        applied.append(control.applied())
        control.observe(float(bonus))
        assert control.coef == pytest.approx(trainer.entropy_coef, abs=1e-15)
    assert applied == pytest.approx([0.0, 0.03, 0.04, 0.045, 0.045])
