"""The environment of ``--tools``: the record's prompt, then tool calls run and answered until a reply calls none.

Each reply's tool calls (:func:`grpolab.env.tools.parse_tool_calls`) run in the tool worker
(:class:`grpolab.env.tools.ToolRunner`), in order; each result, or the line saying what went wrong, comes back as a
tool message. A reply with no tool call is the final answer and ends the episode. The environment's own reward is
``tool_reward`` at a turn whose calls all returned a result (``--tool-reward``, default 0), else 0: the run's reward
functions (``--reward-fn``) score the final conversation.
"""

from __future__ import annotations

from grpolab.data.records import prompt_of
from grpolab.env.tools import ToolCall, ToolRunner, parse_tool_calls


class ToolEnvironment:
    """One episode with tools. ``runner`` runs the calls; ``schemas``: the tools' JSON schemas (their names are the
    ones the model may call); ``tool_reward``: the reward of a turn whose calls all returned a result."""

    history = True

    def __init__(self, runner: ToolRunner, schemas: list[dict], tool_reward: float = 0.0):
        self.runner, self.tools, self.tool_reward = runner, schemas, tool_reward
        self.names = [s["function"]["name"] for s in schemas]
        self.tool_calls = self.tool_errors = self.tool_truncated = 0

    def reset(self, record: dict) -> list[dict]:
        prompt = prompt_of(record)
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        calls = parse_tool_calls(text)
        if not calls:
            return [], 0.0, True
        errors = self.tool_errors
        messages = [{"role": "tool", "name": c.name, "content": self.run(c)} for c in calls]
        return messages, (self.tool_reward if self.tool_errors == errors else 0.0), False

    def run(self, call: ToolCall) -> str:
        """The tool message of one call, counted."""
        self.tool_calls += 1
        if call.error:
            self.tool_errors += 1
            return f"error: {call.error}"
        if call.name not in self.names:
            self.tool_errors += 1
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.names)})"
        result = self.runner.call(call.name, call.arguments)
        self.tool_errors += bool(result.error)
        self.tool_truncated += result.truncated
        return result.text
