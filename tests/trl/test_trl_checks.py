"""grpolab.trl's GRPOTrainer against TRL 1.16's own on the same arguments: the checks TRL makes at construction (the
same exception type, a message saying the same), TRL's warnings through ``logging``, and the public surface user code
reads (reward names, weights and tokenizers, the inferred tokenizer, ``accelerator``, the static helpers)."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from helpers.models import tiny_reward_model
from helpers.paths import REPO

from grpolab.trl import GRPOConfig, GRPOTrainer

BUILTIN = str(REPO / "grpolab" / "assets" / "arith-sft")
CONFIG = dict(use_cpu=True, report_to="none", num_generations=2, per_device_train_batch_size=2,
              max_completion_length=8, bf16=False)  # fmt: skip


def constant(completions, **kwargs):
    return [0.5] * len(completions)


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def declines(completions, **kwargs):
    """None ("does not apply") for the first completion, 1 for the rest."""
    return [None] + [1.0] * (len(completions) - 1)


class Counter:
    """TRL's environment shape, paying its own reward."""

    def reset(self, **row) -> str | None:
        self.n = 0
        return None

    def get_reward(self) -> float:
        return float(self.n)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: what to add.
        """
        self.n += step
        return self.n


class Unpaid:
    """TRL's shape with no reward of its own."""

    def reset(self, **row) -> str | None:
        return None

    def increment(self, step: int) -> int:
        """Add nothing.

        Args:
            step: ignored.
        """
        return step


class NoReset:
    def get_reward(self) -> float:
        return 0.0

    def increment(self, step: int) -> int:
        """Add nothing.

        Args:
            step: ignored.
        """
        return step


@pytest.fixture(scope="module")
def parts():
    """The built-in model and its tokenizer with a chat template TRL can parse tool calls from (TRL checks it as soon
    as an environment is given)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    tok = AutoTokenizer.from_pretrained(BUILTIN)
    tok.chat_template = qwen3_chat_template
    return AutoModelForCausalLM.from_pretrained(BUILTIN), tok


def _rows(n: int = 4, **columns):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"{i}+1", **columns} for i in range(n)])


def _construct(trainer_cls, config_cls, tmp_path, parts, config: dict, kw: dict):
    model, tok = parts
    args = config_cls(output_dir=str(tmp_path / trainer_cls.__module__), **CONFIG | config)
    return trainer_cls(model=model, args=args, processing_class=copy.deepcopy(tok), **kw)


def _trl(tmp_path, parts, config=None, **kw):
    import trl

    return _construct(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, parts, config or {}, kw)


def _ours(tmp_path, parts, config=None, **kw):
    return _construct(GRPOTrainer, GRPOConfig, tmp_path, parts, config or {}, kw)


def _raised(build, *args, **kw) -> BaseException | None:
    try:
        build(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the test compares whatever each raises
        return e
    return None


# ---------------------------------------------------------------- TRL's checks at construction

# name -> (GRPOConfig fields, trainer keywords, key words of TRL's message that grpolab's must hold too)
CHECKS = {
    "no_reward_source": ({}, dict(reward_funcs=None, train_dataset=_rows()),
                         ["no reward source", "reward_funcs", "environment_factory", "get_reward"]),
    "no_reward_source_env_without_get_reward": (
        {}, dict(environment_factory=Unpaid, train_dataset=_rows()),
        ["no reward source", "reward_funcs", "environment_factory", "get_reward"]),
    "no_dataset_no_environment": ({}, dict(reward_funcs=constant),
                                  ["train_dataset", "required", "environment_factory"]),
    "environment_owns_data_without_max_steps": (
        {}, dict(environment_factory=Counter),
        ["training without a", "train_dataset", "reset()", "max_steps", "positive", "GRPOConfig(max_steps=...)"]),
    "several_environments_without_dataset": (
        {"max_steps": 2}, dict(environment_factory={"a": Counter, "b": Counter}),
        ["dict", "environment_factory", "multiple environments", "train_dataset", "environment", "column",
         "single environment factory"]),
    "reward_processing_classes_of_another_length": (
        {}, dict(reward_funcs=constant, train_dataset=_rows(), reward_processing_classes=[None, None]),
        ["number of reward processing classes (2)", "must match", "number of reward functions (1)"]),
    "reward_weights_of_another_length": (
        {"reward_weights": [1.0, 2.0]}, dict(reward_funcs=constant, train_dataset=_rows()),
        ["number of reward weights (2)", "must match", "number of reward functions (1)"]),
    "environment_without_reset": ({}, dict(environment_factory=NoReset, train_dataset=_rows()),
                                  ["environment", "environment_factory", "must define", "callable", "reset"]),
    "peft_config_not_a_peft_config": ({}, dict(reward_funcs=constant, train_dataset=_rows(), peft_config={"r": 8}),
                                      ["peft_config", "peft.PeftConfig", "peft.LoraConfig", "got dict"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CHECKS))
def test_trl_s_construction_check_raises_trl_s_exception_saying_the_same(tmp_path, parts, name):
    config, kw, words = CHECKS[name]
    theirs = _raised(_trl, tmp_path, parts, config, **kw)
    ours = _raised(_ours, tmp_path, parts, config, **kw)
    assert theirs is not None, "TRL constructs: the case no longer tests a check"
    assert type(ours) is type(theirs) or isinstance(ours, type(theirs)), (type(ours), ours)
    for word in words:
        assert word.lower() in str(theirs).lower(), (word, str(theirs))  # the key words are TRL's
        assert word.lower() in str(ours).lower(), (word, str(ours))


def test_a_row_naming_no_environment_is_trl_s_error_at_construction(tmp_path, parts):
    """TRL raises it at the batch that holds the row; grpolab at construction, the data being in memory."""
    rows = _rows(environment="c")
    kw = dict(environment_factory={"a": Counter, "b": Counter}, train_dataset=rows)
    trainer = _trl(tmp_path, parts, **kw)
    with pytest.raises(ValueError) as theirs:
        trainer._generate_and_score_completions(list(rows))
    with pytest.raises(ValueError) as ours:
        _ours(tmp_path, parts, **kw)
    for word in ["environment='c'", "not among the environments passed to", "environment_factory",
                 "expected one of", "['a', 'b']"]:  # fmt: skip
        assert word.lower() in str(theirs.value).lower() and word.lower() in str(ours.value).lower(), word


def test_what_trl_constructs_on_grpolab_constructs_too(tmp_path, parts):
    """The checks' other sides: an environment that owns the data and its reward, with max_steps; one routed by a
    dataset's environment column; a reward function and data."""
    cases = [
        ({"max_steps": 2}, dict(environment_factory=Counter)),
        ({}, dict(environment_factory={"a": Counter, "b": Unpaid}, train_dataset=_rows(environment="a"))),
        ({"reward_weights": [2.0]}, dict(reward_funcs=constant, train_dataset=_rows(), reward_processing_classes=None)),
    ]  # fmt: skip
    for config, kw in cases:
        _trl(tmp_path, parts, config, **kw)
        _ours(tmp_path, parts, config, **kw)


