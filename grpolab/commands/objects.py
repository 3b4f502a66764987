"""Python objects in place of what an option names, named once at the Python API's edge.

A run's options stay strings (``--model``, ``--data``, ``--reward-fn`` ...), so that config.json, resume and the
commands that read a run afterwards work one way. :class:`ObjectNames` turns each object given to one call of the
Python API (:mod:`grpolab.commands.api`) into such a string:

- one that a flag can name is named so: a function importable from a module as ``module:function``;
- any other is described ("reward function defined in a notebook: correct", "data in memory: 200 rows, sha256 ...",
  "model object: LlamaForCausalLM (path)") and kept under its description.

What it kept is the call's :class:`grpolab.common.given.Given`, passed beside the config to the command; the loaders
below (:func:`grpolab.common.loader.load_object`, :func:`grpolab.data.dataset.read_rows`,
:func:`grpolab.models.policy.load_policy`) look an option's string up there first, so an object takes the very code
path its file or module would, and the object itself (not a copy) is what is used.
"""

from __future__ import annotations

import hashlib
import importlib
import json

from grpolab.common.errors import ConfigError
from grpolab.common.given import Given
from grpolab.config import fields


class ObjectNames:
    """The objects of one call of the Python API, named: :meth:`callable_spec`, :meth:`data_spec` and
    :meth:`model_spec` give an object's string and keep it; :meth:`given` is what the call passes on. ``config``:
    the config class of the call's command (its object options name the keywords of the messages)."""

    def __init__(self, config):
        self.objects: dict[str, object] = {}
        keywords = {"--" + name.replace("_", "-"): kw for name, (_, kw) in fields.object_options(config).items()}
        self.keywords = {**keywords, "--data/--eval-data": "train_dataset/eval_dataset"}

    def given(self) -> Given:
        return Given(dict(self.objects), self.keywords)

    def _keep(self, description: str, obj: object) -> str:
        """Keep ``obj`` under ``description`` (made unique when another object holds it)."""
        name, k = description, 2
        while name in self.objects and self.objects[name] is not obj:
            name, k = f"{description} #{k}", k + 1
        self.objects[name] = obj
        return name

    def callable_spec(self, obj: object, kind: str, flag: str) -> str:
        """The string ``flag`` takes for a function or class ``obj`` (``kind``: "reward function", "environment",
        "tool"): its ``module:name`` when importable, else a kept description."""
        if isinstance(obj, str):
            return obj
        if kind == "environment" and isinstance(obj, dict):  # TRL's dict of environment classes, routed by a column
            described = ", ".join(f"{k}: {getattr(v, '__qualname__', v)}" for k, v in obj.items())
            return self._keep(f"environments defined in Python: {{{described}}}", obj)
        if not callable(obj):
            raise ConfigError(f"{flag}: expected a {kind} or a 'module:name' string, got {obj!r}")
        spec = importable_name(obj)
        if spec is not None:
            return spec
        qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
        module = getattr(obj, "__module__", None) or type(obj).__module__
        where = (
            f"defined in a notebook: {qualname}" if module == "__main__" else f"defined in Python: {module}.{qualname}"
        )
        return self._keep(f"{kind} {where}", obj)

    def data_spec(self, data: object, keyword: str) -> str:
        """The string ``--data`` takes for ``data``: a path as it is, else a kept description of the rows that holds
        their number and a hash of their content (a resumed run checks it is given the same rows)."""
        if isinstance(data, str) or hasattr(data, "__fspath__"):
            return str(data)
        rows = data_rows(data, keyword)
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return self._keep(f"data in memory: {len(rows)} rows, sha256 {digest}", rows)

    def model_spec(self, model: object, tokenizer: object | None) -> str:
        """The string ``--model`` takes for ``model``: a path or name as it is; a loaded transformers model (or a
        :class:`grpolab.models.policy.Policy`, e.g. a finished run's) kept with its tokenizer."""
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
        return self._keep(f"model object: {type(model).__name__}" + (f" ({name})" if name else ""), (model, tokenizer))

    def reward_model_spec(self, value: object) -> str:
        """The string ``--reward-model`` takes for ``value``: a directory or Hub id as it is; a loaded model, or
        ``(model, tokenizer)`` (its tokenizer, or None: loaded from the model's path), kept under a description."""
        if isinstance(value, str) or hasattr(value, "__fspath__"):
            return str(value)
        model, tokenizer = value if isinstance(value, tuple) else (value, None)
        if isinstance(model, str) or hasattr(model, "__fspath__"):  # a path or id, and the tokenizer to score with
            described = f"reward model {model} with a tokenizer defined in Python: {type(tokenizer).__name__} ({model})"
            return self._keep(described, (str(model), tokenizer))
        if not hasattr(model, "parameters") or not hasattr(model, "config"):
            raise ConfigError(f"--reward-model: expected a directory, a Hub id or a loaded model, got {model!r}")
        name = getattr(model.config, "_name_or_path", "")
        if tokenizer is None and not name:
            raise ConfigError(
                f"reward_processing_classes: the {type(model).__name__} given as a reward model names no path to load "
                "its tokenizer from; pass it (reward_processing_classes=[...])"
            )
        described = f"reward model object: {type(model).__name__}" + (f" ({name})" if name else "")
        return self._keep(described, (model, tokenizer))


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
