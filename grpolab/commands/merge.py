"""``grpolab merge``: a LoRA checkpoint's adapter folded into its base model, saved as a plain model directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpolab.config.run import run_config_file
from grpolab.eval.runs import Target, check_intact
from grpolab.models.lora import is_adapter_dir, load_lora
from grpolab.models.policy import load_policy

DTYPES = ("auto", "float32", "bfloat16", "float16")


def merge_checkpoint(
    checkpoint: str | Path, out: str | Path, model: str = "", gguf_file: str = "", dtype: str = "auto"
) -> str:
    """Fold a LoRA checkpoint's adapter into its base model and save a plain Hugging Face model directory at ``out``.

    The base is ``model`` (``gguf_file`` inside it), or by default the run's own ``--model`` from the
    ``config.json`` two levels above the checkpoint. The merge is computed in fp32 (a bf16 base under bf16-mixed
    gets its fp32 adapter's delta unrounded) and saved in ``dtype``: ``auto`` is the base model's own (its
    config.json's; fp32 for a GGUF base, which is dequantised to it). A damaged checkpoint is refused in one line.
    Returns the base.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt, revision = Path(checkpoint), ""
    check_intact(Target(str(ckpt), str(ckpt)))  # a damaged checkpoint: one line naming the file
    if not is_adapter_dir(ckpt):
        raise FileNotFoundError(f"--checkpoint {ckpt}: no adapter_config.json (not a LoRA checkpoint)")
    if not model:
        run_cfg = run_config_file(ckpt.parent.parent)
        if not run_cfg.is_file():
            raise FileNotFoundError(f"--checkpoint {ckpt}: no run config.json two levels up; pass --model")
        saved = json.loads(run_cfg.read_text())
        model, gguf_file, revision = saved["model"], saved.get("gguf_file", ""), saved.get("revision", "")
    saved_dtype = getattr(torch, base_dtype(model, gguf_file, revision) if dtype == "auto" else dtype)
    policy = load_policy(model, torch.float32, gguf_file=gguf_file, revision=revision)
    merged = load_lora(policy.model, ckpt, trainable=False).merge_and_unload().to(saved_dtype)
    merged.save_pretrained(out, safe_serialization=True)
    (policy.processor or policy.tokenizer).save_pretrained(out)
    return model


def base_dtype(model: str, gguf_file: str = "", revision: str = "") -> str:
    """The dtype a base model's own config.json records (``dtype``, or ``torch_dtype`` before transformers 5):
    float32 for a GGUF base (quantised; dequantised to fp32) or a config that names none."""
    from grpolab.models.loading import resolve_gguf
    from grpolab.models.policy import resolve_model_path

    if resolve_gguf(model, gguf_file, revision) is not None:
        return "float32"
    path, _ = resolve_model_path(model, revision)
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return name if name in DTYPES else "float32"
