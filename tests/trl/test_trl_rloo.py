"""grpolab.trl's RLOOConfig field by field against TRL's own dataclass, TRL's parser on it, its translation and
refusals, RLOO's advantages and gradient against TRL's RLOOTrainer's own code in float64, and RLOOTrainer's run."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from helpers.paths import REPO
from helpers.trl_fields import assert_fields_are_trls
from helpers.trl_scoring import trl_scores_in_float64

from grpolab.trl import RLOOConfig, RLOOTrainer
from grpolab.trl.fields import markdown_table
from grpolab.trl.rloo_config import translate_rloo
from grpolab.trl.rloo_fields import RLOO_BY_NAME, RLOO_FIELDS


@pytest.fixture(autouse=True)
def _a_cpu_without_bf16_units(machine_kind):
    """TRL's bf16=True is a question to the machine: translated here on a CPU without bf16 units (fp32)."""
    machine_kind(bf16=False)


BUILTIN = str(REPO / "grpolab" / "assets" / "arith-sft")
SMALL = dict(beta=0.0, use_cpu=True, bf16=False, report_to="none", max_steps=2, num_generations=4,
             per_device_train_batch_size=8, max_completion_length=12)  # fmt: skip


# ---------------------------------------------------------------- the table against TRL's dataclass


def test_every_trl_rloo_field_is_classified_with_trl_s_default_type_and_parser_options():
    from trl import RLOOConfig as TrlConfig

    assert_fields_are_trls(RLOOConfig, TrlConfig, RLOO_FIELDS)
    refused = {f.name for f in RLOO_FIELDS if f.kind == "refused"}
    assert {"beta", "num_iterations", "normalize_advantages", "reward_clip_range"} <= refused


def test_the_docs_hold_the_generated_table():
    doc = (REPO / "docs" / "coming-from-trl.md").read_text()
    assert markdown_table(RLOO_FIELDS) in doc, "regenerate: python -m grpolab.trl.rloo_fields"


def test_the_trainer_takes_trl_s_constructor():
    from trl import RLOOTrainer as TrlTrainer

    theirs = list(inspect.signature(TrlTrainer.__init__).parameters)
    assert list(inspect.signature(RLOOTrainer.__init__).parameters) == theirs


RECIPE = """\
output_dir: from-yaml
max_steps: 3
beta: 0.0
num_generations: 4
per_device_train_batch_size: 4
reward_weights: [1.0, 0.5]
epsilon_high: 0.28
model_init_kwargs:
  dtype: float32
use_cpu: true
bf16: false
report_to: none
"""


@pytest.mark.parametrize("how", ["recipe", "recipe and flags"])
def test_trl_s_parser_reads_a_recipe_into_the_values_trl_s_config_gets(tmp_path, how):
    from trl import RLOOConfig as TrlConfig
    from trl import TrlParser

    (tmp_path / "recipe.yaml").write_text(RECIPE)
    args = ["--config", str(tmp_path / "recipe.yaml")] + (["--max_steps", "5", "--temperature", "0.7"] if "flags"
                                                           in how else [])  # fmt: skip
    (theirs,) = TrlParser((TrlConfig,)).parse_args_and_config(args)
    (ours,) = TrlParser((RLOOConfig,)).parse_args_and_config(args)
    unequal = {f.name for f in dataclasses.fields(theirs) if getattr(theirs, f.name) != getattr(ours, f.name)}
    assert unequal == set()
    assert (ours.output_dir, ours.beta, ours.reward_weights, ours.epsilon_high) == ("from-yaml", 0.0, [1.0, 0.5], 0.28)
    assert ours.max_steps == (5 if "flags" in how else 3)
    assert translate_rloo(ours, train_rows=8).options["estimator"] == "rloo"


# ---------------------------------------------------------------- the translation and the refusals


