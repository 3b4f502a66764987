"""grpolab's loss and gradient equal what TRL 1.16's GRPOTrainer computes, to 1e-6 in float64, on one fixed batch,
through the drop-in's mapping (trl is in the `test` extra: this runs, never skips, in `make test`).

Each case is one set of TRL keywords ``kw``. TRL's side is ``trl.GRPOTrainer`` with ``trl.GRPOConfig(**kw)``: its own
``_generate_and_score_completions`` samples the batch (3 prompts x G = 4 on the built-in model in float64, seeded: the
same completions in every case), scores it with a reward function of the completion text and gives the advantages,
the completion mask and the token count; its ``_compute_loss`` gives the loss, autograd the gradient. grpolab's side is
``grpolab.trl.GRPOConfig(**kw)`` mapped by ``to_options`` into a ``TrainConfig``: the advantages of TRL's rewards by
``step_advantages`` (what the trainer calls), the loss tokens by ``loss_token_mask`` and the entropy selection as the
Updater makes them, and ``policy_loss`` with the options ``loss_options`` gives the Updater, minus the entropy bonus
where it is set.

Both sides take the same old and reference log-probs: the model's own, shifted per token by seeded noise, so every
ratio and the KL are away from where the options are inert, and each case asserts that its option changes grpolab's
gradient (against the case ``AGAINST`` names), so no comparison is vacuous. TRL's forward returns float32 log-probs
(its fused head); grpolab's float64 ones of the same ids stand in (``helpers.trl_scoring.trl_scores_in_float64``), so what is
compared is the objective.

Where TRL and grpolab differ by design, and why the cases still agree:

- the normalisers: TRL normalises per micro-batch (bnpo: the micro-batch's tokens; dr_grpo: its rows x
  max_completion_length; grpo, sapo, luspo: its rows; each divided by the accumulation steps), grpolab by the whole
  step's rows and tokens: the same here, where the batch is one micro-batch (dapo, cispo and vespo take the
  generation's token count on both sides). So bnpo equals dapo here; it is checked non-vacuous against grpo.
- scale_rewards group and batch: TRL divides the centred rewards by the sample standard deviation (n - 1), grpolab by
  default by the population one [RLVR essay, Sec. 3.5]; the drop-in asks for ``--reward-std sample``, so the
  advantages are equal (``test_advantages_are_trl_s_for_each_scale_rewards``). The loss cases compare grpolab's
  own advantages end to end.
- sapo: TRL's ``torch.where`` of two Python floats rounds the temperatures to float32 (1.05 -> 1.0499999523),
  grpolab keeps them in float64: 6.5e-7 of the loss here (2.7e-8 of the gradient), the one case not equal to the
  last bit.
- top_entropy_quantile: TRL takes the threshold over the entropies of each pass's own forward (float32), grpolab over
  the sampling policy's, once per step (float32 too): the same at the first pass of a step, as here.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers.trl_scoring import trl_scores_in_float64

from grpolab.algo.entropy_bonus import entropy_bonus
from grpolab.algo.loss import entropy_threshold, high_entropy_mask, loss_token_mask, policy_loss
from grpolab.common.batch import Batch
from grpolab.config.train import TrainConfig
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import load_policy
from grpolab.training.credit import step_advantages
from grpolab.training.update import loss_options
from grpolab.trl import GRPOConfig as DropInConfig
from grpolab.trl.config import to_options

QUESTIONS = ("2+3", "7*8", "12+7-3")
G = 4
SEED = 0  # torch's seed for TRL's sampling: 16 tokens of it leave some completions finished, some cut
COMMON = dict(
    per_device_train_batch_size=len(QUESTIONS) * G,
    num_generations=G,
    max_completion_length=16,
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
)
BASE: dict = {}  # TRL's defaults (loss_type dapo, epsilon 0.2, beta 0, scale_rewards group)

# name: TRL's keywords on top of BASE
CASES = {
    "dapo": {},
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "sequence": dict(importance_sampling_level="sequence"),
    "delta": dict(epsilon_high=0.28, delta=1.4),
    "beta": dict(beta=0.04),  # TRL's default use_bias_correction_kl=True: grpolab's kl_ratio
    "beta-no-bias-correction": dict(beta=0.04, use_bias_correction_kl=False),
    "beta-sequence": dict(beta=0.04, importance_sampling_level="sequence"),
    "beta-grpo": dict(beta=0.04, loss_type="grpo"),
    "mask-truncated": dict(mask_truncated_completions=True),
    "top-entropy": dict(top_entropy_quantile=0.3),
    "off-policy-mask": dict(off_policy_mask_threshold=0.02),  # drops one rollout here (A < 0, its gap 0.024)
    "entropy-bonus": dict(entropy_coef=0.05),
}
# name: the keywords (on top of BASE) whose gradient the case's must differ from; default: BASE's own
AGAINST = {
    "dapo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="grpo"),  # equal to dapo on one micro-batch (the module docstring)
    "sapo": dict(loss_type="grpo"),
    "luspo": dict(importance_sampling_level="sequence"),
    "delta": dict(epsilon_high=0.28),
    "beta-no-bias-correction": dict(beta=0.04),  # use_bias_correction_kl matters
    "beta-sequence": dict(beta=0.04, importance_sampling_level="sequence", use_bias_correction_kl=False),
    "beta-grpo": dict(beta=0.04, loss_type="grpo", use_bias_correction_kl=False),
}


def text_reward(completions, **kwargs) -> list[float]:
    """A deterministic reward of the completion text (multiples of 1/4: exact in float32)."""
    return [0.25 * c.count("1") + 0.5 * (len(c) % 3) for c in completions]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The built-in model in float64, TRL's prompts, and the fixed batch TRL samples from them with BASE: its
    completions, its rewards, and the old and reference log-probs both sides take (the model's, shifted per token)."""
    policy = load_policy("builtin")
    policy.model.double()
    prompts = [policy.tokenizer.decode(policy.prompt_ids({"question": q})) for q in QUESTIONS for _ in range(G)]
    trainer = _trl_trainer(policy, prompts, BASE, tmp_path_factory.mktemp("base"))
    out, rewards, completions = _generate(trainer, prompts)
    assert rewards.tolist() == text_reward(completions)  # TRL's rewards: the function's, of its completions
    batch = Batch(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])
    with torch.no_grad():
        logp0 = completion_logprobs(policy.model, batch)  # [N, T]
    g = torch.Generator().manual_seed(7)
    old = (logp0 + 0.3 * torch.randn(logp0.shape, generator=g, dtype=torch.float64)).detach()
    ref = (logp0 + 0.3 * torch.randn(logp0.shape, generator=g, dtype=torch.float64)).detach()
    return SimpleNamespace(policy=policy, prompts=prompts, batch=batch, rewards=rewards, old=old, ref=ref)


