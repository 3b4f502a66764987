"""What an environment is: the class a user writes for ``--env FILE.py:Class``, and the checks on it.

Two shapes are read. TRL's (``reset(**row) -> str | None``, ``get_reward()``, public methods as tools) is played
through :mod:`grpolab.env.trl_env`. grpolab's own, in which the environment speaks whole messages and pays rewards
turn by turn::

    class MyEnv:
        def reset(self, record: dict) -> list[dict]:
            # the opening chat messages for this row of --data (every column of the row is there)
            return [{"role": "user", "content": record["question"]}]

        def step(self, text: str) -> tuple[list[dict], float, bool]:
            # the policy's reply in; what the environment says back (role "user" or "tool"), this turn's
            # reward and whether the episode has ended
            return [{"role": "user", "content": "Try again."}], 0.0, False

One instance plays one episode; it is constructed with no arguments. Optional class attributes:

- ``history = True``: the policy sees the whole conversation at every turn (one token sequence per episode). With
  ``False`` each turn's prompt is the opening's system messages and the environment's latest messages alone (a
  Markov observation); the turns are then separate sequences in the update.
- ``max_return = 1.0``: the largest return an episode can earn; an environment task's accuracy is its return divided
  by this (``reward/accuracy``, the held-out accuracy).
- ``tools``: functions the model may call (``grpolab.env.tools``); the chat template shows them to the model.
- ``tool_calls``, ``tool_errors``: counters an environment keeps during its episode, logged as ``env/tool_calls``
  and ``env/tool_errors``.

A wrong shape from ``reset`` or ``step`` is a programming error in the environment: :class:`EnvError`, one line
naming the class, what it returned and what was expected. An exception raised inside ``step`` ends that episode
(counted in ``env/errors``) and the run goes on.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol

from grpolab.common.given import NOTHING, Given
from grpolab.config.train import ConfigError
from grpolab.data.records import is_content

ROLES_FROM_ENV = ("user", "tool", "system")
"""The roles an environment may speak in."""


class EnvError(ConfigError):
    """An environment that cannot be used as written: the message names it."""


class Environment(Protocol):
    """One episode's environment (module docstring)."""

    def reset(self, record: dict) -> list[dict]: ...

    def step(self, text: str) -> tuple[list[dict], float, bool]: ...


def env_name(env_or_class: Any) -> str:
    cls = env_or_class if isinstance(env_or_class, type) else type(env_or_class)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_env_class(cls: Any, spec: str) -> type | dict:
    """``cls`` if it can play episodes, in grpolab's shape (``reset`` and ``step``) or TRL's (``reset`` and no
    ``step``: :mod:`grpolab.env.trl_env`; or a dict of such classes), each constructed with no argument; else
    :class:`EnvError` naming ``spec`` and what each shape needs."""
    if isinstance(cls, dict):
        for name, one in cls.items():
            if not isinstance(name, str) or _shape(one) != "trl":
                raise EnvError(f"--env {spec}: a dict of environments maps names to classes in TRL's shape "
                               f"(reset(**row), no step); {name!r} is not one")  # fmt: skip
            _check_constructor(one, spec)
        return cls
    if not isinstance(cls, type):
        raise EnvError(f"--env {spec}: not a class (got {type(cls).__name__}); give a class with reset and step")
    if _shape(cls) is None:
        raise EnvError(
            f"--env {spec}: {cls.__qualname__} has no reset method, so it fits neither shape of environment: "
            "grpolab's needs reset(record) -> messages and step(text) -> (messages, reward, done); TRL's needs "
            "reset(**row) -> str | None, with an optional get_reward() -> float and public methods as tools"
        )
    _check_constructor(cls, spec)
    return cls


def _shape(cls: Any) -> str | None:
    """``grpolab`` (reset and step), ``trl`` (reset, no step) or None."""
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        return None
    return "grpolab" if callable(getattr(cls, "step", None)) else "trl"


def _check_constructor(cls: type, spec: str) -> None:
    try:
        required = [
            p.name
            for p in inspect.signature(cls).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if required:
        raise EnvError(
            f"--env {spec}: {cls.__qualname__}() needs the argument(s) {', '.join(required)}; one instance plays one "
            "episode and is constructed with no arguments (read settings from the record in reset)"
        )


def load_env_class(spec: str, given: Given = NOTHING) -> type | dict:
    """The environment class ``--env`` names (``file.py:Class`` or ``module:Class``; a class, or a dict of TRL-shape
    classes, ``given`` to the Python API under it), checked."""
    from grpolab.common.loader import load_object

    return check_env_class(load_object(spec, "--env", "Class", given), spec)


def check_messages(messages: Any, where: str, roles: tuple[str, ...]) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with roles among ``roles``; else :class:`EnvError`
    naming ``where`` (e.g. ``MyEnv.step``)."""
    if not isinstance(messages, list):
        raise EnvError(f"{where} returned {type(messages).__name__} for the messages; expected a list of dicts")
    out = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and is_content(m.get("content"))):
            raise EnvError(
                f"{where} returned the message {_short(m)}; each must be {{'role': str, 'content': str}} (or a "
                "content of typed parts, such as {'type': 'image', 'image': ...} beside {'type': 'text', 'text': ...})"
            )
        if m["role"] not in roles:
            raise EnvError(f"{where} returned a message with role {m['role']!r}; allowed: {', '.join(roles)}")
        out.append(dict(m))
    return out


def check_step(result: Any, env: Any) -> tuple[list[dict], float, bool]:
    """What ``env.step`` returned, as ``(messages, reward, done)``; a wrong shape or a non-finite reward is an
    :class:`EnvError` naming the class and the value."""
    where = f"{env_name(env)}.step"
    if not (isinstance(result, tuple | list) and len(result) == 3):
        raise EnvError(f"{where} returned {_short(result)}; expected a tuple (messages, reward, done)")
    messages, reward, done = result
    messages = check_messages(messages, where, ROLES_FROM_ENV)
    if isinstance(reward, bool) or not isinstance(reward, int | float) and not hasattr(reward, "__float__"):
        raise EnvError(f"{where} returned the reward {_short(reward)}; expected a float")
    reward = float(reward)
    if not math.isfinite(reward):
        raise EnvError(f"{where} returned the reward {reward}; it must be finite")
    if not isinstance(done, bool) and type(done).__name__ != "bool_":  # numpy's bool too
        raise EnvError(f"{where} returned done={_short(done)}; expected True or False")
    return messages, reward, bool(done)


def check_reset(result: Any, env: Any) -> list[dict]:
    """What ``env.reset`` returned, as a non-empty list of messages that ends with one the policy answers."""
    where = f"{env_name(env)}.reset"
    messages = check_messages(result, where, ("system", "user", "assistant", "tool"))
    if not messages:
        raise EnvError(f"{where} returned no messages; the episode needs an opening prompt")
    if messages[-1]["role"] == "assistant":
        raise EnvError(f"{where} returned a conversation that ends with an assistant message; the policy speaks next")
    return messages


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


EnvFactory = Callable[[], Any]
"""What makes one episode's environment: the class itself, or a closure for grpolab's own environments."""


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 1
    """Replies per episode; the last one ends it."""
    max_episode_tokens: int = 0
    """Tokens an episode may add after its opening prompt (replies and environment messages); 0 = no bound."""
