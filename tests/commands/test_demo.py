"""The demo's configurations, checked without running them (the real-model run takes ~40 minutes)."""

from __future__ import annotations

import pytest

from grpolab.commands.demo import DEMO_TOKEN_CREDIT, LORA_PRESET, REAL_MODEL_PRESET, DemoConfig, demo_train_config
from grpolab.config import fields
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.data.arithmetic import ArithmeticSpec, held_out_size, question_space


def test_real_model_preset_is_a_valid_config_with_enough_held_out_questions():
    cfg = demo_train_config(DemoConfig(model="smollm2-135m-instruct", out="runs/x", seed=1))
    cfg.validate()
    assert (cfg.policy.model, cfg.run.seed, cfg.run.out, cfg.policy.lora_rank) == (
        "smollm2-135m-instruct",
        1,
        "runs/x",
        0,
    )
    for key, value in REAL_MODEL_PRESET.items():
        assert fields.get(cfg, key) == value, key
    assert cfg.eval.eval_questions >= 200 and cfg.eval.eval_samples >= 2
    spec = ArithmeticSpec(cfg.arithmetic.max_operand, cfg.arithmetic.mul_max, cfg.arithmetic.categories)
    # the held-out questions are a real subset of the task, and training keeps at least as many others
    assert held_out_size(spec, cfg.eval.eval_questions) >= cfg.eval.eval_questions
    assert question_space(spec) - held_out_size(spec, cfg.eval.eval_questions) >= cfg.eval.eval_questions
    # the last step is evaluated and saved: the before/after table and the probes' end checkpoint exist
    assert cfg.run.steps % cfg.eval.eval_every == 0 and cfg.run.steps % cfg.logging.save_every == 0


def test_lora_variant_and_step_override():
    cfg = demo_train_config(DemoConfig(model="smollm2-135m-instruct", lora_rank=16, steps=6))
    cfg.validate()
    assert cfg.policy.lora_rank == 16 and cfg.optimizer.lr == LORA_PRESET["lr"] and cfg.run.steps == 6


def test_builtin_demo_is_trainings_defaults():
    cfg = demo_train_config(DemoConfig(out="o"))
    # the defaults of `grpolab train`, recording 4 rollouts a step token by token for the report
    assert cfg.probe.log_token_credit == DEMO_TOKEN_CREDIT == 4
    assert cfg.replace(out="runs/train", progress=True, log_token_credit=0) == TrainConfig().resolved()
    with pytest.raises(ConfigError, match="--lora-rank"):
        demo_train_config(DemoConfig(lora_rank=4))
