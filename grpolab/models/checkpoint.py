"""Atomic, verifiable checkpoints: ``checkpoints/step_N/`` holds the policy (safetensors via
``save_pretrained``), optimizer, scheduler and RNG state, and ``manifest.json``.

A checkpoint is written to a temporary sibling directory and renamed into
place only when complete, so a run killed while saving leaves the previous
checkpoint as the newest complete one; half-written directories are ignored
and removed on the next save. The manifest, written last, records every
file's size and SHA-256: :func:`verify` finds a checkpoint damaged after it
was written (a copy cut short, a failing disk), and :func:`newest_intact`
skips such a checkpoint for the previous intact one. A save that fails (no
space left, permission denied) raises :class:`CheckpointError` naming the
directory and the cause, and leaves every earlier checkpoint as it was.
(Hashing by hand with hashlib: safetensors and torch.save record no checksums.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from grpolab.common.errors import CheckpointError  # noqa: F401 - raised here, re-exported
from grpolab.common.rng import rng_state, set_rng_state

_STEP_DIR = re.compile(r"^step_(\d+)$")
_DONE = "trainer_state.json"  # present in every complete checkpoint (the only marker before manifests)
MANIFEST = "manifest.json"  # written last: sizes and SHA-256 of every other file
_REQUIRED = ("optimizer.pt", "scheduler.pt", "rng.pt", _DONE)  # besides the weights


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: Path) -> None:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    with open(ckpt / MANIFEST, "w") as f:
        json.dump({"format": 1, "files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify(ckpt: str | Path) -> str | None:
    """None if the checkpoint is intact, else one line saying which file is wrong and how.

    With a manifest: every file it lists has its size and SHA-256. Without one (checkpoints
    written before manifests): the files a checkpoint needs are there and the weights' header parses.
    """
    ckpt = Path(ckpt)
    manifest = ckpt / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
            items = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{manifest}: unreadable ({type(e).__name__})"
        for name, size, digest in items:
            path = ckpt / name
            if not path.is_file():
                return f"{path}: missing"
            if path.stat().st_size != size:
                return f"{path}: {path.stat().st_size} bytes, the manifest says {size}"
            if _sha256(path) != digest:
                return f"{path}: contents differ from the manifest (checksum)"
        return None
    for name in _REQUIRED:
        if not (ckpt / name).is_file():
            return f"{ckpt / name}: missing"
    weights = sorted(ckpt.glob("*.safetensors"))
    if not weights:
        return f"{ckpt}: no weights (*.safetensors)"
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            return f"{w}: unreadable ({str(e).splitlines()[0][:80]})"
    return None


def newest_intact(run_dir: str | Path, warn=print) -> tuple[int, Path]:
    """The newest checkpoint that :func:`verify` passes; each damaged newer one is named in a warning.
    Raises :class:`CheckpointError` when there is none."""
    ckpts = checkpoint_dirs(run_dir)
    if not ckpts:
        raise CheckpointError(f"no complete checkpoint in {Path(run_dir) / 'checkpoints'}")
    damaged = []
    for step, path in reversed(ckpts):
        problem = verify(path)
        if problem is None:
            if damaged:
                warn(
                    f"warning: checkpoint step_{damaged[0][0]} is damaged ({damaged[0][1]}); "
                    + (f"{len(damaged) - 1} more damaged; " if len(damaged) > 1 else "")
                    + f"resuming from step_{step}"
                )
            return step, path
        damaged.append((step, problem))
    raise CheckpointError(
        f"no intact checkpoint in {Path(run_dir) / 'checkpoints'} (newest, step_{damaged[0][0]}: {damaged[0][1]})"
    )


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and ((d / _DONE).is_file() or (d / MANIFEST).is_file()):
            found.append((int(m.group(1)), d))
    return sorted(found)


def save(
    run_dir: str | Path,
    step: int,
    model,
    tokenizer,
    optimizer,
    scheduler,
    state: dict,
    keep: int = 0,
    *,
    model_state: dict | None = None,
    optimizer_state: dict | None = None,
    tensors: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``checkpoints/step_{step}`` atomically. ``model_state``/``optimizer_state`` replace the
    model's and optimizer's own state dicts (FSDP: the whole tensors gathered from the shards); ``tensors``: more
    safetensors files to keep beside them, by file name (read back with :func:`load_tensors`)."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp_step_{step}"
    try:
        return _save(
            root, tmp, step, model, tokenizer, optimizer, scheduler, state, keep, run_dir, model_state, optimizer_state,
            tensors or {},
        )  # fmt: skip
    except OSError as e:  # a full disk, a read-only or vanished directory: earlier checkpoints are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint step_{step} in {root}: {e.strerror or e}") from e


def _save(
    root: Path,
    tmp: Path,
    step: int,
    model,
    tokenizer,
    optimizer,
    scheduler,
    state: dict,
    keep: int,
    run_dir,
    model_state,
    optimizer_state,
    tensors: dict[str, dict[str, torch.Tensor]],
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_step_*"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step}"
    tmp.mkdir()
    model.save_pretrained(
        tmp, safe_serialization=True, **({"state_dict": model_state} if model_state is not None else {})
    )
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict() if optimizer_state is None else optimizer_state, tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    for name, named in tensors.items():  # each tensor its own (safetensors refuses shared storage)
        safetensors.torch.save_file({k: v.detach().contiguous().clone() for k, v in named.items()}, tmp / name)
    with open(tmp / _DONE, "w") as f:
        json.dump({"step": step, **state}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    write_manifest(tmp)
    if final.exists():  # re-saving a step (e.g. after resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep > 0:
        for _, old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_tensors(ckpt: Path, name: str) -> dict[str, torch.Tensor]:
    """A safetensors file that :func:`save` kept beside the model (``tensors``)."""
    return safetensors.torch.load_file(Path(ckpt) / name)


def _is_sharded(model) -> bool:
    return model is not None and any(hasattr(p, "full_tensor") for p in model.parameters())  # DTensors: FSDP2


def load_training_state(ckpt: Path, optimizer, scheduler, model=None) -> dict:
    """Restore optimizer, scheduler and RNG state; returns the trainer state (``step`` ...).

    ``optimizer.pt`` holds whole tensors, keyed by parameter position (written by one process or
    DDP) or by parameter name (gathered from FSDP shards). Either loads into a plain, DDP or FSDP
    optimizer (``model``: the optimizer's model, needed when names are involved), on any process count.
    """
    saved = _load(ckpt / "optimizer.pt")
    by_name = any(isinstance(p, str) for g in saved.get("param_groups", []) for p in g["params"])
    if by_name or _is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not by_name:  # positions -> names: the optimizer holds the trainable parameters in model order
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            saved = {
                "state": {names[i]: v for i, v in saved["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
            }
        set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(saved)
    scheduler.load_state_dict(_load(ckpt / "scheduler.pt"))
    set_rng_state(_load(ckpt / "rng.pt"))
    return json.loads((ckpt / _DONE).read_text())


def load_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Copy a checkpoint's weights (``model.safetensors``, or the shards its index lists) into ``model`` in place.
    Every tensor of the file must be one of the model's; the model's own that the file lacks must be tied to one it
    has (``save_pretrained`` writes a tied output embedding once)."""
    from safetensors.torch import load_file

    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    state: dict = {}
    for name in files:
        state.update(load_file(ckpt / name))
    missing, unexpected = model.load_state_dict(state, strict=False)
    stored = {t.data_ptr() for n, t in model.state_dict().items() if n in state}
    untied = [n for n in missing if model.state_dict()[n].data_ptr() not in stored]
    if unexpected or untied:
        raise CheckpointError(
            f"{ckpt}: its weights do not fit the model object ({len(unexpected)} unknown tensors, e.g. "
            f"{(unexpected or ['-'])[0]}; {len(untied)} missing, e.g. {(untied or ['-'])[0]})"
        )


# numpy's array reconstruction, for the rng.pt of checkpoints written before rng_state(): it builds arrays of plain
# numbers and calls nothing else.
_reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct  # numpy 2 moved core to _core
_NUMPY_ARRAY_GLOBALS = [
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_reconstruct, "numpy.core.multiarray._reconstruct"),
]


def _load(path: Path):
    """A ``torch.save`` file of tensors and plain values (dict, list, tuple, str, int, float, bool, None), read with
    torch's restricted unpickler (``weights_only=True``): a file holding any other Python object is refused with one
    line, and nothing in it runs. (Unpickling an arbitrary object can run any code its author chose.)"""
    import pickle

    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        detail = str(e).split("\n")[0][:160]
        raise CheckpointError(
            f"{path}: refused: it holds Python objects other than tensors and plain values, and loading them could "
            f"run code from the file ({detail})"
        ) from None


def weights_fingerprint(model) -> str:
    """A fingerprint of ``model``'s weights (per-tensor sums and absolute sums in float64, hashed): recorded with a
    run started from a model object, so that resuming it can tell the starting weights (the KL reference) from
    trained ones. One pass over the weights; not a cryptographic digest of them."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point():
                d = p.detach().double()
                h.update(f"{name}:{d.sum().item():.17g}:{d.abs().sum().item():.17g};".encode())
    return h.hexdigest()[:16]
