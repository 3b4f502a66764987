"""grpolab.trl: TRL's GRPOConfig field by field against TRL's own dataclass, the translation into grpolab's options,
and GRPOTrainer's surface (train, log_history, callbacks, save_model, evaluate, resume, push_to_hub) on the built-in
model."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from pathlib import Path

import pytest
from helpers.marks import EACH_CPU
from helpers.paths import REPO

from grpolab.trl import GRPOConfig, GRPOTrainer
from grpolab.trl.config import translate
from grpolab.trl.fields import BY_NAME, FIELDS, markdown_table


@pytest.fixture(autouse=True)
def _a_cpu_without_bf16_units(machine_kind):
    """TRL's bf16=True is a question to the machine: this file's tests translate it on a CPU without bf16 units
    (fp32, said in one line), whatever CPU runs them; the tests of the other branch set the probe themselves."""
    machine_kind(bf16=False)


BUILTIN = str(REPO / "grpolab" / "assets" / "arith-sft")
DOC = REPO / "docs" / "coming-from-trl.md"


def _trl_fields() -> dict:
    from trl import GRPOConfig as TrlConfig

    out = {}
    for f in dataclasses.fields(TrlConfig):
        if not f.init:
            continue
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


# ---------------------------------------------------------------- the table against TRL's dataclass


def test_every_trl_field_is_classified_with_trl_s_default():
    """A field TRL adds (or drops, or whose default changes) fails here until the table says what it becomes."""
    trl = _trl_fields()
    assert set(trl) - set(BY_NAME) == set(), "TRL fields not classified in grpolab.trl.fields"
    assert set(BY_NAME) - set(trl) == set(), "fields in the table that TRL does not have"
    wrong = {n: (BY_NAME[n].default, trl[n]) for n in trl if BY_NAME[n].default != trl[n]}
    assert wrong == {}
    assert {f.kind for f in FIELDS} == {"mapped", "inert", "refused"}
    assert all(f.note for f in FIELDS if f.kind != "mapped"), "an inert or refused field says why"


def test_the_config_s_fields_and_defaults_are_the_table_s():
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    assert list(ours) == [f.name for f in FIELDS]
    cfg = GRPOConfig()
    assert cfg.learning_rate == 1e-6 and cfg.num_generations == 8 and cfg.max_completion_length == 512
    assert cfg.loss_type == "dapo" and cfg.beta == 0.0 and cfg.scale_rewards == "group"
    assert cfg.per_device_train_batch_size == 8 and cfg.num_train_epochs == 3 and cfg.lr_scheduler_type == "linear"
    assert cfg.gradient_checkpointing is True and cfg.seed == 42
    assert cfg.bf16 is True and cfg.steps_per_generation == 1 and cfg.generation_batch_size == 8  # TRL's resolution


def test_each_field_has_trl_s_type_and_parser_options():
    """TRL's parser reads a field by its type and its metadata's choices and nargs: the same as TRL's, each."""
    from trl import GRPOConfig as TrlConfig

    theirs = {f.name: f for f in dataclasses.fields(TrlConfig)}
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    assert {n: str(f.type) for n, f in ours.items()} == {n: str(f.type) for n, f in theirs.items()}

    def options(f) -> dict:
        return {k: list(v) if k == "choices" else v for k, v in f.metadata.items() if k != "help"}

    assert {n: options(f) for n, f in ours.items()} == {n: options(f) for n, f in theirs.items()}
    assert all(f.metadata["help"] for f in ours.values())


def test_the_trainer_takes_trl_s_constructor():
    from trl import GRPOTrainer as TrlTrainer

    theirs = list(inspect.signature(TrlTrainer.__init__).parameters)
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert sorted(ours) == sorted(theirs)
    assert ours[:4] == theirs[:4]  # model, reward_funcs, args, train_dataset: positional as in TRL


def test_the_docs_hold_the_generated_table():
    assert markdown_table() in DOC.read_text(), "regenerate: python -m grpolab.trl.fields (docs/coming-from-trl.md)"


# ---------------------------------------------------------------- TRL's parser

