"""LoRA adapters through peft: add them, reload them from a checkpoint, merge them into the base.

Only the adapter weights train; the reference policy for the KL term is the same model
with its adapter disabled (``model.disable_adapter()``), so no second copy sits in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch


def add_lora(model: torch.nn.Module, rank: int, alpha: float) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_lora(model: torch.nn.Module, adapter_dir: str | Path, trainable: bool = True) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def merge_checkpoint(checkpoint: str | Path, out: str | Path, model: str = "", gguf_file: str = "") -> str:
    """Fold a LoRA checkpoint's adapter into its base model and save a plain Hugging Face model directory at ``out``.

    The base is ``model`` (``gguf_file`` inside it), or by default the run's own ``--model`` from the
    ``config.json`` two levels above the checkpoint. A damaged checkpoint is refused in one line. Returns the base.
    """
    import json

    from grpolab.policy import load_policy
    from grpolab.runs import Target, check_intact

    ckpt = Path(checkpoint)
    check_intact(Target(str(ckpt), str(ckpt)))  # a damaged checkpoint: one line naming the file
    if not is_adapter_dir(ckpt):
        raise FileNotFoundError(f"--checkpoint {ckpt}: no adapter_config.json (not a LoRA checkpoint)")
    if not model:
        run_cfg = ckpt.parent.parent / "config.json"
        if not run_cfg.is_file():
            raise FileNotFoundError(f"--checkpoint {ckpt}: no run config.json two levels up; pass --model")
        saved = json.loads(run_cfg.read_text())
        model, gguf_file = saved["model"], saved.get("gguf_file", "")
    policy = load_policy(model, gguf_file=gguf_file)
    merged = load_lora(policy.model, ckpt, trainable=False).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    policy.tokenizer.save_pretrained(out)
    return model
