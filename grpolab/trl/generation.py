"""TRL's sampling fields beside temperature and top-p as grpolab's options of the same names: ``top_k``, ``min_p``,
``repetition_penalty``, and the keys of those names in ``generation_kwargs``, which TRL lets override the fields (it
updates its generation arguments with them). grpolab samples from the distribution :mod:`grpolab.models.sampling_rules`
defines, in vLLM's order; any other ``generation_kwargs`` key is refused, as every one was before."""

from __future__ import annotations

from typing import Any

from grpolab.trl.fields import TrlField

GENERATION_KEYS = ("top_k", "min_p", "repetition_penalty")
"""The ``generation_kwargs`` keys grpolab takes."""


def unknown_generation_kwargs(kwargs: Any, field: TrlField | None) -> Any:
    """What of ``generation_kwargs`` grpolab does not take, where its table maps the field (GRPO's and RLOO's; the
    distillation's refuses any): the other keys, or the whole value where it is not a dict (a file's path); else
    None."""
    if kwargs is None or field is None or field.kind != "mapped":
        return None
    return {k: v for k, v in kwargs.items() if k not in GENERATION_KEYS} if isinstance(kwargs, dict) else kwargs


def sampling_options(args) -> dict:
    """``args``' top_k (None, 0 or -1: off), min_p (None: off) and repetition_penalty, each from generation_kwargs
    where that has the key, as grpolab's ``top_k``, ``min_p`` and ``repetition_penalty``."""
    given = {**{k: getattr(args, k) for k in GENERATION_KEYS}, **(args.generation_kwargs or {})}
    top_k, min_p, penalty = (given[k] for k in GENERATION_KEYS)
    return {
        "top_k": 0 if top_k in (None, -1) else int(top_k),
        "min_p": 0.0 if min_p is None else float(min_p),
        "repetition_penalty": 1.0 if penalty is None else float(penalty),
    }
