"""grpolab.trl beside TRL 1.16's own GRPOTrainer on the same tiny model and rows: what each hands the model and the
reward functions, streaming data, evaluation, and log_history entry by entry.

Each test runs TRL's trainer and the drop-in with the same GRPOConfig keywords (``trl.GRPOConfig`` and
``grpolab.trl.GRPOConfig``) on the built-in model's weights (a tiny Llama; its tokenizer given a chat template here, so
a run that wrongly templates a text prompt shows it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.paths import REPO

BUILTIN = str(REPO / "grpolab" / "assets" / "arith-sft")
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
COMMON = dict(num_generations=3, per_device_train_batch_size=6, max_completion_length=24, learning_rate=0.1,
              logging_steps=1, save_strategy="no", bf16=False, use_cpu=True, report_to="none", disable_tqdm=True,
              seed=0)  # fmt: skip


@pytest.fixture(autouse=True)
def _a_cpu_without_bf16_units(machine_kind):
    machine_kind(bf16=False)


def _model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUILTIN)
    tokenizer.chat_template = TEMPLATE
    return AutoModelForCausalLM.from_pretrained(BUILTIN), tokenizer


def _text_rows(n: int = 6):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(n)])


def _chat_rows(n: int = 6):
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{a}+{a + 1}="}], "answer": str(2 * a + 1)} for a in range(n)]
    )


class LengthReward:
    """``reward = len(completion)`` (of its text, for a conversational completion), recording every call's
    ``prompts`` and ``completions``."""

    __name__ = "length"

    def __init__(self):
        self.calls: list[tuple[list, list]] = []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append((list(prompts), list(completions)))
        return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def _train(which: str, rows, tmp_path, reward, **kw):
    """One trainer (``"trl"``: TRL's own; ``"grpolab"``: the drop-in) trained on ``rows``; returns (trainer, the
    weights before)."""
    if which == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpolab.trl import GRPOConfig, GRPOTrainer
    model, tokenizer = _model_and_tokenizer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path / which), **COMMON | kw)
    trainer = GRPOTrainer(model, reward, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    return trainer, before


def _unmoved(model, before: dict) -> list[str]:
    return [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]


@pytest.mark.parametrize("which", ["trl", "grpolab"])
def test_a_text_prompt_stays_text_and_every_parameter_moves(tmp_path, which):
    """A standard dataset (``prompt`` a string): the raw text, no chat template; completions to the reward function
    as strings, so ``len(completion)`` varies within a group and every parameter moves at lr 0.1 (under a templated
    prompt and chat completions every reward was 1: no advantage, nothing moved)."""
    reward = LengthReward()
    trainer, before = _train(which, _text_rows(), tmp_path, reward, max_steps=2)
    rows = {r["prompt"] for r in _text_rows()}
    for prompts, completions in reward.calls:
        assert all(isinstance(c, str) for c in completions)
        assert set(prompts) <= rows  # the row's own text, as the data gives it
    assert len({len(c) for _, cs in reward.calls for c in cs}) > 1
    assert _unmoved(trainer.model, before) == []


def test_the_prompt_ids_are_trl_s_for_text_and_chat_rows(tmp_path):
    """The ids the policy is prompted with: TRL's ``_tokenize_prompts`` (the tokenizer's own encoding of a text
    prompt; the chat template with the generation prompt for messages) and the drop-in's trained policy's, row by
    row; and the reward function's ``prompts`` and completion form for chat rows are TRL's."""
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _model_and_tokenizer()
    trl = GRPOTrainer(model, LengthReward(), args=GRPOConfig(output_dir=str(tmp_path / "trl"), **COMMON),
                      train_dataset=_text_rows(), processing_class=tokenizer)  # fmt: skip
    reward = LengthReward()
    ours, _ = _train("grpolab", _chat_rows(), tmp_path, reward, max_steps=1)
    policy = ours.run.policy
    for rows in (_text_rows(), _chat_rows()):
        prompts = [r["prompt"] for r in rows]
        theirs, _, _ = trl._tokenize_prompts(prompts)
        assert [policy.prompt_ids(r) for r in rows] == [list(ids) for ids in theirs]
    chat = [r["prompt"] for r in _chat_rows()]
    for prompts, completions in reward.calls:
        assert all(p in chat for p in prompts)
        assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)


# ---------------------------------------------------------------- log_history, entry by entry


def _log_run(which: str, tmp_path, **kw):
    """Both trainers with two weighted reward functions, an entropy bonus and an evaluation at steps 2 and 3;
    returns the trainer."""
    from datasets import Dataset

    if which == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpolab.trl import GRPOConfig, GRPOTrainer

    def r1(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def r2(completions, **kwargs):
        return [float(c.count("1")) for c in completions]

    held_out = Dataset.from_list([{"prompt": f"{a}+{a + 2}=", "answer": str(2 * a + 2)} for a in range(10, 14)])
    options = COMMON | dict(max_completion_length=16, learning_rate=0.01, logging_steps=2, max_steps=3,
                            reward_weights=[1.0, 0.5], entropy_coef=0.01, eval_strategy="steps", eval_steps=2,
                            per_device_eval_batch_size=6) | kw  # fmt: skip
    model, tokenizer = _model_and_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / which), **options)
    trainer = GRPOTrainer(model, [r1, r2], args=args, train_dataset=_text_rows(8), eval_dataset=held_out,
                          processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return trainer


DOC = REPO / "docs" / "coming-from-trl.md"


def _doc_keys(lead: str, after: str) -> set[str]:
    """The backticked names listed in docs/coming-from-trl.md's "Where grpolab behaves differently", in the bullet
    that starts with ``lead`` (in bold), from the words ``after`` to the end of their sentence."""
    import re

    text = DOC.read_text()
    bullet = text[text.index(f"- **{lead}**") :]
    listed = bullet[bullet.index(after) + len(after) :]
    return set(re.findall(r"`([^`]+)`", listed[: listed.index(". ")]))


NOT_LOGGED = ("TRL's log keys the drop-in does not log", "does not log**:")
NOT_EVALUATED = ("An evaluation's entry", "keys the drop-in does not give:")


@pytest.fixture(scope="module")
def log_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logs")
    return {which: _log_run(which, tmp).state.log_history for which in ("trl", "grpolab")}


def test_log_history_has_trl_s_entries_and_keys(log_runs):
    """Entry by entry: the same steps and kinds (train, evaluation, the summary last); a train entry and the summary
    hold every key TRL's hold (TRL's names; grpolab's own beside them), but the keys listed as not logged."""
    trl, ours = log_runs["trl"], log_runs["grpolab"]

    def kind(entry):
        return "summary" if "train_loss" in entry else "eval" if any(k.startswith("eval_") for k in entry) else "train"

    assert [(e["step"], kind(e)) for e in ours] == [(e["step"], kind(e)) for e in trl]
    assert [kind(e) for e in trl] == ["train", "eval", "eval", "summary"]
    missing: dict[str, set] = {"train": set(), "eval": set(), "summary": set()}
    for theirs, mine in zip(trl, ours):
        missing[kind(theirs)] |= set(theirs) - set(mine)
    # the docs list exactly what is missing: a key that comes, or a new one TRL logs, fails here
    assert missing["train"] | missing["summary"] == _doc_keys(*NOT_LOGGED)
    assert missing["eval"] == {k.replace("<fn>", fn) for k in _doc_keys(*NOT_EVALUATED) for fn in ("r1", "r2")}
    train = [e for e in ours if kind(e) == "train"][-1]
    for key in ("policy_loss", "entropy_coef", "rewards/r1/mean", "rewards/r1/std", "rewards/r2/std",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/min_length",
                "completions/mean_terminated_length"):  # fmt: skip
        assert train[key] is not None, key
    assert train["entropy_coef"] == pytest.approx(0.01)
    assert ours[-1]["total_flos"] == trl[-1]["total_flos"] == 0.0


