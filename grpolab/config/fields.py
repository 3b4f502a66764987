"""The flat view of a sectioned config: every option by its own name, as flags, keywords, TOML and config.json name it.

A command's config is a frozen dataclass whose fields are *sections* (frozen dataclasses of one concern, e.g.
:class:`grpolab.config.rollout.SamplingSection`) and, for options only that command has, plain fields. Option names
are unique across a config's sections, so each has one flat name (``group_size``) however deep it sits
(``cfg.groups.group_size``). This module derives that view from the dataclasses themselves; no list of names is kept
anywhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, NamedTuple

from grpolab.common.errors import ConfigError


class Option(NamedTuple):
    """Where an option lives in a config class, and its type."""

    section: str | None
    """The config's field that holds it (a section), or None for the config's own field."""
    field: dataclasses.Field
    type: Any


def is_section(f: dataclasses.Field) -> bool:
    """Whether a config field is a section: a dataclass-typed field whose default is an instance of it."""
    return dataclasses.is_dataclass(f.default) and not isinstance(f.default, type)


@functools.cache
def options(cls) -> dict[str, Option]:
    """Flat name -> :class:`Option` of every option of the config class ``cls``, sections' fields included."""
    out: dict[str, Option] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_section(f):
            section_hints = typing.get_type_hints(type(f.default))
            for g in dataclasses.fields(f.default):
                assert g.name not in out, f"{cls.__name__}: option {g.name} in two sections"
                out[g.name] = Option(f.name, g, section_hints[g.name])
        else:
            assert f.name not in out, f"{cls.__name__}: option {f.name} twice"
            out[f.name] = Option(None, f, hints[f.name])
    return out


def sections(cls) -> dict[str, type]:
    """Section field name -> section class, in declaration order."""
    return {f.name: type(f.default) for f in dataclasses.fields(cls) if is_section(f)}


def get(cfg, name: str):
    """The value of option ``name`` in ``cfg``."""
    opt = options(type(cfg))[name]
    return getattr(cfg if opt.section is None else getattr(cfg, opt.section), name)


def to_flat(cfg) -> dict:
    """Every option of ``cfg`` by its flat name (what config.json and ``--config`` TOML files hold)."""
    return {name: get(cfg, name) for name in options(type(cfg))}


def replace(cfg, **values):
    """``cfg`` with the options ``values`` (flat names) changed; a TypeError names an unknown one."""
    opts = options(type(cfg))
    own: dict = {}
    by_section: dict[str, dict] = {}
    for name, value in values.items():
        if name not in opts:
            raise TypeError(f"{type(cfg).__name__} has no option {name!r}")
        section = opts[name].section
        (own if section is None else by_section.setdefault(section, {}))[name] = value
    for section, changed in by_section.items():
        own[section] = dataclasses.replace(getattr(cfg, section), **changed)
    return dataclasses.replace(cfg, **own) if own else cfg


def from_flat(cls, values: dict, *, base=None, known_only: bool = True):
    """A ``cls`` from flat ``values`` over ``base`` (default: the defaults). Lists become tuples (JSON and TOML have
    no tuples). ``known_only``: values of names ``cls`` does not have are skipped (config.json also records facts of
    the run, such as its process count); else they are a ConfigError."""
    opts = options(cls)
    unknown = sorted(set(values) - set(opts))
    if unknown and not known_only:
        raise ConfigError(f"unknown option(s) {unknown}")
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in opts}
    return replace(base if base is not None else cls(), **given)


def init_sections(obj, given: dict) -> None:
    """The ``__init__`` of a sectioned config class: sections (and own options) by their field name, a section's
    options also by their flat name (``TrainConfig(steps=50, group_size=8)``); the rest their defaults."""
    cls = type(obj)
    own = {f.name: f for f in dataclasses.fields(cls)}
    opts = options(cls)
    changed: dict[str, dict] = {}
    for name, value in given.items():
        if name in own:
            continue
        if name not in opts:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
        changed.setdefault(opts[name].section, {})[name] = value
    for name, f in own.items():
        if name in given:
            value = given[name]
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        if name in changed:
            value = dataclasses.replace(value, **changed[name])
        object.__setattr__(obj, name, value)


def bad(name: str, msg: str) -> ConfigError:
    """The one-line error for option ``name``: ``--group-size: must be >= 1, got 0``."""
    return ConfigError(f"--{name.replace('_', '-')}: {msg}")


def check_counts(section, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """The ``positive`` options of ``section`` are >= 1 and the ``non_negative`` ones >= 0 (None: not yet set)."""
    for name in positive:
        value = getattr(section, name)
        if value is not None and value < 1:
            raise bad(name, f"must be >= 1, got {value}")
    for name in non_negative:
        value = getattr(section, name)
        if value is not None and value < 0:
            raise bad(name, f"must be >= 0, got {value}")


def options_of(section_cls) -> tuple[str, ...]:
    """The option names a section class holds."""
    return tuple(f.name for f in dataclasses.fields(section_cls))


# Metadata of a command's option (or section) whose default, for a run, is the run's own value: ``grpolab eval
# --model RUN`` asks the run's questions in its prompt format, a probe samples as the run sampled.
FROM_RUN = {"from_run": True}


@functools.cache
def from_run(cls) -> frozenset[str]:
    """The options of ``cls`` that take a run's value: own fields marked :data:`FROM_RUN`, and every option of a
    section field so marked."""
    out = set()
    for f in dataclasses.fields(cls):
        if f.metadata.get("from_run"):
            out |= set(options_of(type(f.default))) if is_section(f) else {f.name}
    return frozenset(out)


def with_run(cls, run_config: dict, base=None):
    """``base`` (default: ``cls``'s defaults) with each :func:`from_run` option that the run's config.json
    (``run_config``, flat) holds set to the run's value."""
    return from_flat(cls, {k: v for k, v in run_config.items() if k in from_run(cls)}, base=base)


def sectioned(cls):
    """Make ``cls`` a frozen dataclass of sections (and own options) whose constructor also takes a section's
    options by their own names: ``TrainConfig(steps=50, group_size=8)`` as well as ``TrainConfig(run=...)``."""

    def __init__(self, **given):
        init_sections(self, given)

    cls.__init__ = __init__
    return dataclasses.dataclass(frozen=True, init=False)(cls)


def takes_object(kind: str, keyword: str) -> dict:
    """Metadata of an option that may name a Python object (``kind``: "model", "data", "reward function",
    "environment", "tool"), given to the Python API as ``keyword`` (TRL's name for it where TRL has one)."""
    return {"object": kind, "keyword": keyword}


@functools.cache
def object_options(cls) -> dict[str, tuple[str, str]]:
    """Option name -> (kind, API keyword) of every option of ``cls`` that may name a Python object."""
    return {
        name: (opt.field.metadata["object"], opt.field.metadata["keyword"])
        for name, opt in options(cls).items()
        if "object" in opt.field.metadata
    }
