"""TRL's environment classes, as they are (the shape of ``GRPOTrainer(environment_factory=...)``)::

    class IncrementEnv:
        def reset(self, **kwargs) -> str | None:  # the row's columns as keywords; a string joins the prompt
            ...
        def get_reward(self) -> float:  # optional, sync or async: the episode's score, from the env's own state
            ...
        def increment(self, step: int) -> int:  # every other public method: a tool the model may call
            '''Increment the counter.

            Args:
                step: Value to add to the counter.
            '''

:class:`TrlEnvironment` plays one episode of such a class in grpolab's own ``reset(record)`` / ``step(text)`` shape,
so both shapes go through the same episode runner, trainer and engines:

- ``reset(**row)``: every column of the row as a keyword (``prompt`` too, as TRL passes it). A returned string is
  appended to the last prompt message, TRL's rule; with no prompt in the row it is the user message.
- **Tools**: every public function of the class but ``reset`` and ``get_reward``, described by transformers'
  ``get_json_schema`` (type hints, a docstring with ``Args:``) and shown through the chat template as ``--tools``
  are. Calls are parsed as ``--tools`` calls are (:func:`grpolab.env.tools.parse_tool_calls`) and run in this process
  on the episode's own instance (a method's state is the environment's, so it cannot run in a worker process as
  ``--tools`` do), ``async def`` ones awaited; an exception goes back to the model as an error line and counts in
  ``env/tool_errors``. A reply that calls no tool ends the episode.
- **get_reward** is the environment's reward, paid as it changes: turn t earns ``get_reward()`` after it minus
  ``get_reward()`` after turn t-1 (0 before the first), so an episode's return is ``get_reward()`` at its end however
  it ended (no more tool calls, ``--max-turns``, ``--max-episode-tokens``). The return is summed with the
  ``--reward-fn`` functions' rewards, as TRL sums them, and is the held-out accuracy when there are none.
- **environments=**: TRL-form reward functions that take it (or ``**kwargs``) get the TRL instance of each
  completion, in the order of the completions.
- **A dict** ``{name: class}`` (Python API) routes each row by its ``environment`` column, which ``reset`` does not
  get; each episode's prompt shows its own class's tools only.
- **Self-sampling** (no ``--data``): each group's record is ``{"task_seed": k}``, k drawn from the run's seed and
  the step (:class:`grpolab.data.task.SeedSampler`). ``reset`` is called with no keyword and with Python's ``random``
  and NumPy's global generator seeded from k, their state restored after: the G members of a group draw the same
  task, different groups different ones, and the run's other random streams are untouched. TRL leaves it to the
  user to keep a group on one task; an environment that draws its task another way must derive it from the same k.
"""

from __future__ import annotations

import inspect
import math
import random
from typing import Any

import numpy as np

from grpolab.data.task import TASK_SEED
from grpolab.env.protocol import EnvError
from grpolab.env.tool_worker import answer, resolved
from grpolab.env.tools import ToolCall, parse_tool_calls

RESERVED = ("reset", "get_reward")
"""TRL's reserved methods: never tools."""
ROUTE = "environment"
MAX_CHARS = 2000


def is_trl_shape(cls: Any) -> bool:
    """A class with ``reset`` and no ``step`` (TRL's shape), or a dict of them."""
    if isinstance(cls, dict):
        return True
    return callable(getattr(cls, "reset", None)) and not callable(getattr(cls, "step", None))


