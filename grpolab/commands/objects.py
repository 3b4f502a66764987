"""Python objects in place of what a flag names: a loaded model, data in memory, a reward function, an environment
class or tools written in a notebook.

A run's configuration stays strings (``--model``, ``--data``, ``--reward-fn`` ...), so that config.json, resume and
the commands that read a run afterwards work one way. An object given to the Python API (:mod:`grpolab.commands.api`) becomes
such a string:

- one that a flag can name is named so: a function importable from a module as ``module:function``;
- any other is described ("reward function defined in a notebook: correct", "data in memory: 200 rows, sha256 ...",
  "model object: LlamaForCausalLM (path)") and *registered* under its description while the call runs.

The loaders that read a flag's string (:func:`grpolab.common.loader.load_object`, :func:`grpolab.data.dataset.read_rows`,
:func:`grpolab.models.policy.load_policy`) look the string up here first, so an object takes the very code path that its
file or module would, and the object itself (not a copy) is what is used. A description whose object was not given
again (a resumed run, a probe of the run) is a one-line :class:`grpolab.common.errors.ConfigError` saying to pass it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from collections.abc import Iterator

from grpolab.common.errors import ConfigError

# The config fields that may name an object, by their flag.
OBJECT_FLAGS = {
    "model": "--model",
    "data": "--data",
    "eval_data": "--eval-data",
    "reward_fn": "--reward-fn",
    "eval_reward_fn": "--eval-reward-fn",
    "env": "--env",
    "tools": "--tools",
}
# What each flag's object is passed as in the Python API (for the message that asks for it again).
KEYWORDS = {
    "--model": "model",
    "--data": "train_dataset",
    "--eval-data": "eval_dataset",
    "--data/--eval-data": "train_dataset/eval_dataset",
    "--reward-fn": "reward_funcs",
    "--eval-reward-fn": "eval_reward_func",
    "--env": "env",
    "--tools": "tools",
}
# The words every description holds; a string with one of them was an object's, not a path or module name.
MARKERS = ("defined in a notebook: ", "defined in Python: ", "data in memory: ", "model object: ")

_LIVE: dict[str, object] = {}


@contextlib.contextmanager
def registered() -> Iterator[dict[str, object]]:
    """The objects registered inside the block are forgotten when it ends (the API registers a call's objects in
    one). Nested blocks share the registry; only the outermost clears it."""
    before = dict(_LIVE)
    try:
        yield _LIVE
    finally:
        _LIVE.clear()
        _LIVE.update(before)


def is_description(spec: object) -> bool:
    """Whether ``spec`` is the description of an object rather than a path or a module name."""
    return isinstance(spec, str) and any(m in spec for m in MARKERS)


def lookup(spec: object, flag: str) -> object | None:
    """The object registered as ``spec``; None when ``spec`` is an ordinary path or name; a ConfigError naming
    ``flag`` when ``spec`` describes an object that was not given in this call."""
    if not isinstance(spec, str):
        return None
    if spec in _LIVE:
        return _LIVE[spec]
    if is_description(spec):
        raise ConfigError(f"{flag}: {spec}: a Python object, not saved with the run; {pass_again(flag)}")
    return None


def is_registered(spec: str) -> bool:
    """Whether an object was given under ``spec`` in this call."""
    return spec in _LIVE


def pass_again(flag: str) -> str:
    """How to give a flag's object again, for messages."""
    return f"pass the same object again (grpolab.train/evaluate(..., {KEYWORDS.get(flag, flag)}=...))"


def _register(description: str, obj: object) -> str:
    """Register ``obj`` under ``description`` (made unique when another object holds it)."""
    name, k = description, 2
    while name in _LIVE and _LIVE[name] is not obj:
        name, k = f"{description} #{k}", k + 1
    _LIVE[name] = obj
    return name


