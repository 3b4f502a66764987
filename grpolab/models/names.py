"""The built-in models' names and where their weights ship, importable without torch (a command chooses its process
count from them before it relaunches under torchrun)."""

from __future__ import annotations

from pathlib import Path

BUILTIN = "builtin"
BUILTIN_VLM = "builtin-vlm"
"""The built-in vision-language model: a tiny LLaVA fine-tuned on the shapes task (grpolab/assets/shapes-vlm)."""
ASSET_DIR = Path(__file__).parents[1] / "assets" / "arith-sft"  # shipped warm start (see its README)
VLM_ASSET_DIR = Path(__file__).parents[1] / "assets" / "shapes-vlm"  # the built-in vision-language model
