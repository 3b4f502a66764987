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


def save(run_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler, state: dict, keep: int = 0) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_step_*"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
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


def load_training_state(ckpt: Path, optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNG state; returns the trainer state (``step`` ...)."""
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng = torch.load(ckpt / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return json.loads((ckpt / _DONE).read_text())
