"""The tool worker: ``python -m grpolab.env.tool_worker MAX_CHARS SPEC ...`` runs tool calls for
:class:`grpolab.env.tools.ToolRunner`, one JSON line in (``{"name", "arguments"}``), one JSON line out
(``{"text", "error", "truncated"}``).

Its own process, so that a tool that hangs, crashes or exits costs the trainer nothing but that call. The replies go
out on a private copy of stdout; what the tools print goes to stderr (discarded by the runner).
"""

from __future__ import annotations

import json
import os
import sys


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def answer(tools: dict, request: dict, max_chars: int) -> dict:
    """The reply to one request (never raises for what the tool does)."""
    from grpolab.env.tools import as_text, capped, check_arguments

    name, arguments = request.get("name"), request.get("arguments", {})
    fn = tools.get(name)
    if fn is None:
        return {"text": f"error: unknown tool {name!r} (tools: {', '.join(tools)})", "error": "unknown tool"}
    problem = check_arguments(fn, arguments)
    if problem:
        return {"text": f"error: {name}: {problem}", "error": "bad arguments"}
    try:
        text = as_text(fn(**arguments))
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
    from grpolab.loader import load_object

    tools = {}
    for spec in specs:
        fn = load_object(spec, "--tools", "function")
        tools[getattr(fn, "__name__", spec)] = fn
    for line in sys.stdin:
        if not line.strip():
            continue
        replies.write(json.dumps(answer(tools, json.loads(line), max_chars)) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
