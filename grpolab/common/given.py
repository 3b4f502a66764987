"""Python objects given in place of what an option names: a loaded model, rows in memory, a reward function, an
environment class or tools written in a notebook.

A run's options stay strings (``--model``, ``--data``, ``--reward-fn`` ...), so that config.json, resume and the
commands that read a run afterwards work one way. The Python API (``grpolab.commands.api``) turns each object it is
given into such a string, once, before anything runs: an importable function's ``module:function``, or else a
description ("reward function defined in a notebook: correct", "data in memory: 200 rows, sha256 ...", "model object:
LlamaForCausalLM (path)"). The objects themselves travel beside the options as a :class:`Given`, under their
descriptions, to whatever loads an option's value (:func:`grpolab.common.loader.load_object`, the data readers, the
policy loader): an object takes the very path its file or module would, and it is the object itself (not a copy)
that is used. A description whose object was not given again (a resumed run, a probe of the run) is a one-line
:class:`grpolab.common.errors.ConfigError` saying to pass it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from grpolab.common.errors import ConfigError

# The words every description holds; a string with one of them was an object's, not a path or a module name.
MARKERS = ("defined in a notebook: ", "defined in Python: ", "data in memory: ", "model object: ")


def is_description(spec: object) -> bool:
    """Whether ``spec`` is the description of an object rather than a path or a module name."""
    return isinstance(spec, str) and any(m in spec for m in MARKERS)


@dataclasses.dataclass(frozen=True)
class Given:
    """The objects one call of the Python API was given, under the descriptions its options record (nothing, for
    the command line)."""

    objects: Mapping[str, object] = dataclasses.field(default_factory=dict)
    keywords: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """flag -> the Python API's keyword for its object (for the message that asks for it again)."""

    def lookup(self, spec: object, flag: str) -> object | None:
        """The object given as ``spec``; None when ``spec`` is an ordinary path or name; a ConfigError naming
        ``flag`` when ``spec`` describes an object that was not given in this call."""
        if not isinstance(spec, str):
            return None
        if spec in self.objects:
            return self.objects[spec]
        if is_description(spec):
            raise ConfigError(f"{flag}: {spec}: a Python object, not saved with the run; {self.pass_again(flag)}")
        return None

    def pass_again(self, flag: str) -> str:
        """How to give a flag's object again, for messages."""
        return f"pass the same object again (grpolab.train/evaluate(..., {self.keywords.get(flag, flag)}=...))"

    def __contains__(self, spec: object) -> bool:
        return spec in self.objects

    def name_of(self, spec: str) -> str:
        """A short name for what ``spec`` names: a given object's ``__name__``, else the part after the colon
        (``mod:correct`` -> ``correct``). Reward metrics are named by it."""
        obj = self.objects.get(spec)
        if obj is not None:
            return getattr(obj, "__name__", None) or type(obj).__name__
        return spec.rpartition(":")[2]


NOTHING = Given()
"""No object: every option's value is loaded as a flag's is."""