RECIPE = """\
output_dir: from-yaml
max_steps: 3
learning_rate: 1.0e-6
lr_scheduler_type: constant_with_warmup
warmup_steps: 1
bf16: false
use_cpu: true
num_generations: 4
per_device_train_batch_size: 4
max_completion_length: 64
reward_weights: [1.0, 0.5]
report_to: [tensorboard]
model_init_kwargs:
  dtype: float32
  revision: main
beta: 0.04
loss_type: dr_grpo
scale_rewards: batch
save_strategy: "no"
logging_steps: 2
log_completions: true
"""
FLAGS = [
    "--output_dir", "from-flags", "--max_steps", "2", "--bf16", "false", "--fp16", "False", "--use_cpu", "--report_to", "tensorboard",
    "--generation_batch_size", "8", "--num_generations", "4", "--per_device_train_batch_size", "4",
    "--debug", "underflow_overflow", "--pad_to_multiple_of", "8", "--include_num_input_tokens_seen", "true",
    "--temperature", "0.7", "--epsilon_high", "0.28", "--mask_truncated_completions", "--disable_tqdm", "true",
    "--max_completion_length", "32", "--lr_scheduler_type", "linear", "--save_strategy", "steps", "--save_steps", "2",
    "--model_init_kwargs", '{"dtype": "bfloat16", "attn_implementation": "sdpa"}', "--reward_weights", "1", "2",
]  # fmt: skip


def _parsed(config_class, args: list[str]):
    from trl import TrlParser

    (config,) = TrlParser((config_class,)).parse_args_and_config(args)
    return config


def _unequal(theirs, ours) -> dict:
    return {
        f.name: (getattr(theirs, f.name), getattr(ours, f.name))
        for f in dataclasses.fields(theirs)
        if getattr(theirs, f.name) != getattr(ours, f.name)
    }


@pytest.mark.parametrize("how", ["flags", "recipe", "recipe and flags"])
def test_trl_s_parser_reads_flags_and_recipes_into_the_values_trl_s_config_gets(tmp_path, how):
    """TrlParser (transformers' HfArgumentParser beneath) reads a command line, a --config YAML recipe, or both, into
    grpolab's GRPOConfig as into TRL's: booleans, lists, dicts as JSON or YAML, optionals, enums; every field equal."""
    from trl import GRPOConfig as TrlConfig

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    args = {
        "flags": FLAGS,
        "recipe": ["--config", str(recipe)],
        "recipe and flags": ["--config", str(recipe), "--max_steps", "5", "--beta", "0.0", "--report_to", "none"],
    }[how]
    theirs, ours = _parsed(TrlConfig, args), _parsed(GRPOConfig, args)
    assert _unequal(theirs, ours) == {}
    asked = {  # what was asked arrived (two parsers that both dropped it would agree too)
        "flags": dict(output_dir="from-flags", bf16=False, generation_batch_size=8, pad_to_multiple_of=8,
                      model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"}, reward_weights=[1.0, 2.0],
                      include_num_input_tokens_seen="all", mask_truncated_completions=True, disable_tqdm=True),
        "recipe": dict(output_dir="from-yaml", max_steps=3, loss_type="dr_grpo", report_to=["tensorboard"],
                       model_init_kwargs={"dtype": "float32", "revision": "main"}, save_strategy="no", beta=0.04),
        "recipe and flags": dict(output_dir="from-yaml", max_steps=5, beta=0.0, report_to=[], scale_rewards="batch"),
    }[how]  # fmt: skip
    assert {k: getattr(ours, k) for k in asked} == asked
    assert translate(ours).options["steps"] >= 1  # and it translates


