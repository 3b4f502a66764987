"""``grpolab merge``: a LoRA checkpoint's adapter folded into its base model, saved as a plain model directory."""

from __future__ import annotations

import json
from pathlib import Path

from grpolab.eval.runs import Target, check_intact
from grpolab.models.lora import is_adapter_dir, load_lora
from grpolab.models.policy import load_policy


def merge_checkpoint(checkpoint: str | Path, out: str | Path, model: str = "", gguf_file: str = "") -> str:
    """Fold a LoRA checkpoint's adapter into its base model and save a plain Hugging Face model directory at ``out``.

    The base is ``model`` (``gguf_file`` inside it), or by default the run's own ``--model`` from the
    ``config.json`` two levels above the checkpoint. A damaged checkpoint is refused in one line. Returns the base.
    """
    ckpt, revision = Path(checkpoint), ""
    check_intact(Target(str(ckpt), str(ckpt)))  # a damaged checkpoint: one line naming the file
    if not is_adapter_dir(ckpt):
        raise FileNotFoundError(f"--checkpoint {ckpt}: no adapter_config.json (not a LoRA checkpoint)")
    if not model:
        run_cfg = ckpt.parent.parent / "config.json"
        if not run_cfg.is_file():
            raise FileNotFoundError(f"--checkpoint {ckpt}: no run config.json two levels up; pass --model")
        saved = json.loads(run_cfg.read_text())
        model, gguf_file, revision = saved["model"], saved.get("gguf_file", ""), saved.get("revision", "")
    policy = load_policy(model, gguf_file=gguf_file, revision=revision)
    merged = load_lora(policy.model, ckpt, trainable=False).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    policy.tokenizer.save_pretrained(out)
    return model