def test_the_translation_is_rloo_s_objective():
    options = translate_rloo(RLOOConfig(**SMALL), train_rows=16).options
    assert {k: options[k] for k in ("estimator", "aggregation", "loss_type", "importance_sampling", "beta")} == {
        "estimator": "rloo", "aggregation": "seq-mean-token-mean", "loss_type": "clip",
        "importance_sampling": "sequence-sum",
        "beta": 0.0,
    }  # fmt: skip
    assert (options["group_size"], options["prompts_per_step"], options["engine_correction"]) == (4, 2, "none")
    assert "reward_std" not in options and options["scale_rewards"] == "group"


def test_trl_s_default_beta_builds_but_the_run_refuses_it_in_one_line():
    config = RLOOConfig()  # TRL's defaults, beta=0.05 among them
    assert (config.beta, config.num_generations, config.generation_batch_size) == (0.05, 2, 8)
    with pytest.raises(ValueError, match=r"^RLOOConfig.beta=0.05: [^\n]*give beta=0.0"):
        translate_rloo(config, train_rows=16)
    with pytest.raises(ValueError, match=r"^RLOOConfig.beta=0.05: "):
        RLOOTrainer(BUILTIN, lambda completions, **kw: [0.0] * len(completions), args=config, train_dataset=[])
    with pytest.raises(ValueError, match=r"^RLOOConfig.steps_per_generation=2: must equal gradient_accumulation"):
        translate_rloo(RLOOConfig(**SMALL | dict(steps_per_generation=2)), train_rows=16)
    with pytest.raises(ValueError, match=r"^RLOOConfig.lr_scheduler_type='polynomial': "):  # a shared field's
        translate_rloo(RLOOConfig(**SMALL | dict(lr_scheduler_type="polynomial")), train_rows=16)


@pytest.mark.parametrize("name", [f.name for f in RLOO_FIELDS if f.kind == "refused"])
def test_a_refused_field_set_is_one_line_naming_it(name):
    value = {bool: lambda d: not d, int: lambda d: d + 1, float: lambda d: d * 0.5 + 0.01}.get(
        type(RLOO_BY_NAME[name].default), lambda d: "x"
    )(RLOO_BY_NAME[name].default)
    value = (0.0, 1.0) if name == "reward_clip_range" else value
    with pytest.raises(ValueError) as e:
        RLOOConfig(**{name: value})
    assert str(e.value).startswith(f"RLOOConfig.{name}=") and "\n" not in str(e.value)


# ---------------------------------------------------------------- against TRL's RLOOTrainer (float64)

REWARDS = [1.0, 0.0, 0.5, 0.25, -0.3, 0.7, 0.7, 0.1]  # two groups of four


