"""Reward models (--reward-model; a directory or Hub id in the Python API's reward_funcs): the pure parts (token
batches, the head's score, which entry is a model) on hand values; a tiny random LlamaForSequenceClassification from a
directory, from a Hub id in an offline cache and as an object, whose batched scores equal a direct forward of the model
on the same text in float64; weights and GDPO's normalisation on a short run's numbers; config.json and checkpoints;
a missing model in one line. Fast tier: tiny models on the built-in character tokenizer, no network."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import run_cli
from helpers.hub import COMMIT_A, hub_repo, offline_hub
from helpers.models import tiny_reward_model
from helpers.runs import quiet
from reward_fixtures import PARITY_TRL_CALLS, parity, parity_trl
from safetensors.torch import load_file

import grpolab
from grpolab.commands.api import _config
from grpolab.common.errors import ConfigError
from grpolab.common.hub import HubError
from grpolab.config.train import TrainConfig
from grpolab.models.policy import ASSET_DIR
from grpolab.rewards.model import (
    RewardModelSettings,
    head_score,
    label_index,
    load_reward_model,
    model_name,
    model_texts,
    names_a_model,
    same_prompt,
    split_label,
    token_batches,
)
from grpolab.rewards.rewarder import reward_functions, score
from grpolab.training.runlog import read_metrics

F64 = RewardModelSettings(dtype="float64")
RECORDS = [{"prompt": p} for p in ("2+3=", "10-4=", "7*6=")] * 3
COMPLETIONS = ["5", "six", "42 is it", "#### 5", "", "forty two, I think", "5.", "6", "a much longer answer here"]


def text_prompt(record: dict) -> str:
    return record["prompt"]


def chat_prompt(record: dict) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": record["prompt"]}]


def direct(model, tok, text: str) -> float:
    """The model's score of one text: one row, no padding, its logits as the head gives them."""
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0].double()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A saved tiny one-label reward model (float64 to compare exactly) and the model itself."""
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model, tok = tiny_reward_model(path)
    return path, model.double(), tok


# ---------------------------------------------------------------- the pure parts


def test_token_batches_pack_sorted_rows_within_the_budget():
    # sorted: 2 (idx 3), 3 (1), 3 (4), 5 (0), 9 (2); budget 10: [2,3,3] pads to 9; 5 then 5*2 = 10 with 9? no: 18
    assert token_batches([5, 3, 9, 2, 3], 10) == [[3, 1, 4], [0], [2]]
    assert token_batches([5, 3, 9, 2, 3], 100) == [[3, 1, 4, 0, 2]]
    assert token_batches([4, 4, 4], 8) == [[0, 1], [2]]  # exactly at the budget fits
    assert token_batches([20, 1], 8) == [[1], [0]]  # a row longer than the budget goes alone
    assert token_batches([], 8) == []


def test_head_score_reads_one_two_and_named_labels():
    one = torch.tensor([[0.5], [-2.0]])
    two = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    assert head_score(one).tolist() == [0.5, -2.0]
    assert head_score(two).tolist() == [1.5, -2.0]  # logit 1 - logit 0: the log-odds of label 1
    assert head_score(two, label=0).tolist() == [0.5, 1.0]
    three = torch.tensor([[1.0, 2.0, 3.0]])
    assert head_score(three, label=2).tolist() == [3.0]
    with pytest.raises(ValueError, match="3 labels"):
        head_score(three)


def test_label_index_by_number_or_name():
    names = {0: "bad", 1: "ok", 2: "good"}
    assert label_index("", 1, None) is None and label_index("", 2, names) is None
    assert label_index("2", 3, names) == 2 and label_index("good", 3, names) == 2
    with pytest.raises(ValueError, match="0: bad, 1: ok, 2: good"):
        label_index("", 3, names)
    with pytest.raises(ValueError, match="no label named 'great'"):
        label_index("great", 3, names)
    with pytest.raises(ValueError, match="3 label"):
        label_index("3", 3, names)


def test_which_reward_funcs_entries_are_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my:rm").mkdir()
    assert names_a_model("org/reward-model") and names_a_model("org/rm@positive") and names_a_model("missing-dir")
    assert names_a_model("my:rm")  # an existing directory, whatever its name holds
    assert not names_a_model("grpolab.rewards:format_reward") and not names_a_model("rewards.py:correct")
    assert not names_a_model(print) and names_a_model(torch.nn.Linear(1, 1))
    assert split_label("org/rm@LABEL_1") == ("org/rm", "LABEL_1") and split_label("org/rm") == ("org/rm", "")
    assert model_name("org/rm@1") == "rm" and model_name(str(tmp_path / "my:rm") + "/") == "my:rm"
    assert model_name("reward model object: LlamaForSequenceClassification (/x/tiny-rm) #2") == "tiny-rm"
    assert model_name("reward model object: LlamaForSequenceClassification") == "LlamaForSequenceClassification"


def test_model_texts_as_trl_builds_them():
    def template(messages):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    assert model_texts(["Q: 2+3=", [{"role": "user", "content": "hi"}]], [" 5", "hello"], template) == [
        "Q: 2+3= 5",
        "user:hi|assistant:hello",
    ]


# ---------------------------------------------------------------- scores equal a direct forward


def test_a_groups_shared_prompt_is_computed_once_and_scores_as_whole_rows(rm_dir):
    """Rows sharing a prompt (a GRPO group) read its keys and values from one forward: the same scores as whole
    rows (float64), with the prompt's tokens computed once per group instead of once per row."""
    path, _, _ = rm_dir
    rm = load_reward_model(str(path), RewardModelSettings(dtype="float64"), text_prompt, chat=False)
    texts = [r["prompt"] + c for c, r in zip(COMPLETIONS, RECORDS)]
    groups = same_prompt([r["prompt"] for r in RECORDS])
    assert groups == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    tokens = []
    rm.model.register_forward_hook(lambda m, args, kw, out: tokens.append(kw["input_ids"].numel()), with_kwargs=True)
    whole = rm.score_texts(texts)
    whole_tokens, tokens[:] = sum(tokens), []
    shared = rm.score_texts(texts, groups)
    assert shared.tolist() == pytest.approx(whole.tolist(), abs=1e-9, rel=0)
    prompts = sum(len(RECORDS[g[0]]["prompt"]) for g in groups)
    assert sum(tokens) <= whole_tokens - 2 * prompts + 3  # each group's prompt once, not three times (+ padding)


