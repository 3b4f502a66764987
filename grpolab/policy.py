"""Load a policy (model + tokenizer) and turn records into prompt token ids."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

BUILTIN = "builtin"
ASSET_DIR = Path(__file__).parent / "assets" / "arith-sft"  # shipped warm start (see its README)


@dataclasses.dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    source: str
    """Where the weights came from (a path)."""

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else pad

    def prompt_ids(self, record: dict) -> list[int]:
        """The question as a plain prompt: BOS, question, newline."""
        ids = self.tokenizer(record["question"] + "\n", add_special_tokens=False)["input_ids"]
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
        raise FileNotFoundError(f"--model {spec!r}: not a model directory (no config.json); use 'builtin' or a local Hugging Face model directory")
    return path


def load_policy(spec: str, dtype: torch.dtype = torch.float32) -> Policy:
    path = resolve_model_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return Policy(model=model, tokenizer=tokenizer, source=str(path))
