"""A grpolab.trl config class held against TRL's own dataclass, field by field: what the drop-ins' table tests share."""

from __future__ import annotations

import dataclasses


def trl_default(f: dataclasses.Field):
    """A dataclass field's default (its factory's value for a list or dict)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def declared_annotation(cls, name: str):
    """``name``'s type as ``cls`` (or the class above it that declares it) annotates it: TRL's parser rewrites the
    dataclass fields' ``type`` when it parses (TrainingArguments' fields, shared by every TRL config)."""
    return next(vars(c)["__annotations__"][name] for c in cls.__mro__ if name in vars(c).get("__annotations__", {}))


def assert_fields_are_trls(ours_cls, trl_cls, table) -> None:
    """``ours_cls`` has ``trl_cls``'s init fields in its order, each in ``table`` (grpolab.trl's TrlField rows) with
    TRL's default, type and parser options, and every field that is not mapped says why."""
    theirs = {f.name: f for f in dataclasses.fields(trl_cls) if f.init}
    ours = {f.name: f for f in dataclasses.fields(ours_cls)}
    by_name = {f.name: f for f in table}
    assert list(ours) == list(theirs) == [f.name for f in table]
    assert {n: by_name[n].default for n in theirs} == {n: trl_default(f) for n, f in theirs.items()}
    assert {n: str(f.type) for n, f in ours.items()} == {n: str(declared_annotation(trl_cls, n)) for n in theirs}

    def options(f) -> dict:
        return {k: list(v) if k == "choices" else v for k, v in f.metadata.items() if k != "help"}

    assert {n: options(f) for n, f in ours.items()} == {n: options(f) for n, f in theirs.items()}
    assert all(f.note for f in table if f.kind != "mapped"), "an inert or refused field says why"
