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

BUILTIN = str(Path(__file__).resolve().parents[1] / "grpolab" / "assets" / "arith-sft")
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