def test_trust_remote_code_is_no_error_in_trl_and_a_refusal_in_grpolab(tmp_path, parts):
    """TRL passes trust_remote_code to from_pretrained and refuses it nowhere; grpolab runs no code from a model's
    files and refuses it, in one line naming the field: GRPOConfig's field as the config is made, model_init_kwargs'
    where the config is translated (train())."""
    from grpolab.trl.config import translate

    kw = dict(reward_funcs=constant, train_dataset=_rows())
    _trl(tmp_path, parts, {"trust_remote_code": True}, **kw)
    with pytest.raises(ValueError, match="trust_remote_code"):
        _ours(tmp_path, parts, {"trust_remote_code": True}, **kw)
    _trl(tmp_path, parts, {"model_init_kwargs": {"trust_remote_code": True}}, **kw)
    trainer = _ours(tmp_path, parts, {"model_init_kwargs": {"trust_remote_code": True}}, **kw)
    with pytest.raises(ValueError, match="trust_remote_code"):
        translate(trainer.args, 1, 4)


# ---------------------------------------------------------------- TRL's warnings, through logging


@pytest.mark.parametrize(
    "config, words",
    [
        ({"importance_sampling_level": "sequence", "loss_type": "dapo"},
         ["importance_sampling_level='sequence'", "'dapo'", "sums per-token", "completion length", "loss_type='grpo'"]),
        ({"importance_sampling_level": "sequence", "loss_type": "dr_grpo"}, ["'dr_grpo'", "sums per-token"]),
        ({"loss_type": "luspo"}, ["luspo", "importance_sampling_level", "'sequence'", "paper"]),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"},
         ["vespo", "importance_sampling_level", "'token'"]),
    ],
)  # fmt: skip
def test_trl_s_objective_warnings_go_through_logging(tmp_path, parts, caplog, config, words):
    kw = dict(reward_funcs=constant, train_dataset=_rows())
    found = {}
    for side, build in (("trl", _trl), ("grpolab", _ours)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build(tmp_path, parts, config, **kw)
        said = [r.getMessage() for r in caplog.records if r.name.startswith(side) and r.levelno == logging.WARNING]
        found[side] = [m for m in said if all(w.lower() in m.lower() for w in words)]
    assert found["trl"] and found["grpolab"], found


def test_no_objective_warning_where_trl_gives_none(tmp_path, parts, caplog):
    with caplog.at_level(logging.WARNING):
        _ours(tmp_path, parts, {"importance_sampling_level": "sequence", "loss_type": "grpo"}, reward_funcs=constant,
              train_dataset=_rows())  # fmt: skip
    assert not [r for r in caplog.records if r.name.startswith("grpolab")]


def test_all_rewards_none_for_a_row_is_trl_s_warning_through_logging(tmp_path, parts, caplog):
    """TRL warns when it scores a batch (``_calculate_rewards``); grpolab where it scores (the rewarder), naming the
    row's columns, its prompt and its completion."""
    from grpolab.rewards.forms import from_trl
    from grpolab.rewards.rewarder import score

    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}]
    completions = ["2", "5"]
    trainer = _trl(tmp_path, parts, reward_funcs=[declines, declines], train_dataset=_rows())
    with caplog.at_level(logging.WARNING):
        trainer._calculate_rewards(rows, [r["prompt"] for r in rows], completions, [[1], [2]])
        theirs = [r.getMessage() for r in caplog.records if r.name.startswith("trl")]
        caplog.clear()
        fns = [(name, from_trl(declines, lambda r: r["prompt"], False), 1.0) for name in "ab"]
        got = score(completions, rows, fns)
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("grpolab")]
    assert got.unscorable.tolist() == [True, False]
    for word in ["all reward functions returned none", "'answer': '2'", "'prompt': '1+1'", "'completion': '2'",
                 "at least one reward function returns a valid reward"]:  # fmt: skip
        assert any(word in m.lower() for m in theirs) and any(word in m.lower() for m in ours), (word, theirs, ours)