def test_the_parser_s_help_says_what_grpolab_does_with_each_field_and_its_errors_are_trl_s(tmp_path, capsys):
    from trl import GRPOConfig as TrlConfig
    from trl import TrlParser

    with pytest.raises(SystemExit):
        TrlParser((GRPOConfig,)).parse_args_and_config(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "--learning_rate LEARNING_RATE, --learning-rate LEARNING_RATE grpolab: lr" in said
    assert "--adam_beta1 ADAM_BETA1, --adam-beta1 ADAM_BETA1 refused by grpolab unless left at TRL's default" in said
    with pytest.raises(ValueError, match=r"^GRPOConfig.adam_beta1=0.8: [^\n]*$"):  # one line, through the parser
        _parsed(GRPOConfig, ["--adam_beta1", "0.8"])
    assert "--top_k TOP_K, --top-k TOP_K grpolab: top_k" in said
    assert translate(_parsed(GRPOConfig, ["--top_k", "5", "--max_steps", "2"])).options["top_k"] == 5
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: 2\nuse_cpu: true\nno_such_field: 1\n")
    errors = []
    for config_class in (TrlConfig, GRPOConfig):  # a key TRL does not have: TRL's own error, word for word
        with pytest.raises(Exception) as e:
            _parsed(config_class, ["--config", str(recipe)])
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1] and "no_such_field" in errors[0][1]


# ---------------------------------------------------------------- bad input


def test_to_dict_to_json_string_and_replace_are_trl_s():
    """transformers' serialisation (enums as values, tokens hidden, the accelerator config as a dict) and
    dataclasses.replace give what they give on TRL's config; replace of a config whose __post_init__ filled both
    generation_batch_size and steps_per_generation is TRL's own ValueError under both."""
    from trl import GRPOConfig as TrlConfig

    kw = dict(output_dir="o", use_cpu=True, bf16=False, report_to="none", max_steps=3, lr_scheduler_type="cosine",
              model_init_kwargs='{"dtype": "auto"}', reward_weights=[1.0, 0.5], hub_token="secret",
              loss_type="dr_grpo", beta=0.04)  # fmt: skip
    theirs, ours = TrlConfig(**kw), GRPOConfig(**kw)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.to_dict()["lr_scheduler_type"] == "cosine" and ours.to_dict()["hub_token"] == "<HUB_TOKEN>"
    assert json.loads(ours.to_json_string()) == json.loads(theirs.to_json_string())
    change = dict(max_steps=7, generation_batch_size=None, steps_per_generation=None, beta=0.0)
    replaced = dataclasses.replace(ours, **change)
    assert type(replaced) is GRPOConfig and replaced.to_dict() == dataclasses.replace(theirs, **change).to_dict()
    for config in (theirs, ours):
        with pytest.raises(ValueError, match="generation_batch_size"):
            dataclasses.replace(config, max_steps=7)


def test_an_unknown_field_is_a_type_error_as_in_trl():
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        GRPOConfig(no_such_field=1)


@pytest.mark.parametrize("name", [f.name for f in FIELDS if f.kind == "refused"])
def test_a_refused_field_set_is_one_line_naming_it(name):
    value = {bool: lambda d: not d, int: lambda d: d + 1, float: lambda d: d * 0.5 + 0.01}.get(
        type(BY_NAME[name].default), lambda d: "x"
    )(BY_NAME[name].default)
    with pytest.raises(ValueError) as e:
        GRPOConfig(**{name: value})
    message = str(e.value)
    assert message.startswith(f"GRPOConfig.{name}=") and "\n" not in message


@pytest.mark.hardware
@EACH_CPU
def test_an_inert_field_set_is_said_once(machine_kind, units):
    machine_kind(bf16=units)  # TRL's default bf16=True is said on a CPU that trains it in fp32
    plan = translate(GRPOConfig(dataloader_num_workers=4, hub_strategy="end", max_steps=2), train_rows=8)
    said = [line for line in plan.notes if "dataloader_num_workers=4" in line]
    assert len(said) == 1 and "no effect" in said[0]
    notes = translate(GRPOConfig(max_steps=2), train_rows=8).notes
    assert notes == [] if units else len(notes) == 1 and notes[0].startswith("bf16=True: cpu computes no bf16 here")


# ---------------------------------------------------------------- the translation

