"""The tool worker: ``python -m grpolab.env.tool_worker MAX_CHARS SPEC ...`` runs tool calls for
:class:`grpolab.env.tools.ToolRunner`: it says ``ready`` once its tools are loaded, then answers one JSON line in
(``{"name", "arguments"}``) with one JSON line out (``{"text", "error", "truncated"}``).

Its own process, so that a tool that hangs, crashes or exits costs the trainer nothing but that call. The replies go
out on a private copy of stdout; what the tools print goes to stderr (discarded by the runner). It imports nothing
of grpolab's but the loader (no torch): it starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys


def capped(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, saying how long it was."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[... truncated: {len(text):,} characters, the first {max_chars:,} kept]"


def as_text(value) -> str:
    """A tool's result as the text of its message: a string as it is, anything else as JSON (or its str)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def resolved(value):
    """``value``, awaited to its result when it is awaitable (an ``async def`` tool's call)."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    return asyncio.run(wait())


def check_arguments(fn, arguments: dict) -> str:
    """'' if ``fn`` can be called with ``arguments`` as keywords, else why not (one line)."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return f"bad arguments: {e}"
    return ""


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def answer(tools: dict, request: dict, max_chars: int) -> dict:
    """The reply to one request (never raises for what the tool does)."""
    name, arguments = request.get("name"), request.get("arguments", {})
    fn = tools.get(name)
    if fn is None:
        return {"text": f"error: unknown tool {name!r} (tools: {', '.join(tools)})", "error": "unknown tool"}
    problem = check_arguments(fn, arguments)
    if problem:
        return {"text": f"error: {name}: {problem}", "error": "bad arguments"}
    try:
        text = as_text(resolved(fn(**arguments)))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit too: whatever the tool does costs only its call
        return {"text": f"error: {name} raised {_one_line(e)}", "error": "raised"}
    out = capped(text, max_chars)
    return {"text": out, "error": "", "truncated": len(out) != len(text)}


def main(argv: list[str]) -> None:
    max_chars, specs = int(argv[0]), argv[1:]
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the tools' prints go where stderr goes, not into the replies
    from grpolab.common.loader import load_object

    tools = {}
    for spec in specs:
        if spec.startswith("pickled:"):  # a function the trainer pickled by value into its own file (ToolRunner)
            import pickle

            with open(spec.removeprefix("pickled:"), "rb") as f:
                fn = pickle.load(f)
        else:
            fn = load_object(spec, "--tools", "function")
        tools[getattr(fn, "__name__", spec)] = fn
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        replies.write(json.dumps(answer(tools, json.loads(line), max_chars)) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