def test_scores_from_a_directory_equal_a_direct_forward_in_several_batches(rm_dir):
    path, model, tok = rm_dir
    rm = load_reward_model(str(path), RewardModelSettings(dtype="float64", batch_tokens=24), text_prompt, chat=False)
    assert rm.__name__ == "tiny-rm" and rm.model.dtype == torch.float64 and not rm.model.training
    assert not any(p.requires_grad for p in rm.model.parameters())
    forwards = []
    rm.model.register_forward_hook(lambda m, args, kw, out: forwards.append(kw["input_ids"].shape), with_kwargs=True)
    got = rm(COMPLETIONS, RECORDS)
    want = [float(direct(model, tok, r["prompt"] + c)[0]) for c, r in zip(COMPLETIONS, RECORDS)]
    assert got == pytest.approx(want, abs=1e-6, rel=0)
    assert len(forwards) >= 4 and all(b * t <= 24 for b, t in forwards if b > 1)  # the budget split them
    assert any(b > 1 for b, _ in forwards)  # and some batches held rows of different lengths, right padded
    assert len(set(want)) == len(want)  # the texts' scores differ: a misplaced row would show


def test_scores_from_a_hub_id_in_an_offline_cache(rm_dir, tmp_path, monkeypatch):
    path, model, tok = rm_dir
    hub = offline_hub(tmp_path / "hf", monkeypatch)
    hub_repo(hub, "org/tiny-rm", "model", COMMIT_A, {f.name: f for f in path.iterdir()})
    monkeypatch.chdir(tmp_path)
    rm = load_reward_model("org/tiny-rm", F64, text_prompt, chat=False)
    assert rm.origin == {"id": "org/tiny-rm", "revision": "main", "commit": COMMIT_A}
    want = [float(direct(model, tok, r["prompt"] + c)[0]) for c, r in zip(COMPLETIONS, RECORDS)]
    assert rm(COMPLETIONS, RECORDS) == pytest.approx(want, abs=1e-6, rel=0)
    with pytest.raises(HubError, match="--reward-model org/no-such-rm: not in the Hugging Face cache"):
        load_reward_model("org/no-such-rm", F64, text_prompt, chat=False)