# ---------------------------------------------------------------- the public surface


def test_reward_names_weights_and_tokenizers_are_trl_s(tmp_path, parts):
    from transformers import AutoModelForSequenceClassification

    tiny_reward_model(tmp_path / "judge")
    judge = AutoModelForSequenceClassification.from_pretrained(tmp_path / "judge")
    funcs = [constant, functools.partial(length), judge]
    kw = dict(reward_funcs=funcs, train_dataset=_rows())
    config = {"reward_weights": [1.0, 0.5, 2.0]}
    theirs, ours = _trl(tmp_path, parts, config, **kw), _ours(tmp_path, parts, config, **kw)
    assert ours.reward_func_names == theirs.reward_func_names == ["constant", "length", "judge"]
    assert torch.equal(ours.reward_weights, theirs.reward_weights)
    assert ours.reward_weights.dtype == torch.float32
    assert ours.reward_funcs[2] is judge and len(ours.reward_funcs) == 3
    assert ours.reward_processing_classes[:2] == [None, None]
    assert ours.reward_processing_classes[2].get_vocab() == theirs.reward_processing_classes[2].get_vocab()
    one = _ours(tmp_path, parts, reward_funcs=constant, train_dataset=_rows())  # one function, no weights
    assert torch.equal(one.reward_weights, torch.ones(1)) and one.reward_processing_classes == [None]
    tok = parts[1]
    wrapped = _ours(tmp_path, parts, reward_funcs=judge, train_dataset=_rows(), reward_processing_classes=tok)
    assert wrapped.reward_processing_classes == [tok]  # one tokenizer: a list of it, as TRL makes it


def test_a_model_object_without_its_tokenizer_gets_the_one_trl_loads(tmp_path, parts):
    import trl
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BUILTIN)
    args = dict(reward_funcs=constant, train_dataset=_rows())
    theirs = trl.GRPOTrainer(model, args=trl.GRPOConfig(output_dir=str(tmp_path / "t"), **CONFIG), **args)
    ours = GRPOTrainer(model, args=GRPOConfig(output_dir=str(tmp_path / "o"), **CONFIG), **args)
    assert type(ours.processing_class) is type(theirs.processing_class)
    assert ours.processing_class.get_vocab() == theirs.processing_class.get_vocab()
    assert ours.processing_class.padding_side == theirs.processing_class.padding_side == "left"
    assert ours.processing_class.truncation_side == theirs.processing_class.truncation_side == "left"