# A value other than TRL's default for each mapped field, where the type's rule does not give one, and the fields
# that act only beside another one.
SAMPLE = {
    "output_dir": "elsewhere",
    "lr_scheduler_type": "cosine",
    "optim": "adamw_torch",
    "bf16": False,
    "fp16": True,
    "logging_strategy": "no",
    "report_to": "tensorboard",
    "eval_strategy": "steps",
    "eval_steps": 3,
    "save_strategy": "no",
    "save_total_limit": 2,
    "fsdp": "full_shard",
    "model_init_kwargs": {"dtype": "bfloat16"},
    "num_generations_eval": 4,
    "shuffle_dataset": False,
    "generation_batch_size": 16,
    "steps_per_generation": 2,
    "delta": 1.5,
    "epsilon_high": 0.28,
    "importance_sampling_level": "sequence",
    "reward_weights": [1.0, 0.5],
    "multi_objective_aggregation": "normalize_then_sum",
    "scale_rewards": "batch",
    "loss_type": "grpo",
    "off_policy_mask_threshold": 0.5,
    "max_tool_calling_iterations": 3,
    "vllm_importance_sampling_mode": "token_truncate",
    "vllm_max_model_length": 1024,
    "vllm_importance_sampling_cap": 2.0,
    "min_p": 0.05,
    "generation_kwargs": {"repetition_penalty": 1.1},
    "num_train_epochs": 1.0,
    "max_steps": 20,
    "gradient_accumulation_steps": 2,
    "warmup_steps": 3,
    "logging_steps": 2,
    "save_steps": 4,
    "per_device_train_batch_size": 16,
    "num_generations": 2,
    "disable_tqdm": True,
}
BESIDE = {  # fields read only with another set
    "vllm_gpu_memory_utilization": {"use_vllm": True},
    "vllm_enable_sleep_mode": {"use_vllm": True},
    "vllm_max_model_length": {"use_vllm": True},
    "vllm_importance_sampling_correction": {"use_vllm": True},
    "vllm_importance_sampling_mode": {"use_vllm": True},
    "vllm_importance_sampling_clip_max": {"use_vllm": True},
    "vllm_importance_sampling_cap": {"use_vllm": True},
    "eval_steps": {"eval_strategy": "steps"},
    "num_train_epochs": {"max_steps": -1},
}
TRAINER_ONLY = {"push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_revision", "logging_first_step",
                "tf32", "optim", "per_device_eval_batch_size"}  # fmt: skip
"""Mapped fields whose effect is the trainer's (tested below; per_device_eval_batch_size: its evaluations', in
tests/trl/test_trl_evaluate.py), or whose values taken all mean one thing (optim: adamw_torch and adamw_torch_fused are torch's AdamW; others are refused)."""


def _sample(name: str):
    if name in SAMPLE:
        return SAMPLE[name]
    default = BY_NAME[name].default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 0.5 + 0.01
    raise AssertionError(f"give SAMPLE[{name!r}]")


@pytest.mark.parametrize("name", [f.name for f in FIELDS if f.kind == "mapped" and f.name not in TRAINER_ONLY])
def test_each_mapped_field_changes_the_options(name):
    """Not silently ignored: setting the field (away from TRL's default) changes grpolab's options."""
    base = {"max_steps": 4, "per_device_train_batch_size": 8, "num_generations": 4, "eval_strategy": "no"}
    extra = BESIDE.get(name, {})
    before = translate(GRPOConfig(**base | extra), train_rows=64, has_eval=True)
    after = translate(GRPOConfig(**base | extra | {name: _sample(name)}), train_rows=64, has_eval=True)
    # bf16=False on a CPU without bf16 units (this file's machine): the same fp32 run, without the line saying so
    changed = after.options != before.options or after.notes != before.notes
    assert changed, f"{name}={_sample(name)!r} changed nothing"