def test_the_summary_carries_the_steps_logged_after_the_last_entry(log_runs, tmp_path):
    """logging_steps 2 of 3 steps and no evaluation at the end: TRL's last entry is step 3's metrics (without the
    trainer's loss, grad_norm and learning_rate) beside train_loss; the drop-in's too."""
    trl = _log_run("trl", tmp_path, eval_strategy="no").state.log_history
    ours = _log_run("grpolab", tmp_path, eval_strategy="no").state.log_history
    assert [e["step"] for e in ours] == [e["step"] for e in trl] == [2, 3]
    assert set(trl[-1]) - set(ours[-1]) <= _doc_keys(*NOT_LOGGED)
    assert {"reward", "train_loss"} <= set(ours[-1]) and "loss" not in ours[-1] and "loss" not in trl[-1]


# ---------------------------------------------------------------- streaming data


def _stream(n: int = 12):
    from datasets import IterableDataset

    def rows():
        for a in range(n):
            yield {"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)}

    return IterableDataset.from_generator(rows)


class _KillAfter:
    """A callback that stops the process's training by raising once step ``n`` is over (its checkpoint saved)."""

    def __init__(self, n: int):
        from transformers import TrainerCallback

        class Kill(TrainerCallback):
            def on_save(self, args, state, control, **kw):
                if state.global_step == n:
                    raise KeyboardInterrupt(f"killed after step {n}")

        self.callback = Kill()


def _stream_run(out: Path, callbacks=(), resume: bool = False, **kw):
    from grpolab.trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _model_and_tokenizer()
    args = GRPOConfig(
        output_dir=str(out), **COMMON | dict(learning_rate=1e-3, save_strategy="steps", save_steps=2) | kw
    )
    trainer = GRPOTrainer(model, LengthReward(), args=args, train_dataset=_stream(), processing_class=tokenizer,
                          callbacks=list(callbacks))  # fmt: skip
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def test_a_stream_trains_for_max_steps_and_resumes_where_it_was_killed(tmp_path):
    """An IterableDataset trains for max_steps, its rows in the stream's order; a run killed after step 2 (its
    checkpoint saved) and resumed equals the run that was not stopped: every step's reward and the final weights."""
    whole = _stream_run(tmp_path / "whole", max_steps=4)
    with pytest.raises(KeyboardInterrupt):
        _stream_run(tmp_path / "cut", [_KillAfter(2).callback], max_steps=4)
    resumed = _stream_run(tmp_path / "cut", resume=True, max_steps=4)
    assert [m.get("reward/mean") for m in resumed.run.metrics] == [m.get("reward/mean") for m in whole.run.metrics]
    assert len(whole.run.metrics) == 4 + 1  # four steps and the step-0 evaluation's row
    assert resumed.state.num_input_tokens_seen == whole.state.num_input_tokens_seen > 0  # counted on across the resume
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("which", ["trl", "grpolab"])
def test_a_stream_without_max_steps_is_a_value_error(tmp_path, which):
    if which == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpolab.trl import GRPOConfig, GRPOTrainer
    model, tokenizer = _model_and_tokenizer()
    with pytest.raises(ValueError, match="does not implement __len__.*max_steps has to be specified"):
        GRPOTrainer(model, LengthReward(), args=GRPOConfig(output_dir=str(tmp_path), **COMMON),
                    train_dataset=_stream(), processing_class=tokenizer)  # fmt: skip