def _trl_trainer(policy, prompts, kw, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=text_reward,
        args=GRPOConfig(output_dir=str(tmp_path), **COMMON, **kw),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=policy.tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop; one step, no accumulation
    return trainer


def _generate(trainer, prompts):
    """TRL's ``_generate_and_score_completions`` on ``prompts`` (seeded): its output, the rewards it computed (its
    log's) and the completions' text."""
    trainer.model.train()
    torch.manual_seed(SEED)
    out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    n = len(prompts)
    rewards = torch.tensor(list(trainer._logs["rewards"]["text_reward"])[-n:])  # [N] float32
    return out, rewards, list(trainer._logs["completion"])[-n:]


def _grpolab_config(kw, tmp_path) -> TrainConfig:
    """The drop-in's GRPOConfig of the same keywords as TRL's, mapped to grpolab's options; the objective's sections
    validated."""
    args = DropInConfig(output_dir=str(tmp_path), **COMMON, **kw)
    cfg = TrainConfig().replace(**to_options(args, train_rows=len(QUESTIONS) * G))
    cfg.objective.validate()
    cfg.terms.validate()
    cfg.terms.check_with(cfg.objective)
    return cfg


def _grpolab_advantages(rewards: torch.Tensor, objective) -> torch.Tensor:
    """``[N]`` grpolab's advantages of the rewards ``[N]`` (B groups of G, in order), as the trainer computes them."""
    groups = SimpleNamespace(
        rows=SimpleNamespace(scores=SimpleNamespace(total=rewards, unscorable=None), episodes=None), sizes=[G] * 3
    )
    roll = SimpleNamespace(groups=groups, rewards=rewards.view(-1, G).tolist())
    return step_advantages(roll, objective, "cpu").rollout


def _params(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _grpolab_loss(setup, cfg: TrainConfig):
    """grpolab's loss of the fixed batch under ``cfg``, its gradient, the advantages and the loss tokens."""
    obj, terms, batch = cfg.objective, cfg.terms, setup.batch
    model = setup.policy.model
    adv = _grpolab_advantages(setup.rewards, obj)  # [N]
    mask = batch.completion_mask
    loss_mask = loss_token_mask(batch.completion_ids, mask, setup.policy.eos_id, mask_truncated=obj.mask_truncated)
    both = completion_logprobs(model, batch, entropy=True)  # [N, T, 2]
    logp, ent = both[..., 0], both[..., 1]
    weights = None
    if obj.top_entropy_quantile < 1:  # the Updater's: one threshold over the loss tokens' sampling entropies
        sampled = ent.detach()
        threshold = entropy_threshold(sampled[loss_mask.bool()].float(), obj.top_entropy_quantile)
        weights = high_entropy_mask(sampled, loss_mask, threshold)
    loss, st = policy_loss(
        logp,
        setup.old,
        adv,
        loss_mask,
        ref_logp=setup.ref,
        token_weights=weights,
        num_seqs=mask.shape[0],
        num_tokens=float(loss_mask.sum()),
        **loss_options(obj, terms, cfg.max_policy_tokens),
    )
    if terms.entropy_bonus:
        carry = loss_mask if weights is None else loss_mask * weights
        loss = loss - terms.entropy_coef * entropy_bonus(ent, carry, float(carry.sum()))
    grad = torch.autograd.grad(loss, _params(model))
    return loss.detach(), grad, adv, loss_mask, st


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_equal_trl_s_through_the_drop_in_s_mapping(setup, tmp_path, name):
    kw = BASE | CASES[name]
    model = setup.policy.model
    trainer = _trl_trainer(setup.policy, setup.prompts, kw, tmp_path)
    out, rewards, _ = _generate(trainer, setup.prompts)
    assert torch.equal(out["completion_ids"], setup.batch.completion_ids) and torch.equal(rewards, setup.rewards)
    out |= {"old_per_token_logps": setup.old, "ref_per_token_logps": setup.ref}
    trl_scores_in_float64(trainer)
    trl_loss = trainer._compute_loss(model, out)
    assert trl_loss.dtype == torch.float64
    trl_grad = torch.autograd.grad(trl_loss, _params(model))

    cfg = _grpolab_config(kw, tmp_path)
    assert cfg.objective.kl_ratio == kw.get("use_bias_correction_kl", True)  # TRL's default: on
    ours, our_grad, adv, loss_mask, st = _grpolab_loss(setup, cfg)
    assert torch.equal(adv, out["advantages"])  # scale_rewards none: the same advantages, bit for bit
    assert torch.equal(loss_mask.long(), out["completion_mask"].long())  # mask_truncated: the same rule
    assert abs(ours.item() - trl_loss.item()) <= 1e-6 * max(abs(trl_loss.item()), 1e-3)
    for a, b in zip(our_grad, trl_grad, strict=True):
        assert _relative(a, b) <= 1e-6

    # not vacuous: the option changes the gradient (and the ratios are off 1: the clip binds on some tokens)
    _, plain_grad, *_ = _grpolab_loss(setup, _grpolab_config(BASE | AGAINST.get(name, {}), tmp_path))
    assert max(_relative(a, b) for a, b in zip(our_grad, plain_grad, strict=True)) > 1e-3
    if name == "dapo":
        assert 0 < st["clip_frac"].item() < 0.5
    if name == "mask-truncated":
        assert 0 < loss_mask.any(1).sum() < loss_mask.shape[0], "the batch must hold truncated and finished rows"


def test_advantages_are_trl_s_for_each_scale_rewards(setup, tmp_path):
    """TRL's own advantages (its _generate_and_score_completions) for each scale_rewards equal grpolab's of the same
    rewards through the mapping, to 1e-6: TRL divides by torch's (sample, n - 1) standard deviation, which the drop-in
    asks of grpolab as --reward-std sample; grpolab's default population std would give sqrt(G / (G - 1)) times them
    (checked too, so the option is not vacuous)."""
    divisors = {"group", "batch", "none"}
    trl_adv = {}
    for scale in sorted(divisors):
        kw = BASE | dict(scale_rewards=scale)
        out, rewards, _ = _generate(_trl_trainer(setup.policy, setup.prompts, kw, tmp_path / scale), setup.prompts)
        assert torch.equal(out["completion_ids"], setup.batch.completion_ids) and torch.equal(rewards, setup.rewards)
        objective = _grpolab_config(kw, tmp_path).objective
        ours = _grpolab_advantages(rewards, objective).double()  # [N]
        assert (ours - out["advantages"].double()).abs().max() <= 1e-6
        if scale != "none":
            population = _grpolab_advantages(rewards, dataclasses.replace(objective, reward_std="population"))
            assert (population.double() - out["advantages"].double()).abs().max() > 1e-2
        trl_adv[scale] = out["advantages"]
    # the three differ on this batch (its groups' rewards vary, and their spreads differ from the batch's)
    for a, b in (("group", "batch"), ("group", "none"), ("batch", "none")):
        assert (trl_adv[a] - trl_adv[b]).abs().max() > 1e-2