def test_chat_prompts_go_through_the_reward_models_own_template(rm_dir):
    path, model, tok = rm_dir
    rm = load_reward_model(str(path), RewardModelSettings(dtype="float64", batch_tokens=64), chat_prompt, chat=True)
    got = rm(COMPLETIONS, RECORDS)
    texts = [
        tok.apply_chat_template(chat_prompt(r) + [{"role": "assistant", "content": c}], tokenize=False)
        for c, r in zip(COMPLETIONS, RECORDS)
    ]
    assert texts[0] == "<system>be brief\n<user>2+3=\n<assistant>5\n"
    assert got == pytest.approx([float(direct(model, tok, t)[0]) for t in texts], abs=1e-6, rel=0)


def test_a_two_label_head_scores_label_1_minus_label_0_and_any_label_can_be_named(tmp_path):
    model, tok = tiny_reward_model(tmp_path / "two", num_labels=2, id2label={0: "wrong", 1: "right"})
    model = model.double()
    logits = [direct(model, tok, r["prompt"] + c) for c, r in zip(COMPLETIONS, RECORDS)]
    rm = load_reward_model(str(tmp_path / "two"), F64, text_prompt, chat=False)
    assert rm(COMPLETIONS, RECORDS) == pytest.approx([float(x[1] - x[0]) for x in logits], abs=1e-6, rel=0)
    rm = load_reward_model(str(tmp_path / "two") + "@wrong", F64, text_prompt, chat=False)
    assert rm(COMPLETIONS, RECORDS) == pytest.approx([float(x[0]) for x in logits], abs=1e-6, rel=0)


def test_a_head_of_more_labels_needs_one_named(tmp_path):
    model, tok = tiny_reward_model(tmp_path / "three", num_labels=3)
    model = model.double()
    with pytest.raises(ConfigError, match=r"its head has 3 labels .*--reward-model ID_OR_DIR@LABEL"):
        load_reward_model(str(tmp_path / "three"), F64, text_prompt, chat=False)
    rm = load_reward_model(str(tmp_path / "three") + "@LABEL_2", F64, text_prompt, chat=False)
    want = [float(direct(model, tok, r["prompt"] + c)[2]) for c, r in zip(COMPLETIONS, RECORDS)]
    assert rm(COMPLETIONS, RECORDS) == pytest.approx(want, abs=1e-6, rel=0)


def test_what_is_not_a_reward_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--reward-model nowhere: no such directory, nor a Hub id"):
        load_reward_model("nowhere", F64, text_prompt, chat=False)
    with pytest.raises(ConfigError, match="its weights lack score.weight.*not a trained sequence-classification"):
        load_reward_model(str(ASSET_DIR), F64, text_prompt, chat=False)  # a causal LM: no trained head
    tiny_reward_model(tmp_path / "plain", template="")
    with pytest.raises(ConfigError, match="prompts are chat messages and its tokenizer has no chat template"):
        load_reward_model(str(tmp_path / "plain"), F64, chat_prompt, chat=True)


# ---------------------------------------------------------------- in a run's reward


