"""Data in the forms people keep it (JSONL, JSON, CSV, Parquet, a saved DatasetDict), prompt columns, and every column
reaching the reward functions."""

from __future__ import annotations

import copy
import json
import re

import pytest
from datasets import Dataset, DatasetDict
from helpers.models import SIMPLE_TEMPLATE

from grpolab.data.dataset import hold_out, load_records
from grpolab.data.jsonl import DataError
from grpolab.models.policy import Policy

ROWS = [
    {"prompt": "Reverse 'abc'.", "target": "cba", "bonus": 0.5, "category": "short"},
    {"prompt": "Reverse 'hello'.", "target": "olleh", "bonus": 0.0, "category": "long"},
    {"prompt": "Reverse 'xy'.", "target": "yx", "bonus": 0.25, "category": "short"},
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse 'ab'."}]


def _write_all(tmp_path, rows) -> dict:
    """The same rows as .jsonl, .json, .csv (when every value is a scalar), .parquet and a saved DatasetDict."""
    paths = {"jsonl": tmp_path / "d.jsonl", "json": tmp_path / "d.json", "parquet": tmp_path / "d.parquet"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))
    Dataset.from_list(rows).to_parquet(str(paths["parquet"]))
    if all(not isinstance(v, (list, dict)) for r in rows for v in r.values()):
        paths["csv"] = tmp_path / "d.csv"
        Dataset.from_list(rows).to_csv(str(paths["csv"]), index=False)
    paths["saved"] = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(paths["saved"])
    return paths


def test_every_file_format_and_a_saved_datasetdict_load_to_the_same_records(tmp_path):
    paths = _write_all(tmp_path, ROWS)
    assert set(paths) == {"jsonl", "json", "csv", "parquet", "saved"}
    expected = [{**r} for r in ROWS]  # prompt first, then every other column, unchanged
    for kind, path in paths.items():
        records = load_records(path, "auto", split="train" if kind == "saved" else "")
        assert records == expected, kind
    assert load_records(paths["saved"], "prompt", split="test") == expected[:1]


def test_chat_prompts_load_from_every_format_that_holds_lists(tmp_path):
    rows = [{"prompt": CHAT, "target": "ba"}, {"prompt": CHAT[1:], "target": "ba"}]
    for kind, path in _write_all(tmp_path, rows).items():
        records = load_records(path, split="train" if kind == "saved" else "")
        assert records == rows, kind


def test_another_prompt_column_and_the_presets(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"instruction": "Say hi.", "answer_key": "hi"}) + "\n")
    assert load_records(path, "auto", prompt_column="instruction") == [{"prompt": "Say hi.", "answer_key": "hi"}]
    gsm = tmp_path / "gsm.parquet"
    Dataset.from_list([{"question": "1+1?", "answer": "1+1=2\n#### 2"}]).to_parquet(str(gsm))
    (rec,) = load_records(gsm, "auto")  # the GSM8K preset, from Parquet too
    assert rec == {"question": "1+1?", "answer": "1+1=2\n#### 2", "ground_truth": "2", "category": "jsonl"}


def test_a_string_and_a_chat_prompt_give_the_chat_templates_token_ids(tiny_model, char_tokenizer):
    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = SIMPLE_TEMPLATE
    policy = Policy(tiny_model, tok, "tiny", chat=True, system="")  # prompt data: no instruction of grpolab's

    def template(messages):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    assert policy.prompt_ids({"prompt": "Reverse 'ab'."}) == template([{"role": "user", "content": "Reverse 'ab'."}])
    assert policy.prompt_ids({"prompt": CHAT}) == template(CHAT)  # used as it is
    policy.system = "Answer in one word."  # --system-prompt: put first only when the chat has no system message
    assert policy.prompt_ids({"prompt": CHAT}) == template(CHAT)
    assert policy.prompt_ids({"prompt": CHAT[1:]}) == template([{"role": "system", "content": policy.system}, CHAT[1]])


def test_eval_fraction_never_holds_out_a_training_prompt():
    records = [{"prompt": f"p{i % 40}", "i": i} for i in range(100)]  # 40 distinct prompts, most of them repeated
    train, held = hold_out(records, 0.25, seed=3)
    train_prompts, held_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in held}
    assert not train_prompts & held_prompts and len(held_prompts) == 10 and len(train) + len(held) == 100
    assert hold_out(list(reversed(records)), 0.25, seed=3)[1] == list(reversed(held))  # not the rows' order
    assert {r["prompt"] for r in hold_out(records, 0.25, seed=4)[1]} != held_prompts  # the seed chooses


def test_bad_rows_are_named(tmp_path):
    bad_chat = tmp_path / "chat.jsonl"
    bad_chat.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": [{"text": "no role"}]}) + "\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:2: 'prompt' is a list but not a chat"):
        load_records(bad_chat)
    no_prompt = tmp_path / "np.csv"
    no_prompt.write_text("text,label\nhello,1\n")
    with pytest.raises(DataError, match=r"np\.csv: no 'prompt' column \(columns: text, label\)"):
        load_records(no_prompt)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        load_records(empty)
    (tmp_path / "data.txt").write_text("prompt\n")
    with pytest.raises(DataError, match=r"file format '\.txt' not recognised"):
        load_records(tmp_path / "data.txt")
    saved = tmp_path / "saved"
    DatasetDict({"a": Dataset.from_list(ROWS), "b": Dataset.from_list(ROWS)}).save_to_disk(saved)
    with pytest.raises(DataError, match=r"choose a split \(splits: a, b\)"):
        load_records(saved)


