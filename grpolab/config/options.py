"""A command's options, given as Python keywords or as command-line flags, checked one way.

Each command's options are one dataclass (``grpolab.config.train.TrainConfig``, ``EvalConfig``, the probes' configs).
The CLI parses flags into it with tyro; the Python API (:mod:`grpolab.commands.api`) takes the same fields as keywords. A
wrong name or a value of the wrong type is the same one-line :class:`grpolab.config.train.ConfigError` either way
(``--group-size: expected an integer, got 'eight'``): the CLI checks the flags' text with :func:`check_flags` before
tyro sees them, the API checks its keywords with :func:`config_from`. What the types let through, each config's
``validate`` then checks, again the same for both.

Written here rather than left to tyro: tyro reports a bad flag in a multi-line box and exits, where a Python caller
needs an exception, and both need the same words.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing

from grpolab.common.errors import ConfigError
from grpolab.config import fields as config_fields

_WHAT = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def flag(name: str) -> str:
    """``group_size`` -> ``--group-size``."""
    return "--" + name.replace("_", "-")


def field_types(cls) -> dict[str, object]:
    """Option name -> its type, for a config dataclass (sections' options by their own names)."""
    return {name: opt.type for name, opt in config_fields.options(cls).items()}


def _nested_types(cls) -> dict[str, object]:
    """``outer.inner`` -> type, for the options of a dataclass a config nests without making it a section (sft's
    ``--model.hidden-size``: tyro names them so)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = hints[f.name]
        if dataclasses.is_dataclass(inner) and not config_fields.is_section(f):
            out |= {f"{f.name}.{g}": tp for g, tp in typing.get_type_hints(inner).items()}
    return out


def unknown(cls, name: str, command: str) -> ConfigError:
    """The error for an option ``command``'s config ``cls`` does not have, with the nearest names."""
    near = difflib.get_close_matches(name, list(field_types(cls)), n=2, cutoff=0.7)
    hint = f"; did you mean {' or '.join(flag(n) for n in near)}?" if near else f"; see grpolab {command} --help"
    return ConfigError(f"{flag(name)}: no such option of grpolab {command}{hint}")


def _union_args(tp) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def coerce(tp, value, name: str, text: bool = False):
    """``value`` as field type ``tp`` (``text``: as a flag's word, e.g. ``"8"`` for an int), or a ConfigError naming
    the option. Python values are taken as they are, never parsed from strings: ``group_size="8"`` is refused."""
    args = _union_args(tp)
    if args is not None:
        if (value is None or (text and value == "None")) and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(arg, value, name, text)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if value == c or (text and value == str(c)):
                return c
        raise ConfigError(f"{flag(name)}: must be one of {', '.join(map(str, choices))}, got {value!r}")
    if typing.get_origin(tp) is tuple:
        return _coerce_tuple(typing.get_args(tp)[0], value, name, text)
    return _coerce_scalar(tp, value, name, text)


def _coerce_tuple(elem, value, name: str, text: bool) -> tuple:
    if text or (isinstance(value, str) and elem is str):
        value = [value]  # a flag's words come one at a time; a lone string is a list of one
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{flag(name)}: expected a list of {_WHAT.get(elem, elem)}s, got {value!r}")
    return tuple(coerce(elem, v, name, text) for v in value)


def _coerce_scalar(tp, value, name: str, text: bool):
    try:
        if text:
            return tp(value) if tp in (int, float) else value
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if tp is str and isinstance(value, str | os.PathLike):
            return os.fspath(value)
    except ValueError:
        pass
    raise ConfigError(f"{flag(name)}: expected {_WHAT.get(tp, tp)}, got {value!r}")


def config_from(cls, fields: dict, command: str, base=None):
    """``cls`` (a config dataclass) with ``fields`` (Python keywords) over ``base`` (default: the defaults), every
    name and type checked; the config's own ``validate`` runs later, where the command runs."""
    types_ = field_types(cls)
    checked = {}
    for name, value in fields.items():
        if name not in types_:
            raise unknown(cls, name, command)
        checked[name] = coerce(types_[name], value, name)
    return config_fields.replace(base if base is not None else cls(), **checked)


def check_flags(cls, args: list[str], command: str) -> None:
    """The flags in ``args`` (tyro's ``--name value ...`` form) name options of ``cls`` and their words have the
    option's type; else the ConfigError :func:`config_from` gives for the same keyword."""
    types_ = field_types(cls) | _nested_types(cls)
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("--") or a in ("--help",):
            continue
        name, eq, word = a[2:].partition("=")
        name = name.replace("-", "_")
        if name not in types_:
            if name.startswith("no_") and types_.get(name[3:]) is bool:
                continue
            raise unknown(cls, name, command)
        words = [word] if eq else []
        while not eq and i < len(args) and not args[i].startswith("--"):
            words.append(args[i])
            i += 1
        if types_[name] is bool and not words:
            continue
        for w in words:
            tp = types_[name]
            coerce(typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp, w, name, text=True)