@pytest.mark.slow
def test_advantages_and_gradient_equal_trl_s_rloo_in_float64(tmp_path):
    """TRL's own _generate_and_score_completions (its generation replaced by a fixed batch, its rewards fixed) and
    _compute_loss on the built-in model in float64: the advantages equal grpolab's rloo estimator's, and the loss
    of the translated options has TRL's value and gradient, at ratio 1 and with the old log-probs moved (ratios off 1,
    some clipped)."""
    from datasets import Dataset
    from trl import RLOOConfig as TrlConfig
    from trl import RLOOTrainer as TrlTrainer

    from grpolab.algo.advantages import compute_advantages
    from grpolab.algo.loss import policy_loss
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.models.policy import load_policy
    from grpolab.rollout.sampler import sample

    policy = load_policy("builtin")
    model = policy.model.double()
    prompts = [policy.prompt_ids({"question": q}) for q in ("12+7-3", "23*7")]
    batch = sample(model, [p for p in prompts for _ in range(4)], [(5, i) for i in range(8)], max_new_tokens=12,
                   temperature=1.0, top_p=1.0, eos_id=policy.eos_id, pad_id=policy.pad_id)  # fmt: skip
    options = dict(SMALL, output_dir=str(tmp_path), save_strategy="no", gradient_checkpointing=False)
    trainer = TrlTrainer(model=model, reward_funcs=lambda completions, **kw: REWARDS[: len(completions)],
                         args=TrlConfig(**options | dict(disable_dropout=True)), processing_class=policy.tokenizer,
                         train_dataset=Dataset.from_list([{"prompt": "1+1"}] * 8))  # fmt: skip
    ids = [
        (p[pm.bool()].tolist(), c[cm.bool()].tolist())
        for p, pm, c, cm in zip(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    ]
    trainer._generate = lambda prompts: ([p for p, _ in ids], [c for _, c in ids], ["done"] * len(ids))
    trl_scores_in_float64(trainer)
    model.train()
    scored = trainer._generate_and_score_completions([{"prompt": "1+1"}] * 8)
    ours_adv = compute_advantages(torch.tensor(REWARDS).view(2, 4), "rloo").view(-1).double()  # [N]
    assert (scored["advantages"].double() - ours_adv).abs().max() <= 1e-6
    grpo = compute_advantages(torch.tensor(REWARDS).view(2, 4), "grpo").view(-1).double()
    assert (scored["advantages"].double() - grpo).abs().max() > 1e-2  # the leave-one-out baseline, not the mean

    params = [p for p in model.parameters() if p.requires_grad]
    opts = translate_rloo(RLOOConfig(**options), train_rows=8).options
    mask = batch.completion_mask
    trl_adv = scored["advantages"].double()  # [N] as TRL computed them (float32's values)
    with torch.no_grad():
        logp0 = completion_logprobs(model, batch)
    shift = torch.tensor([0.0, 0.3, -0.25, 0.05, -0.4, 0.15, 0.0, 0.5], dtype=torch.float64)  # some past the clip
    for moved in (torch.zeros(8, dtype=torch.float64), shift):
        scored["old_logps"] = (logp0 * mask).sum(1) + moved  # [N] TRL's per-completion old log-probs
        trl_loss = trainer._compute_loss(model, scored)
        trl_grad = torch.autograd.grad(trl_loss, params)
        old = logp0 + (moved / mask.sum(1))[:, None] * mask  # the same per-completion shift, spread over its tokens
        logp = completion_logprobs(model, batch)
        ours, _ = policy_loss(logp, old, trl_adv, mask, aggregation=opts["aggregation"],
                              loss_type=opts["loss_type"], importance_sampling=opts["importance_sampling"],
                              clip_low=opts["clip_low"], clip_high=opts["clip_high"], beta=opts["beta"])  # fmt: skip
        our_grad = torch.autograd.grad(ours, params)
        assert ours.item() == pytest.approx(trl_loss.item(), abs=1e-9)
        for a, b in zip(our_grad, trl_grad):
            assert float((a - b).norm() / b.norm().clamp(min=1e-300)) <= 1e-6


# ---------------------------------------------------------------- the trainer's run


def _rows():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(4) for b in range(4)])


def ends_right(completions, answer, **kwargs):
    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]


@pytest.mark.slow
def test_two_steps_log_rloo_s_names_and_save_the_model(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    args = RLOOConfig(**SMALL | dict(output_dir=str(tmp_path / "run"), logging_steps=1, learning_rate=1e-4,
                                     disable_tqdm=True))  # fmt: skip
    trainer = RLOOTrainer(BUILTIN, ends_right, args=args, train_dataset=_rows())
    out = trainer.train()
    assert out.global_step == 2
    logs = [e for e in trainer.state.log_history if "reward" in e]
    assert [e["step"] for e in logs] == [1, 2]
    for key in ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/ends_right/mean",
                "completions/mean_length", "entropy", "clip_ratio/region_mean", "frac_reward_zero_std", "num_tokens"):  # fmt: skip
        assert key in logs[-1], key
    assert not {"policy_loss", "entropy_coef"} & set(logs[-1])  # GRPO's names that TRL's RLOO never logs
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["estimator"], config["aggregation"], config["group_size"]) == ("rloo", "seq-mean-token-mean", 4)
    trainer.save_model(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in trainer.model.parameters())
