"""Loading what a user names on the command line: ``module:name`` or ``path/to/file.py:name``.

Reward functions (``--reward-fn``), environments (``--env``) and tools (``--tools``) are all named this way; a
name that cannot be loaded is one line naming the flag and the reason (a :class:`grpolab.common.errors.ConfigError`).
The Python API's objects are found under the names it gave them (:class:`grpolab.common.given.Given`).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from grpolab.common.errors import ConfigError  # a ValueError: the CLI prints it as one line
from grpolab.common.given import NOTHING, Given


def split_spec(spec: str) -> tuple[str, str]:
    """``(module or file, attribute)`` of ``"mod:attr"`` or ``"path/file.py:attr"`` (``C:\\x.py:attr`` too); empty
    parts when the spec has no colon."""
    module, _, attr = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
    return module, attr


def load_object(spec: str, flag: str, what: str = "object", given: Given = NOTHING) -> object:
    """The object ``spec`` names (``module:name`` or ``file.py:name``; an object ``given`` to the Python API under
    it); a ConfigError naming ``flag`` otherwise.

    A file is imported under its own module name (its stem) without putting its directory on the path (a tool's
    worker process loads it again from the same spec).
    """
    live = given.lookup(spec, flag)  # an object given to the Python API under this name
    if live is not None:
        return live
    module_name, attr = split_spec(spec)
    if not module_name or not attr:
        raise ConfigError(f"{flag}: must be given as 'module:{what}' or 'path/to/file.py:{what}', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise ConfigError(f"{flag}: cannot load {spec!r}: {type(e).__name__}: {e}") from None


def _module_from_file(path: Path):
    if not path.is_file():
        raise ImportError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