# ---------------------------------------------------------------- through training and the command line


def _reverse_rows(n: int) -> list[dict]:
    words = ["abc", "hello", "xy", "grpo", "token", "data", "reward", "seed", "group", "cat"]
    return [
        {
            "prompt": f"{i}: reverse {w}",
            "target": w[::-1],
            "bonus": (i % 3) / 4,
            "weight": 1 + i % 2,
            "category": "even" if i % 2 == 0 else "odd",
        }
        for i, w in ((i, words[i % len(words)]) for i in range(n))
    ]


@pytest.mark.slow
def test_every_column_reaches_a_trl_form_and_a_grpolab_form_reward(tmp_path):
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import train
    from grpolab.training.runlog import read_metrics

    rows = _reverse_rows(40)
    data = tmp_path / "reverse.parquet"
    Dataset.from_list(rows).to_parquet(str(data))
    cfg = TrainConfig(
        out=str(tmp_path / "run"), data=str(data), eval_fraction=0.2, steps=2, prompts_per_step=4, group_size=4,
        max_new_tokens=12, eval_questions=8, eval_samples=1, format_weight=0.0, log_rollouts=True, progress=False,
        reward_fn=("reward_fixtures:digits_of_target", "reward_fixtures:length_times_weight"), reward_weights=(1.0, 0.5),
    )  # fmt: skip
    out = train(cfg, log=lambda *a, **k: None)
    by_prompt = {r["prompt"]: r for r in rows}
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 4 * 4 and json.loads((out / "config.json").read_text())["format"] == "prompt"
    for r in rollouts:  # the logged reward, recomputed from the completion and its row's columns
        row, c = by_prompt[r["question"]], r["completion"]
        expected = (
            sum(ch in c for ch in row["target"]) / len(row["target"])
            + row["bonus"]
            + 0.5 * len(c) * row["weight"] / 100
        )
        assert r["reward"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # the held-out accuracy is the first reward function's mean, per category too
    evals = [m for m in read_metrics(out / "metrics.jsonl") if "eval/accuracy_greedy" in m]
    assert {"eval/greedy_even", "eval/greedy_odd"} <= set(evals[0]) and evals[0]["eval/accuracy_greedy"] > 0
    # grpolab eval of the run asks the same held-out prompts, scored by the same reward
    import grpolab

    report = grpolab.evaluate(model=str(out), questions=8, samples=1, progress=False, log=lambda *a: None)
    assert report["questions"] == 8 and report["task"]["format"] == "prompt"
    for key in ("eval/accuracy_greedy", "eval/accuracy_sampled", "eval/greedy_even"):
        assert report["metrics"][key] == pytest.approx(evals[-1][key], abs=1e-9), key


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_prompt", r"^error: .*nope\.csv: no 'prompt' column \(columns: text, label\)"),
        ("empty", r"^error: .*empty\.jsonl: no records"),
        ("not_a_chat", r"^error: .*chat\.jsonl:2: 'prompt' is a list but not a chat"),
        ("missing_column", r"^error: --reward-fn needs_missing_column declares the column\(s\) 'no_such_column', which --data .*data\.jsonl lacks \(columns: prompt, target"),
        ("no_ground_truth", r"^error: the built-in accuracy reward needs 'ground_truth', which --data .*data\.jsonl lacks"),
        ("format", r"^error: .*data\.xlsx: file format '\.xlsx' not recognised"),
    ],
)  # fmt: skip
@pytest.mark.slow
def test_bad_data_is_one_line_naming_file_row_or_column(tmp_path, capsys, case, expected):
    from grpolab.commands.cli import main

    good = tmp_path / "data.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"q{i}", "target": "x"}) + "\n" for i in range(8)))
    data, extra = str(good), []
    if case == "no_prompt":
        data = str(tmp_path / "nope.csv")
        (tmp_path / "nope.csv").write_text("text,label\nhello,1\n")
    elif case == "empty":
        data = str(tmp_path / "empty.jsonl")
        (tmp_path / "empty.jsonl").write_text("")
    elif case == "not_a_chat":
        data = str(tmp_path / "chat.jsonl")
        (tmp_path / "chat.jsonl").write_text('{"prompt": "a"}\n{"prompt": [{"role": "user"}]}\n')
    elif case == "missing_column":
        extra = ["--reward-fn", "reward_fixtures:needs_missing_column"]
    elif case == "format":
        data = str(tmp_path / "data.xlsx")
        (tmp_path / "data.xlsx").write_text("x")
    args = ["train", "--data", data, "--eval-fraction", "0.25", "--steps", "1", "--out", str(tmp_path / "r"), *extra]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(expected, err), err


def test_the_eval_reward_loads_only_the_function_it_needs():
    from grpolab.config.train import TrainConfig
    from grpolab.rewards.builtin import accuracy_reward
    from grpolab.rewards.rewarder import eval_reward

    # a GSM8K run is scored by its answer check: its --reward-fn file need not exist any more when it is evaluated
    gsm8k = TrainConfig(format="gsm8k", reward_fn=("gone/reward.py:f",))
    assert eval_reward(gsm8k.reward, "", "gsm8k", False, str, False) == ("accuracy", accuracy_reward)
    prompt = TrainConfig(format="prompt", reward_fn=("reward_fixtures:length_times_weight", "gone/reward.py:f"))
    name, fn = eval_reward(prompt.reward, "", "prompt", False, str, False)  # the first function alone is loaded
    assert name == "length_times_weight" and fn(["abcd"], [{"weight": 2}]) == [0.08]