def test_weights_apply_in_order_functions_then_models(rm_dir):
    path, model, tok = rm_dir
    fns = reward_functions(
        ("reward_fixtures:parity",), (2.0, 0.5), 0.0, prompt_of=text_prompt, models=(str(path),), model_settings=F64
    )
    assert [(n, w) for n, _, w in fns] == [("parity", 2.0), ("tiny-rm", 0.5), ("format", 0.0)]
    s = score(COMPLETIONS, RECORDS, fns)
    m = [float(direct(model, tok, r["prompt"] + c)[0]) for c, r in zip(COMPLETIONS, RECORDS)]
    f = parity(COMPLETIONS, RECORDS)
    assert s.components["tiny-rm"].tolist() == pytest.approx(m, abs=1e-6)
    assert s.total.tolist() == pytest.approx([2 * a + 0.5 * b for a, b in zip(f, m)], abs=1e-6)
    with pytest.raises(ConfigError, match="--reward-weights: 1 weight.s. for 1 --reward-fn and 1 --reward-model"):
        reward_functions(("reward_fixtures:parity",), (1.0,), 0.0, models=(str(path),))


def test_a_model_object_given_to_the_api_is_scored_with_its_tokenizer(rm_dir):
    path, model, tok = rm_dir
    rm_obj, rm_tok = tiny_reward_model(seed=3)  # not saved anywhere: its tokenizer must be given
    rm_obj = rm_obj.double()
    cfg, given = _config(TrainConfig, "train", "model", None, None, None,
                         {"reward_funcs": [rm_obj, parity, str(path)], "reward_processing_classes": [rm_tok, None, None],
                          "reward_weights": [3.0, 1.0, 0.5]})  # fmt: skip
    (described,) = [m for m in cfg.reward.reward_model if m != str(path)]
    assert described == "reward model object: LlamaForSequenceClassification"
    assert cfg.reward.reward_fn == ("reward_fixtures:parity",)
    assert cfg.reward.reward_weights == (1.0, 3.0, 0.5)  # functions first, then models, each with its weight
    fns = reward_functions(
        cfg.reward.reward_fn, cfg.reward.reward_weights, 0.0, prompt_of=text_prompt, given=given,
        models=cfg.reward.reward_model, model_settings=RewardModelSettings(),
    )  # fmt: skip
    assert [n for n, _, _ in fns] == ["parity", "LlamaForSequenceClassification", "tiny-rm", "format"]
    assert fns[1][1].model is rm_obj  # the object itself, in its own dtype (auto keeps it)
    got = score(COMPLETIONS, RECORDS, fns).components["LlamaForSequenceClassification"]
    want = [float(direct(rm_obj, rm_tok, r["prompt"] + c)[0]) for c, r in zip(COMPLETIONS, RECORDS)]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ConfigError, match="names no path to load its tokenizer"):
        _config(TrainConfig, "train", "model", None, None, None, {"reward_funcs": [tiny_reward_model()[0]]})


def gdpo(components: list[list[float]], weights: list[float], group: int) -> list[float]:
    """GDPO's advantages by hand: each component standardised within each group (population std + 1e-4), the
    weighted sum, divided by the step's population std of that sum (+ 1e-4)."""
    n, summed = len(components[0]), []
    for start in range(0, n, group):
        part = [0.0] * group
        for comp, w in zip(components, weights):
            g = comp[start : start + group]
            mean = sum(g) / group
            std = (sum((x - mean) ** 2 for x in g) / group) ** 0.5
            part = [p + w * (x - mean) / (std + 1e-4) for p, x in zip(part, g)]
        summed += part
    mean = sum(summed) / n
    std = (sum((x - mean) ** 2 for x in summed) / n) ** 0.5
    return [x / (std + 1e-4) for x in summed]