def test_trl_s_geometry_prompts_steps_and_epochs():
    # prompts per generation = per_device x accumulation x processes / num_generations
    args = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=8, max_steps=12,
                      num_iterations=3)  # fmt: skip
    o = translate(args, world_size=2, train_rows=100).options
    assert (o["prompts_per_step"], o["group_size"], o["mu"], o["steps"], o["micro_batch"]) == (4, 8, 3, 4, 8)
    # epochs: whole generations of the rows (TRL's sampler drops the last incomplete one), rounded up
    o = translate(GRPOConfig(num_generations=4, num_train_epochs=1.5), train_rows=10).options
    assert (o["prompts_per_step"], o["steps"], o["data_order"]) == (2, 8, "shuffle")
    with pytest.raises(ValueError, match="GRPOConfig.optim='sgd'"):
        translate(GRPOConfig(optim="sgd", max_steps=1), train_rows=10)
    # steps_per_generation beyond the accumulation: that many optimizer steps on parts of one generation
    o = translate(GRPOConfig(steps_per_generation=4, max_steps=8, num_generations=8), train_rows=64).options
    assert (o["prompts_per_step"], o["minibatches"], o["steps"], o["micro_batch"]) == (4, 4, 2, 8)
    assert translate(GRPOConfig(generation_batch_size=32, max_steps=8), train_rows=64).options["minibatches"] == 4
    with pytest.raises(ValueError, match="steps_per_generation"):
        translate(GRPOConfig(steps_per_generation=3, gradient_accumulation_steps=2, max_steps=4), train_rows=10)
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(num_generations=3)


def test_model_init_kwargs_as_trl_s_model_config_fills_them():
    """TRL's scripts pass every ModelConfig key (revision "main", trust_remote_code False, attn_implementation, dtype
    "auto" or None, device_map, low_cpu_mem_usage): accepted, as none changes what is trained; dtype "auto" is the
    checkpoint's own; a key that would change training and that grpolab does not do is one line."""
    filled = {"revision": "main", "trust_remote_code": False, "attn_implementation": None, "dtype": "auto",
              "device_map": "auto", "low_cpu_mem_usage": True}  # fmt: skip
    args = GRPOConfig(output_dir="o", max_steps=2, bf16=False, model_init_kwargs=filled)
    assert translate(args, checkpoint_dtype="float32").options["precision"] == "32-true"
    assert "revision" not in translate(args).options  # the default branch
    bf16 = translate(args, checkpoint_dtype="bfloat16").options  # "auto": the checkpoint's bf16 weights, as TRL loads
    assert (bf16["precision"], bf16["compensation"]) == ("bf16-true", "none")
    none = GRPOConfig(output_dir="o", max_steps=2, bf16=False, model_init_kwargs={**filled, "dtype": None})
    assert translate(none, checkpoint_dtype="bfloat16").options["precision"] == "bf16-true"
    assert (
        translate(GRPOConfig(output_dir="o", max_steps=2, model_init_kwargs={"revision": "v2"})).options["revision"]
        == "v2"
    )
    for refused, said in [({"trust_remote_code": True}, "runs no code"), ({"load_in_8bit": True}, "grpolab takes")]:
        with pytest.raises(ValueError, match=r"^GRPOConfig.model_init_kwargs=[^\n]*" + said):
            translate(GRPOConfig(output_dir="o", max_steps=2, model_init_kwargs=refused))


def test_a_model_s_own_dtype_is_its_config_s(tmp_path):
    from grpolab.models.policy import checkpoint_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_dtype(str(tmp_path)) is None


def test_trl_s_objective_names():
    o = translate(GRPOConfig(max_steps=1), train_rows=8).options
    assert (o["aggregation"], o["loss_type"], o["estimator"], o["scale_rewards"]) == (
        "token-mean", "clip", "grpo_std", "group")  # fmt: skip
    assert o["lr"] == 1e-6 and o["lr_schedule"] == "linear" and o["warmup_steps"] == 0 and o["beta"] == 0.0
    o = translate(GRPOConfig(max_steps=1, loss_type="cispo", epsilon_high=4.0, scale_rewards=False), 1, 8).options
    assert (o["loss_type"], o["cispo_cap"], o["estimator"]) == ("cispo", 4.0, "grpo")
    o = translate(GRPOConfig(max_steps=10, warmup_steps=0.25, max_completion_length=32), 1, 8).options
    assert o["warmup_steps"] == 3 and o["max_new_tokens"] == 32  # a fraction of the optimizer steps, rounded up


