"""grpolab.trl's DistillationConfig field by field against TRL's own dataclass, TRL's parser on it, its translation
and refusals, and a DistillationTrainer's run from a teacher."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from helpers.models import builtin_teacher
from helpers.paths import REPO
from helpers.trl_fields import assert_fields_are_trls

from grpolab.trl import DistillationConfig, DistillationTrainer
from grpolab.trl.distillation_config import translate_distillation
from grpolab.trl.distillation_fields import DISTILL_BY_NAME, DISTILL_FIELDS
from grpolab.trl.fields import markdown_table


@pytest.fixture(autouse=True)
def _a_cpu_without_bf16_units(machine_kind):
    """TRL's bf16=True is a question to the machine: translated here on a CPU without bf16 units (fp32)."""
    machine_kind(bf16=False)


BUILTIN = str(REPO / "grpolab" / "assets" / "arith-sft")
SMALL = dict(use_cpu=True, bf16=False, report_to="none", max_steps=2, per_device_train_batch_size=4,
             max_completion_length=12)  # fmt: skip


def test_every_trl_distillation_field_is_classified_with_trl_s_default_type_and_parser_options():
    from trl import DistillationConfig as TrlConfig

    assert_fields_are_trls(DistillationConfig, TrlConfig, DISTILL_FIELDS)
    assert {"top_p", "eval_strategy", "max_tool_calling_iterations"} <= {
        f.name for f in DISTILL_FIELDS if f.kind == "refused"
    }


def test_the_docs_hold_the_generated_table():
    doc = (REPO / "docs" / "coming-from-trl.md").read_text()
    assert markdown_table(DISTILL_FIELDS) in doc, "regenerate: python -m grpolab.trl.distillation_fields"


def test_the_trainer_takes_trl_s_constructor_and_one_keyword_more():
    from trl import DistillationTrainer as TrlTrainer

    theirs = list(inspect.signature(TrlTrainer.__init__).parameters)
    ours = list(inspect.signature(DistillationTrainer.__init__).parameters)
    assert ours == [*theirs, "reward_funcs"]


RECIPE = """\
output_dir: from-yaml
max_steps: 3
beta: 0.5
teacher_model_name_or_path: a-teacher
teacher_model_init_kwargs:
  dtype: float32
per_device_train_batch_size: 4
use_cpu: true
bf16: false
report_to: none
"""


@pytest.mark.parametrize("how", ["recipe", "recipe and flags"])
def test_trl_s_parser_reads_a_recipe_into_the_values_trl_s_config_gets(tmp_path, how):
    from trl import DistillationConfig as TrlConfig
    from trl import TrlParser

    (tmp_path / "recipe.yaml").write_text(RECIPE)
    args = ["--config", str(tmp_path / "recipe.yaml")] + (["--max_steps", "5", "--beta", "0.0"] if "flags" in how
                                                           else [])  # fmt: skip
    (theirs,) = TrlParser((TrlConfig,)).parse_args_and_config(args)
    (ours,) = TrlParser((DistillationConfig,)).parse_args_and_config(args)
    unequal = {f.name for f in dataclasses.fields(theirs) if getattr(theirs, f.name) != getattr(ours, f.name)}
    assert unequal == set()
    assert (ours.output_dir, ours.teacher_model_init_kwargs) == ("from-yaml", {"dtype": "float32"})
    options = translate_distillation(ours, train_rows=8).options
    assert options["distill_loss"] == ("fkl" if "flags" in how else "jsd")
    assert options["steps"] == (5 if "flags" in how else 3)


@pytest.mark.parametrize("beta,expected", [(0.0, {"distill_loss": "fkl"}), (1.0, {"distill_loss": "rkl"}),
                                           (0.3, {"distill_loss": "jsd", "distill_beta": 0.3})])  # fmt: skip
def test_the_translation_is_trl_s_distillation(beta, expected):
    options = translate_distillation(DistillationConfig(**SMALL, beta=beta, gradient_accumulation_steps=2), 1, 16)
    options = options.options
    assert {k: options[k] for k in expected} == expected
    fixed = ("estimator", "group_size", "aggregation", "task_reward", "distill_coef", "beta", "prompts_per_step",
             "micro_batch", "steps", "lr")  # fmt: skip
    assert {k: options[k] for k in fixed} == {
        "estimator": "vanilla", "group_size": 1, "aggregation": "token-mean", "task_reward": False,
        "distill_coef": 1.0, "beta": 0.0, "prompts_per_step": 8, "micro_batch": 4, "steps": 2, "lr": 1e-6,
    }  # fmt: skip


@pytest.mark.parametrize("name", [f.name for f in DISTILL_FIELDS if f.kind == "refused"])
def test_a_refused_field_set_is_one_line_naming_it(name):
    value = {"top_p": 0.9, "eval_strategy": "steps", "max_tool_calling_iterations": 2}.get(name, "x")
    with pytest.raises((ValueError, TypeError)) as e:
        DistillationConfig(**{name: value if DISTILL_BY_NAME[name].default != value else "y"})
    if isinstance(e.value, ValueError):
        assert str(e.value).startswith(f"DistillationConfig.{name}=") and "\n" not in str(e.value)


def test_beta_outside_0_1_and_other_teacher_keywords_are_refused():
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\]"):
        DistillationConfig(beta=1.5)
    args = DistillationConfig(**SMALL, teacher_model_init_kwargs={"quantization_config": {}})
    with pytest.raises(ValueError, match="^DistillationConfig.teacher_model_init_kwargs="):
        translate_distillation(args, 1, 16)
    with pytest.raises(ValueError, match="teacher model is required"):
        DistillationTrainer(BUILTIN, args=DistillationConfig(**SMALL), train_dataset=[{"prompt": "1+1"}])


def test_two_steps_from_a_teacher_log_trl_s_names_and_move_the_weights(tmp_path):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    teacher = builtin_teacher(tmp_path / "teacher")
    args = DistillationConfig(**SMALL | dict(output_dir=str(tmp_path / "run"), logging_steps=1, learning_rate=1e-4,
                                             disable_tqdm=True))  # fmt: skip
    rows = [{"prompt": f"{a}+{b}"} for a in range(4) for b in range(4)]
    trainer = DistillationTrainer(BUILTIN, str(teacher), args=args, train_dataset=rows)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    out = trainer.train()
    assert out.global_step == 2
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [1, 2]
    for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "completions/mean_length", "entropy",
                "step_time", "distill/kl", "time/teacher_s"):  # fmt: skip
        assert key in logs[-1], key
    assert not {"reward", "kl", "clip_ratio/region_mean", "rewards/no_reward/mean"} & set(logs[-1])
    assert logs[-1]["loss"] == pytest.approx(logs[-1]["distill/kl"], rel=1e-5) and logs[-1]["loss"] > 0
    moved = [not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())]
    assert all(moved)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["distill_loss"], config["group_size"], config["task_reward"]) == ("rkl", 1, False)
    trainer.save_model(str(tmp_path / "hf"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == trainer.model.config.vocab_size
