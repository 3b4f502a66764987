"""Environments: multi-turn episodes, tools, and the built-in dialogue.

- ``protocol``: what an environment is (``reset``/``step``), loading ``--env`` and the checks on what it returns;
- ``trl_env``: TRL's environment classes (``reset(**row)``, ``get_reward``, methods as tools) in that shape;
- ``render``: chat messages -> the token ids of one sequence, turn by turn;
- ``episodes``: the policy and an environment taking turns through a rollout engine; episodes as token rows;
- ``tools``, ``tool_worker``, ``tool_env``: ``--tools`` functions, their schemas and calls, run in a worker process;
- ``arith``: the multi-turn arithmetic dialogue (``--task arith-multiturn``).

:func:`environment` makes what a run's configuration asks for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from grpolab.common.given import NOTHING, Given
from grpolab.config.task import DataSection, EpisodesSection
from grpolab.data.task import resolve_format
from grpolab.env.protocol import EnvError, Environment, EpisodeLimits, check_reset, load_env_class
from grpolab.env.render import Renderer
from grpolab.env.trl_env import TrlEnvironment, TrlShape, is_trl_shape

__all__ = ["EnvError", "EnvSetup", "Environment", "EpisodeLimits", "Renderer", "environment", "resolved_data"]


def resolved_data(data: DataSection, episodes: EpisodesSection, given: Given = NOTHING) -> DataSection:
    """``data`` with ``--format auto`` resolved (:func:`grpolab.data.task.resolve_format`): ``self`` when the run's
    --env is in TRL's shape and there is no data (its records are then task seeds), which only loading the class
    tells."""
    self_sampling = (
        data.format == "auto"
        and bool(episodes.env)
        and not (data.data or data.eval_data)
        and is_trl_shape(load_env_class(episodes.env, given))
    )
    return resolve_format(data, bool(episodes.env), given, self_sampling)


@dataclasses.dataclass
class EnvSetup:
    """A run's environment: what makes each episode's, how its messages become tokens, its limits."""

    factory: Callable
    """Makes one episode's environment."""
    renderer: Renderer
    limits: EpisodeLimits
    name: str
    """What config.json and the logs call it."""
    tool_runner: object | None = None
    """The tool worker of --tools (closed with the run)."""

    def close(self) -> None:
        if self.tool_runner is not None:
            self.tool_runner.close()


def environment(
    episodes: EpisodesSection, max_operand: int, policy, first_record: dict | None = None, given: Given = NOTHING
) -> EnvSetup | None:
    """The environment the ``episodes`` options ask for, for ``policy``; None for a single-turn task. ``max_operand``:
    the built-in dialogue's largest operand (at most 50). ``first_record``: a record to open one episode on now, so
    that a ``reset`` that fails or returns the wrong shape stops the run at its start, not at its first step.
    ``given``: a class or tools given to the Python API in place of names."""
    ep = episodes
    limits = EpisodeLimits(ep.max_turns, ep.max_episode_tokens)
    tool_runner = None
    if ep.task == "arith-multiturn":
        from grpolab.data.dialogues import DialogueSpec
        from grpolab.env.arith import ArithDialogue

        spec = DialogueSpec(ep.stages, max_operand=min(max_operand, 50), context=ep.dialogue_context)
        factory, renderer, name = functools.partial(ArithDialogue, spec), Renderer(policy), "arith-multiturn"
        limits = EpisodeLimits(ep.stages, ep.max_episode_tokens)
    elif ep.env:
        cls, name = load_env_class(ep.env, given), ep.env
        if is_trl_shape(cls):
            shape = TrlShape(cls, ep.env)
            factory, renderer = functools.partial(TrlEnvironment, shape), Renderer(policy, shape.all_schemas)
        else:
            factory, renderer = cls, Renderer(policy)
    elif ep.tools:
        from grpolab.env.tool_env import ToolEnvironment
        from grpolab.env.tools import ToolRunner, load_tools

        schemas = load_tools(ep.tools, given)
        tool_runner = ToolRunner(list(ep.tools), ep.tool_timeout, ep.tool_max_chars, given)
        factory = functools.partial(ToolEnvironment, tool_runner, schemas, ep.tool_reward)
        renderer, name = Renderer(policy, schemas), "tools: " + ", ".join(ep.tools)
    else:
        return None
    if first_record is not None:
        env = factory()
        messages = check_reset(env.reset(first_record), env)
        (Renderer(policy, env.own_tools) if hasattr(env, "own_tools") else renderer).opening(messages)
    return EnvSetup(factory, renderer, limits, name, tool_runner)