@pytest.mark.hardware
def test_precision_bf16_on_a_device_without_bf16_says_what_it_runs(machine_kind):
    machine_kind(bf16=False)
    plan = translate(GRPOConfig(max_steps=1), 1, 8, device="cpu")
    assert plan.options["precision"] == "32-true"  # as auto: fp32 where the CPU has no bf16 units
    assert [n for n in plan.notes if n.startswith("bf16=True")] and len(plan.notes) == 1
    machine_kind(bf16=True)
    plan = translate(GRPOConfig(max_steps=1), 1, 8, device="cpu")
    assert plan.options["precision"] == "bf16-mixed" and not plan.notes


# ---------------------------------------------------------------- the trainer on the built-in model


def _rows(n: int = 24):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(n // 4) for b in range(4)])


def ends_right(completions, answer, **kwargs):
    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [float(len(c) < 24) for c in completions]


def _args(tmp_path, **kw):
    options = dict(output_dir=str(tmp_path / "run"), max_steps=4, num_generations=4, per_device_train_batch_size=8,
                   max_completion_length=12, learning_rate=1e-4, logging_steps=2, save_steps=2, bf16=False,
                   report_to="none", disable_tqdm=True)  # fmt: skip
    return GRPOConfig(**options | kw)


class Recorder:
    def __init__(self):
        from transformers import TrainerCallback

        events = self.events = []

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                events.append(("begin", state.global_step, state.max_steps))

            def on_step_end(self, args, state, control, **kw):
                events.append(("step", state.global_step))

            def on_log(self, args, state, control, logs=None, **kw):
                events.append(("log", state.global_step, logs["reward"]))

            def on_save(self, args, state, control, **kw):
                events.append(("save", state.global_step))

            def on_train_end(self, args, state, control, **kw):
                events.append(("end", state.global_step))

        self.callback = _CB()


def test_train_log_history_callbacks_save_and_doctor(tmp_path, capsys):
    import grpolab

    rec = Recorder()
    trainer = GRPOTrainer(BUILTIN, [ends_right, short], _args(tmp_path, reward_weights=[1.0, 0.5]),
                          train_dataset=_rows(), callbacks=[rec.callback])  # fmt: skip
    out = trainer.train()
    assert out.global_step == 4 and set(out.metrics) >= {"train_runtime", "train_loss", "epoch"}
    logs = [e for e in trainer.state.log_history if "reward" in e]
    assert [e["step"] for e in logs] == [2, 4]
    for key in ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/ends_right/mean",
                "rewards/short/mean", "completions/mean_length", "entropy", "clip_ratio/region_mean",
                "frac_reward_zero_std", "reward/mean", "epoch"):  # fmt: skip
        assert key in logs[-1], key
    metrics = trainer.run.metrics  # the window's mean, by TRL's name, of grpolab's own per-step values
    assert logs[0]["reward"] == pytest.approx((metrics[1]["reward/mean"] + metrics[2]["reward/mean"]) / 2)
    kinds = [e[0] for e in rec.events]
    assert kinds == ["begin", "step", "step", "log", "save", "step", "step", "log", "save", "end"]
    assert rec.events[0] == ("begin", 0, 4)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["prompts_per_step"], config["group_size"], config["reward_weights"]) == (2, 4, [1.0, 0.5])
    assert config["eval_fraction"] == 0.0 and config["data_order"] == "shuffle" and config["seed"] == 42
    trainer.save_model(str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "generation_config.json").is_file()
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in trainer.model.parameters())
    assert isinstance(grpolab.diagnose(tmp_path / "run"), list)  # the doctor reads the run
    # what TRL's scripts call after train(): transformers' metric and state files, the accelerator, a model card
    from transformers import TrainerState

    capsys.readouterr()
    trainer.log_metrics("train", out.metrics)
    assert "***** train metrics *****" in capsys.readouterr().out
    trainer.save_metrics("train", out.metrics)
    trainer.save_state()
    run = tmp_path / "run"
    assert json.loads((run / "train_results.json").read_text()) == json.loads(json.dumps(out.metrics))
    assert json.loads((run / "all_results.json").read_text()) == json.loads(json.dumps(out.metrics))
    state = TrainerState.load_from_json(str(run / "trainer_state.json"))
    assert state.global_step == 4 and state.log_history == json.loads(json.dumps(trainer.state.log_history))
    accelerator = trainer.accelerator
    assert (accelerator.is_main_process, accelerator.process_index, accelerator.num_processes) == (True, 0, 1)
    assert accelerator.unwrap_model(trainer.model) is trainer.model and accelerator.device.type == "cpu"
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    accelerator.print("Training completed.")
    accelerator.wait_for_everyone()
    assert capsys.readouterr().out == "Training completed.\n"
    trainer.create_model_card(dataset_name="arith-rows")
    card = (run / "README.md").read_text()
    assert card.startswith("---\nbase_model: ") and "arith-rows" in card and "optimizer steps: 4" in card
    trainer.end()


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    """A run stopped after 2 steps and resumed to 4 is the 4-step run (a constant schedule: a linear one's horizon is
    max_steps, which the two halves set differently)."""
    full = GRPOTrainer(
        BUILTIN, [ends_right], _args(tmp_path / "a", lr_scheduler_type="constant"), train_dataset=_rows()
    )
    full.train()
    half = GRPOTrainer(BUILTIN, [ends_right], _args(tmp_path / "b", max_steps=2, lr_scheduler_type="constant"),
                       train_dataset=_rows())  # fmt: skip
    half.train()
    half.save_model()  # into output_dir, as TRL's scripts do: the model's config.json where the run's options were
    run = tmp_path / "b" / "run"
    assert "model_type" in json.loads((run / "config.json").read_text())
    assert json.loads((run / "grpolab.json").read_text())["steps"] == 2  # the run's options, read by the resume
    rest = GRPOTrainer(
        BUILTIN, [ends_right], _args(tmp_path / "b", lr_scheduler_type="constant"), train_dataset=_rows()
    )
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(tmp_path / "b" / "run"))  # where a TRL script looks: checkpoint-N, N optimizer steps
    assert Path(last).name == f"checkpoint-{half.state.global_step}" and (Path(last) / "model.safetensors").is_file()
    rest.train(resume_from_checkpoint=last)
    a = [m["reward/mean"] for m in full.run.metrics if "reward/mean" in m]
    b = [m["reward/mean"] for m in rest.run.metrics if "reward/mean" in m]
    assert a == b and len(a) == 4
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        rest.train(resume_from_checkpoint=str(tmp_path / "elsewhere"))


