"""Load a policy (model + tokenizer) and turn records into prompt token ids."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

BUILTIN = "builtin"
SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Work step by step, one short line per step, "
    "and end with a final line of the form '#### <answer>'."
)
MATH_SYSTEM_PROMPT = "Solve the problem step by step and put the final answer in \\boxed{}."
ASSET_DIR = Path(__file__).parent / "assets" / "arith-sft"  # shipped warm start (see its README)


@dataclasses.dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    source: str
    """Where the weights came from (a path)."""
    chat: bool = False
    """Prompt through the tokenizer's chat template (instruct models) instead of plain text."""
    system: str = SYSTEM_PROMPT
    """The system instruction of chat prompts: how to format the final answer."""
    few_shot: list[dict] = dataclasses.field(default_factory=list)
    """Solved examples (question, answer) put before the question."""

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else pad

    def chat_messages(self, record: dict) -> list[dict]:
        """System instruction, few-shot turns, then the question as the user turn."""
        msgs = [{"role": "system", "content": self.system}]
        for ex in self.few_shot:
            msgs += [{"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]
        return msgs + [{"role": "user", "content": record["question"]}]

    def prompt_ids(self, record: dict) -> list[int]:
        """Chat models: the chat template with the generation prompt. Others: BOS, the few-shot
        examples (question, newline, answer, blank line), the question, newline."""
        if self.chat:
            ids = self.tokenizer.apply_chat_template(self.chat_messages(record), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in some versions
        shots = "".join(f"{ex['question']}\n{ex['answer']}\n\n" for ex in self.few_shot)
        ids = self.tokenizer(shots + record["question"] + "\n", add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + ids

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Completion texts ``[N]`` from ids ``[N, T]``, special tokens removed."""
        return [
            self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask)
        ]


def cache_dir() -> Path:
    """``$GRPOLAB_CACHE``, else ``$XDG_CACHE_HOME/grpolab``, else ``~/.cache/grpolab``."""
    if os.environ.get("GRPOLAB_CACHE"):
        return Path(os.environ["GRPOLAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "grpolab"


def resolve_model_path(spec: str) -> Path:
    """``builtin`` -> the shipped SFT warm start; anything else must be a model directory."""
    if spec == BUILTIN:
        if not (ASSET_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in warm start is missing from {ASSET_DIR}; regenerate it with "
                f"`grpolab sft --out {ASSET_DIR}` (see grpolab/assets/arith-sft/README.md)"
            )
        return ASSET_DIR
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {spec!r}: not a model directory (no config.json); use 'builtin', "
                                "'smollm2-135m-instruct', a local Hugging Face model directory or a .gguf file")
    return path


def default_dtype() -> torch.dtype:
    """fp32: grpolab runs on the CPU (bf16 matmuls are slow there, fp16 overflows). GPU placement is not
    implemented yet (there is no GPU on the machines this was built on), so there is no bf16-on-GPU default."""
    return torch.float32


def load_policy(spec: str, dtype: torch.dtype | None = None, *, gguf_file: str = "", chat: str = "auto",
                few_shot: list[dict] | None = None) -> Policy:
    """Model and tokenizer from ``spec`` (see :mod:`grpolab.models.loading`).

    ``chat``: ``"auto"`` uses the chat template when the tokenizer has one (instruct models)
    and the model is not the built-in one; ``"on"``/``"off"`` force it.
    """
    from grpolab.models.loading import load_gguf, resolve_gguf

    dtype = dtype or default_dtype()
    gguf = None if spec == BUILTIN else resolve_gguf(spec, gguf_file)
    if gguf is not None:
        model, tokenizer = load_gguf(*gguf, dtype=dtype)
        source = str(gguf[0] / gguf[1])
    else:
        path = resolve_model_path(spec)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        source = str(path)
    from grpolab.config import ConfigError

    if chat not in ("auto", "on", "off"):
        raise ConfigError(f"--chat must be auto, on or off, got {chat!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat == "on" and not has_template:
        raise ConfigError(f"--chat on: the tokenizer of {source} has no chat template")
    use_chat = has_template and (chat == "on" or (chat == "auto" and spec != BUILTIN))
    return Policy(model=model, tokenizer=tokenizer, source=source, chat=use_chat, few_shot=list(few_shot or []))
