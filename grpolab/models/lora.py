"""LoRA adapters through peft: add them, reload them from a checkpoint, merge them into the base.

Only the adapter weights train; the reference policy for the KL term is the same model
with its adapter disabled (``model.disable_adapter()``), so no second copy sits in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch


def add_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: str | list[str] = "all-linear",
) -> torch.nn.Module:
    """``model`` with new LoRA adapters of ``rank`` and ``alpha`` on ``targets`` (peft's target_modules:
    "all-linear" or module names), ``dropout`` on their input."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_lora(model: torch.nn.Module, adapter_dir: str | Path, trainable: bool = True) -> torch.nn.Module:
    """``model`` with the adapter saved in ``adapter_dir``: its layers, rank and dropout are those its
    adapter_config.json names, whatever the options now say."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()