def test_a_reward_function_of_the_wrong_length_is_one_line_naming_it(tmp_path):
    def miscounted(completions, **kwargs):
        return [0.0] * (len(completions) + 1)

    trainer = GRPOTrainer(BUILTIN, [miscounted], _args(tmp_path, max_steps=1), train_dataset=_rows())
    with pytest.raises(ValueError) as e:
        trainer.train()
    assert str(e.value) == "reward function miscounted returned 9 rewards for 8 completions"


def test_evaluate_and_push_to_hub_offline(tmp_path, monkeypatch):
    trainer = GRPOTrainer(BUILTIN, [ends_right], _args(tmp_path, max_steps=1), train_dataset=_rows(),
                          eval_dataset=_rows(8))  # fmt: skip
    before = trainer.evaluate()
    assert 0.0 <= before["eval_reward"] <= 1.0 and "eval_loss" in before  # TRL's keys (tests/trl/test_trl_evaluate.py)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError) as e:
        trainer.push_to_hub()
    assert str(e.value).startswith("push_to_hub: the Hub cannot be reached") and "\n" not in str(e.value)


def test_refused_constructor_arguments(tmp_path):
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizers"):
        GRPOTrainer(BUILTIN, [short], _args(tmp_path), optimizers=(torch.optim.SGD(model.parameters(), 0.1), None))
    with pytest.raises(ValueError, match="rollout_func"):
        GRPOTrainer(BUILTIN, [short], _args(tmp_path), rollout_func=lambda *a: None)


def test_a_reward_function_of_trl_s_keywords_only_is_trl_s_form():
    """TRL calls reward functions by keyword: ``fn(environments, **kwargs)`` is one (an environment's reward)."""
    from grpolab.rewards.forms import reward_form

    def from_environments(environments, **kwargs):
        return [e.reward for e in environments]

    assert reward_form(from_environments) == "trl"


