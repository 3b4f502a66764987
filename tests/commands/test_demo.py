"""The demo's configurations, checked without running them (the real-model run takes ~40 minutes)."""

from __future__ import annotations

import pytest

from grpolab.commands.demo import (
    DEMO_TOKEN_CREDIT,
    LORA_PRESET,
    REAL_MODEL_PRESET,
    DemoConfig,
    demo_processes,
    demo_train_config,
    phases,
    took_line,
)
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


def test_the_builtin_demo_runs_one_process_per_core_and_the_others_one(monkeypatch):
    monkeypatch.setattr("grpolab.training.launch.usable_cores", lambda: 2)
    monkeypatch.setattr("grpolab.training.launch.has_accelerator", lambda: False)
    assert demo_processes(DemoConfig())[0] == 2
    assert demo_processes(DemoConfig(nproc=1)) == (1, "--nproc")
    assert demo_processes(DemoConfig(steps=10))[0] == 1  # too short to repay a second process's start
    assert demo_processes(DemoConfig(model="smollm2-135m-instruct"))[0] == 1
    assert demo_processes(DemoConfig(task="shapes"))[0] == 1


def test_the_demos_clock_adds_up_to_its_wall_time():
    rows = [
        {"step": 0, "time/eval_s": 4.0},
        {"step": 1, "time/step_s": 1.0, "time/generate_s": 0.4, "time/update_s": 0.5, "time/score_s": 0.05},
        {"step": 2, "time/step_s": 1.5, "time/generate_s": 0.6, "time/update_s": 0.8, "time/eval_s": 5.0},
    ]
    clock = phases(rows, started=100.0, began=110.0, trained=125.0, ended=128.0)
    assert clock["startup_s"] == 10.0 and clock["report_s"] == 3.0 and clock["wall_s"] == 28.0
    assert (clock["evaluations"], clock["eval_s"], clock["steps"], clock["steps_s"]) == (2, 9.0, 2, 2.5)
    assert clock["generate_s"] == pytest.approx(1.0) and clock["update_s"] == pytest.approx(1.3)
    assert clock["loop_other_s"] == pytest.approx(15.0 - 9.0 - 2.5)
    line = took_line(clock, 2, "one per core (2 cores)")
    assert line.startswith("took 28 s on 2 processes (one per core (2 cores); --nproc 1 runs one)")
    assert "2 evaluations 9 s" in line and "2 steps 2 s" in line and "report 3 s" in line
    assert took_line({**clock, "wall_s": 367.4}, 1).startswith("took 6 min 7 s on 1 process:")