def tool_names(cls: type) -> list[str]:
    """The public functions of ``cls`` that TRL shows the model as tools (listed on the class, so that no property
    is evaluated)."""
    return [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_") and n not in RESERVED]


def class_schemas(cls: type, spec: str) -> list[dict]:
    """The JSON schemas of ``cls``'s tools, from a probe instance's bound methods (``self`` is not an argument); an
    :class:`EnvError` naming the method when transformers cannot describe it."""
    from transformers.utils import get_json_schema

    probe = cls()
    schemas = []
    for name in tool_names(cls):
        try:
            schemas.append(get_json_schema(getattr(probe, name)))
        except Exception as e:  # noqa: BLE001 - transformers raises several types for a method it cannot describe
            raise EnvError(
                f"--env {spec}: the tool {cls.__qualname__}.{name} cannot be described: {e} (a public method is a "
                "tool: give it type hints and a docstring with an Args: section, or make it private with a leading _)"
            ) from None
    return schemas


class TrlShape:
    """The classes of a TRL-shape ``--env`` (one, or a dict routed by the ``environment`` column) and their tools."""

    def __init__(self, classes: type | dict[str, type], spec: str):
        self.routed = isinstance(classes, dict)
        self.classes = dict(classes) if self.routed else {"": classes}
        if self.routed and not self.classes:
            raise EnvError(f"--env {spec}: an empty dict of environment classes")
        self.schemas = {name: class_schemas(cls, spec) for name, cls in self.classes.items()}
        self.spec = spec

    @property
    def all_schemas(self) -> list[dict]:
        """Every class's tools (one class: its own)."""
        seen, out = set(), []
        for schemas in self.schemas.values():
            for s in schemas:
                if s["function"]["name"] not in seen:
                    seen.add(s["function"]["name"])
                    out.append(s)
        return out

    def pick(self, record: dict) -> str:
        """Which class plays ``record``."""
        if not self.routed:
            return ""
        name = record.get(ROUTE)
        if name not in self.classes:
            raise EnvError(
                f"--env {self.spec}: a row's {ROUTE!r} column is {name!r}; the environments are "
                f"{', '.join(map(repr, self.classes))}"
            )
        return name


class TrlEnvironment:
    """One episode of a TRL-shape class, in grpolab's ``reset``/``step`` shape (module docstring)."""

    history = True

    def __init__(self, shape: TrlShape):
        self.shape = shape
        self.trl_instance: Any = None
        """The user's environment object: what reward functions get as ``environments``."""
        self.own_tools: list[dict] = []
        """The tools this episode's prompt shows (its class's)."""
        self.tool_calls = self.tool_errors = self.tool_truncated = 0
        self.paid = 0.0

    @property
    def max_return(self) -> float:
        return float(getattr(self.trl_instance, "max_return", 1.0) or 1.0)

    def reset(self, record: dict) -> list[dict]:
        name = self.shape.pick(record)
        cls = self.shape.classes[name]
        self.trl_instance, self.own_tools = cls(), self.shape.schemas[name]
        self.tools = {s["function"]["name"]: getattr(self.trl_instance, s["function"]["name"]) for s in self.own_tools}
        if TASK_SEED in record:  # self-sampling: the group's task from its seed
            text = _seeded(record[TASK_SEED], self.trl_instance.reset)
        else:
            text = self.trl_instance.reset(
                **{k: v for k, v in record.items() if not (self.shape.routed and k == ROUTE)}
            )
        text = resolved(text)
        if text is not None and not isinstance(text, str):
            raise EnvError(
                f"{cls.__qualname__}.reset returned {type(text).__name__}; TRL's shape returns a str or None"
            )
        return _opening(record.get("prompt"), text, cls.__qualname__)

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        calls = parse_tool_calls(text)
        messages = [{"role": "tool", "name": c.name, "content": self.run(c)} for c in calls]
        return messages, self._reward_change(), not calls

    def run(self, call: ToolCall) -> str:
        """The tool message of one call, counted."""
        self.tool_calls += 1
        if call.error:
            self.tool_errors += 1
            return f"error: {call.error}"
        reply = answer(self.tools, {"name": call.name, "arguments": call.arguments}, MAX_CHARS)
        self.tool_errors += bool(reply["error"])
        self.tool_truncated += bool(reply.get("truncated"))
        return reply["text"]

    def _reward_change(self) -> float:
        """``get_reward()`` now, less what earlier turns were paid (0 without ``get_reward``)."""
        get_reward = getattr(self.trl_instance, "get_reward", None)
        if not callable(get_reward):
            return 0.0
        value = resolved(get_reward())
        value = 0.0 if value is None else float(value)
        if not math.isfinite(value):
            raise EnvError(f"{type(self.trl_instance).__qualname__}.get_reward returned {value}; it must be finite")
        change, self.paid = value - self.paid, value
        return change


def _seeded(task_seed: int, reset):
    """``reset()`` with Python's and NumPy's global generators seeded from ``task_seed``, their state restored."""
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(int(task_seed))
    np.random.seed(int(task_seed) % 2**32)
    try:
        return reset()
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _opening(prompt: Any, text: str | None, name: str) -> list[dict]:
    """The opening messages: the row's prompt with ``reset``'s string appended to its last message (TRL's rule), or
    that string as the user message when the row has no prompt."""
    if isinstance(prompt, str) and prompt:
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        messages = [dict(m) for m in prompt]
    else:
        messages = []
    if text:
        if messages:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
        else:
            messages = [{"role": "user", "content": text}]
    if not messages:
        raise EnvError(f"{name}.reset returned no prompt and the row has none; return the task as a string")
    return messages
