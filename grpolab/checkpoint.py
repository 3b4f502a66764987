"""Atomic checkpoints: ``checkpoints/step_N/`` holds the policy (safetensors via
``save_pretrained``), optimizer, scheduler and RNG state.

A checkpoint is written to a temporary sibling directory and renamed into
place only when complete, so a run killed while saving leaves the previous
checkpoint as the newest complete one; half-written directories are ignored
and removed on the next save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")
_DONE = "trainer_state.json"  # written last: its presence marks a complete checkpoint


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / _DONE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def save(run_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler, state: dict, keep: int = 0, *,
         model_state: dict | None = None, optimizer_state: dict | None = None) -> Path:
    """Write ``checkpoints/step_{step}`` atomically. ``model_state``/``optimizer_state`` replace the
    model's and optimizer's own state dicts (FSDP: the whole tensors gathered from the shards)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_step_*"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": model_state} if model_state is not None else {}))
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict() if optimizer_state is None else optimizer_state, tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        tmp / "rng.pt",
    )
    with open(tmp / _DONE, "w") as f:
        json.dump({"step": step, **state}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving a step (e.g. after resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep > 0:
        for _, old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _is_sharded(model) -> bool:
    return model is not None and any(hasattr(p, "full_tensor") for p in model.parameters())  # DTensors: FSDP2


def load_training_state(ckpt: Path, optimizer, scheduler, model=None) -> dict:
    """Restore optimizer, scheduler and RNG state; returns the trainer state (``step`` ...).

    ``optimizer.pt`` holds whole tensors, keyed by parameter position (written by one process or
    DDP) or by parameter name (gathered from FSDP shards). Either loads into a plain, DDP or FSDP
    optimizer (``model``: the optimizer's model, needed when names are involved), on any process count.
    """
    saved = torch.load(ckpt / "optimizer.pt", weights_only=False)
    by_name = any(isinstance(p, str) for g in saved.get("param_groups", []) for p in g["params"])
    if by_name or _is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not by_name:  # positions -> names: the optimizer holds the trainable parameters in model order
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            saved = {"state": {names[i]: v for i, v in saved["state"].items()},
                     "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(saved)
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng = torch.load(ckpt / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return json.loads((ckpt / _DONE).read_text())