def test_trl_form_reward_funcs_train_with_a_model_weighted_and_normalised(rm_dir, tmp_path):
    path, model, tok = rm_dir
    PARITY_TRL_CALLS.clear()
    run = grpolab.train(
        model="builtin", reward_funcs=[str(path), parity_trl], reward_weights=[0.5, 2.0],
        reward_normalisation="normalize-then-sum", format_weight=0.0, steps=2, prompts_per_step=2, group_size=4,
        max_new_tokens=16, eval_questions=4, eval_samples=1, warmup_steps=0, log_rollouts=True, progress=False,
        threads=1, out=str(tmp_path / "run"), log=quiet, honeypots="none",  # the calls recorded: training's only
    )  # fmt: skip
    config = run.config
    assert config["reward_model"] == [str(path)] and config["reward_fn"] == ["reward_fixtures:parity_trl"]
    assert config["reward_weights"] == [2.0, 0.5]  # the list's weights, functions first
    rollouts = [json.loads(line) for line in (run.dir / "rollouts.jsonl").read_text().splitlines()]
    metrics = read_metrics(run.dir / "metrics.jsonl")
    values = []
    for step in (1, 2):
        rows = [r for r in rollouts if r["step"] == step]
        prompts, completions = PARITY_TRL_CALLS[step - 1]
        assert [r["completion"] for r in rows] == completions  # scored in the order logged
        f = [float(sum(map(ord, c)) % 2) for c in completions]
        values += f
        m = [float(direct(model, tok, p + c)[0]) for p, c in zip(prompts, completions)]
        assert [r["reward"] for r in rows] == pytest.approx([2 * a + 0.5 * b for a, b in zip(f, m)], abs=1e-5)
        assert [r["advantage"] for r in rows] == pytest.approx(gdpo([f, m], [2.0, 0.5], 4), rel=1e-3, abs=1e-4)
        row = next(x for x in metrics if x["step"] == step)
        assert row["reward/tiny-rm"] == pytest.approx(sum(m) / len(m), abs=1e-6)
        assert row["reward/accuracy"] == pytest.approx(sum(f) / len(f))  # the first component: the function
    assert 0 < sum(values) < len(values)  # the function varied too: both components moved the advantages
    # the reward model never trains and is not in the checkpoint: the policy's tensors only
    saved = load_file(str(run.dir / "checkpoints" / "step_2" / "model.safetensors"))
    assert saved.keys() == load_file(str(ASSET_DIR / "model.safetensors")).keys()
    assert not any("score" in k for k in saved)
    assert json.loads((run.dir / "checkpoints" / "step_2" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]


@pytest.mark.parametrize("spec", ["org/no-such-rm", "no-such-dir"])
def test_a_missing_reward_model_is_one_error_line(tmp_path, monkeypatch, spec):
    offline_hub(tmp_path / "hf", monkeypatch)
    args = ["train", "--reward-model", spec, "--steps", "1", "--threads", "1", "--no-progress", "--out", tmp_path / "x"]
    res = run_cli(args, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --reward-model {spec}: "), res.stderr


def test_the_doctor_reads_no_ceiling_in_a_reward_models_logit():
    """A reward model's mean score of 1.29 is a logit, not a 129% accuracy: no saturation (a ceiling of 0.9 for a
    reward in [0, 1]) unless a function comes first."""
    from grpolab.doctor.conditions import diagnose
    from grpolab.doctor.rows import RunFacts

    rows = [{"step": s, "reward/mean": 1.29, "reward/std": 1.0, "reward/accuracy": 1.29, "reward/frac_zero_std": 0.0,
             "sampling/rollouts": 64} for s in range(1, 21)]  # fmt: skip
    facts = RunFacts.of({"reward_model": ["runs/rm"]})
    assert facts.unbounded and facts.model_reward == "reward model"
    assert "saturation" not in [f.name for f in diagnose(rows, facts)]
    bounded = RunFacts.of({"reward_fn": ["mod:fn"], "reward_model": ["runs/rm"]})
    assert not bounded.unbounded and "saturation" in [f.name for f in diagnose(rows, bounded)]