def test_a_tokenizer_for_a_reward_model_named_by_path_is_the_one_it_scores_with(tmp_path, parts):
    """TRL loads a reward model named by a path or id and scores with the tokenizer given beside it; so does
    grpolab's loader, through the Python API that the drop-in's train() calls."""
    from grpolab.commands.api import reward_models_apart
    from grpolab.commands.objects import ObjectNames
    from grpolab.config.train import TrainConfig
    from grpolab.rewards.model import RewardModelSettings, load_reward_model

    tiny_reward_model(tmp_path / "judge")
    tok = copy.deepcopy(parts[1])
    kw = dict(reward_funcs=[str(tmp_path / "judge")], train_dataset=_rows(), reward_processing_classes=[tok])
    assert _trl(tmp_path, parts, **kw).reward_processing_classes[0] is tok
    assert _ours(tmp_path, parts, **kw).reward_processing_classes[0] is tok
    apart = reward_models_apart(TrainConfig, {"reward_funcs": kw["reward_funcs"], "reward_processing_classes": [tok]})
    names = ObjectNames(TrainConfig)
    spec = names.reward_model_spec(apart["reward_model"][0])
    model = load_reward_model(spec, RewardModelSettings(), lambda r: r["prompt"], False, names.given())
    assert model.tokenizer is tok


def test_accelerator_is_settable_and_trl_s_by_default(tmp_path, parts):
    from grpolab.trl.accelerator import Accelerator

    trainer = _ours(tmp_path, parts, reward_funcs=constant, train_dataset=_rows())
    assert isinstance(trainer.accelerator, Accelerator) and trainer.accelerator.is_main_process
    other = object()
    trainer.accelerator = other
    assert trainer.accelerator is other


def test_the_static_helpers_return_what_trl_s_return(tmp_path, parts):
    import trl

    g = torch.Generator().manual_seed(0)
    n, t = 6, 9
    mask = (torch.rand(n, t, generator=g) > 0.3).float()  # [N, T]
    entropies = torch.rand(n, t, generator=g) * 3  # [N, T]
    logp = -torch.rand(n, t, generator=g) * 2
    sampled = logp + 0.4 * torch.randn(n, t, generator=g)
    sampled[0, 1] = float("nan")  # a token the sampler could not score
    advantages = torch.randn(n, 1, generator=g)
    theirs = _trl(tmp_path, parts, reward_funcs=constant, train_dataset=_rows())
    ours = _ours(tmp_path, parts, reward_funcs=constant, train_dataset=_rows())
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        want = theirs.get_high_entropy_mask(entropies, mask, q)
        got = ours.get_high_entropy_mask(entropies, mask, q)
        assert got.dtype == want.dtype and torch.equal(got, want), q
    empty = torch.zeros_like(mask)
    assert torch.equal(ours.get_high_entropy_mask(entropies, empty, 0.5), theirs.get_high_entropy_mask(entropies,
                                                                                                        empty, 0.5))  # fmt: skip
    for threshold in (0.0, 0.1, 0.5):
        want = trl.GRPOTrainer.get_off_policy_mask(advantages, logp, sampled, mask, threshold)
        got = GRPOTrainer.get_off_policy_mask(advantages, logp, sampled, mask, threshold)
        assert got.dtype == want.dtype and torch.equal(got, want), threshold
    log_ratio = 0.3 * torch.randn(n, t, generator=g)
    for constants in ({}, dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.0, lambda_neg=1.0)):
        want = trl.GRPOTrainer.get_gamma_weights(advantages, log_ratio, mask, None, **constants)
        got = GRPOTrainer.get_gamma_weights(advantages, log_ratio, mask, None, **constants)
        assert got.shape == want.shape == (n, 1)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        GRPOTrainer.get_gamma_weights(advantages, log_ratio, mask, torch.ones(n, t))


def test_pop_callback_is_transformers(tmp_path, parts):
    from transformers import PrinterCallback

    trainer = _ours(tmp_path, parts, reward_funcs=constant, train_dataset=_rows(), callbacks=[PrinterCallback])
    popped = trainer.pop_callback(PrinterCallback)
    assert isinstance(popped, PrinterCallback) and trainer.pop_callback(PrinterCallback) is None