def importable_name(obj: object) -> str | None:
    """``module:name`` when ``obj`` is reachable under that name by importing its module (so a subprocess, a resumed
    run or the CLI can load it again), else None. A notebook's or a script's ``__main__`` never is: importing a
    script again would run it."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "." in qualname:
        return None
    try:
        found = getattr(importlib.import_module(module), qualname, None)
    except Exception:  # noqa: BLE001 - a module that fails to import again is not importable
        return None
    return f"{module}:{qualname}" if found is obj else None


def callable_spec(obj: object, kind: str, flag: str) -> str:
    """The string ``flag`` takes for a function or class ``obj`` (``kind``: "reward function", "environment",
    "tool"): its ``module:name`` when importable, else a registered description."""
    if isinstance(obj, str):
        return obj
    if not callable(obj):
        raise ConfigError(f"{flag}: expected a {kind} or a 'module:name' string, got {obj!r}")
    spec = importable_name(obj)
    if spec is not None:
        return spec
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    where = f"defined in a notebook: {qualname}" if module == "__main__" else f"defined in Python: {module}.{qualname}"
    return _register(f"{kind} {where}", obj)


def object_name(spec: str) -> str:
    """A short name for what ``spec`` names: a registered object's ``__name__``, else the part after the colon
    (``mod:correct`` -> ``correct``). Reward metrics are named by it."""
    obj = _LIVE.get(spec)
    if obj is not None:
        return getattr(obj, "__name__", None) or type(obj).__name__
    return spec.rpartition(":")[2]


def data_rows(data: object, keyword: str) -> list[dict]:
    """The rows of in-memory data: a ``datasets.Dataset`` (or a DatasetDict of one split), a list of dicts."""
    import datasets

    if isinstance(data, datasets.DatasetDict):
        splits = list(data.keys())
        if len(splits) != 1:
            raise ConfigError(f"{keyword}: a DatasetDict of splits {', '.join(splits)}; pass one, e.g. ds['train']")
        data = data[splits[0]]
    if isinstance(data, datasets.Dataset):
        rows = data.to_list()
    elif isinstance(data, list | tuple):
        rows = list(data)
    else:
        raise ConfigError(
            f"{keyword}: expected a datasets.Dataset, a list of dicts or a path, got {type(data).__name__}"
        )
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ConfigError(f"{keyword}: row {bad + 1} is a {type(rows[bad]).__name__}, not a dict")
    if not rows:
        raise ConfigError(f"{keyword}: no rows")
    return rows


def data_spec(data: object, keyword: str) -> str:
    """The string ``--data`` takes for ``data``: a path as it is, else a registered description of the rows that
    holds their number and a hash of their content (a resumed run checks it is given the same rows)."""
    if isinstance(data, str) or hasattr(data, "__fspath__"):
        return str(data)
    rows = data_rows(data, keyword)
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return _register(f"data in memory: {len(rows)} rows, sha256 {digest}", rows)


def model_spec(model: object, tokenizer: object | None) -> str:
    """The string ``--model`` takes for ``model``: a path or name as it is; a loaded transformers model (or a
    :class:`grpolab.models.policy.Policy`, e.g. a finished run's) registered with its tokenizer."""
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        if tokenizer is not None:
            raise ConfigError("tokenizer: only with a loaded model object (a path brings its own tokenizer)")
        return str(model)
    if hasattr(model, "tokenizer") and hasattr(model, "model") and not hasattr(model, "parameters"):  # a Policy
        tokenizer, model = tokenizer or model.tokenizer, model.model
    if not hasattr(model, "parameters") or not callable(model):
        raise ConfigError(f"model: expected a path, a name or a loaded model, got {type(model).__name__}")
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if tokenizer is None:
        raise ConfigError(
            f"tokenizer: a loaded model needs its tokenizer: grpolab.train(model=model, tokenizer=tokenizer, ...)"
            f" ({type(model).__name__}{' from ' + name if name else ''})"
        )
    return _register(f"model object: {type(model).__name__}" + (f" ({name})" if name else ""), (model, tokenizer))


def weights_fingerprint(model) -> str:
    """A fingerprint of ``model``'s weights (per-tensor sums and absolute sums in float64, hashed): recorded with a
    run started from a model object, so that resuming it can tell the starting weights (the KL reference) from
    trained ones. One pass over the weights; not a cryptographic digest of them."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point():
                d = p.detach().double()
                h.update(f"{name}:{d.sum().item():.17g}:{d.abs().sum().item():.17g};".encode())
    return h.hexdigest()[:16]