def test_steps_per_generation_takes_that_many_optimizer_steps_on_a_generation(tmp_path):
    """steps_per_generation=2 with no accumulation: each generation of 2 x 8 completions feeds 2 optimizer steps, so 4
    of TRL's steps are 2 grpolab steps, and the schedule runs over the 4."""
    trainer = GRPOTrainer(BUILTIN, [ends_right], _args(tmp_path, steps_per_generation=2, lr_scheduler_type="linear"),
                          train_dataset=_rows())  # fmt: skip
    out = trainer.train()
    assert out.global_step == 4 and len([m for m in trainer.run.metrics if "reward/mean" in m]) == 2
    config = trainer.run.config
    assert (config["prompts_per_step"], config["minibatches"], config["steps"]) == (4, 2, 2)
    lrs = [m["charts/lr"] for m in trainer.run.metrics if "charts/lr" in m]
    assert lrs == pytest.approx([1e-4 * 2 / 4, 0.0])  # linear to 0 over 4 optimizer steps, read after each generation


def test_top_k_min_p_and_the_repetition_penalty_map_onto_grpolab_s_and_train(tmp_path):
    """TRL's sampling fields (generation_kwargs' keys of their names over them, as TRL; None, -1: off) become grpolab's
    options; a run with them trains 2 steps on the built-in model, its fp32 sampler replayed exactly by the update
    (engine/logratio_mean ~ 0: the offset of the sampling distribution put back); another generation_kwargs key is
    refused in one line."""
    rules = dict(top_k=20, min_p=0.05, repetition_penalty=1.1)
    o = translate(GRPOConfig(max_steps=1, **rules, generation_kwargs={"top_k": 5}), train_rows=8).options
    assert (o["top_k"], o["min_p"], o["repetition_penalty"]) == (5, 0.05, 1.1)
    o = translate(GRPOConfig(max_steps=1, top_k=-1, generation_kwargs={"min_p": None}), train_rows=8).options
    assert (o["top_k"], o["min_p"], o["repetition_penalty"]) == (0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"^GRPOConfig.generation_kwargs=\{'num_beams': 2\}: [^\n]*$"):
        GRPOConfig(generation_kwargs={"top_k": 5, "num_beams": 2})
    trainer = GRPOTrainer(BUILTIN, [ends_right], _args(tmp_path, max_steps=2, **rules), train_dataset=_rows())
    assert trainer.train().global_step == 2
    assert {k: trainer.run.config[k] for k in rules} == rules
    steps = [m for m in trainer.run.metrics if "loss/total" in m]
    assert len(steps) == 2 and all(math.isfinite(m["loss/total"]) for m in steps)
    assert all(abs(m["engine/logratio_mean"]) < 1e-5 for m in steps)


def test_a_model_object_with_its_tokenizer_as_processing_class_after_set_seed(tmp_path):
    """What R1-style scripts do: transformers.set_seed, then a model object and its tokenizer passed in. The object
    is the one trained (in place), and the run is args.seed's whatever the global seed was (grpolab seeds its own
    streams from it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    seen = []  # each run's losses, then its trained weights
    for global_seed in (0, 1234):
        set_seed(global_seed)
        model = AutoModelForCausalLM.from_pretrained(BUILTIN)
        before = [p.detach().clone() for p in model.parameters()]
        trainer = GRPOTrainer(model, [ends_right], _args(tmp_path / str(global_seed), max_steps=2),
                              train_dataset=_rows(), processing_class=AutoTokenizer.from_pretrained(BUILTIN))  # fmt: skip
        trainer.train()
        assert trainer.model is model
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # trained in place
        seen.append([m["loss/total"] for m in trainer.run.metrics if "loss/total" in m])
        seen.append([p.detach().clone() for p in model.parameters()])
    assert seen[0] == seen[2] and len(seen[0]) == 2 and any(seen[0])  # the same losses, not all 0
    assert all(torch.equal(a, b) for a, b in zip(seen[1], seen[3]))  # the same trained weights
