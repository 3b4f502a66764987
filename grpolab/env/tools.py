"""Tools the policy may call: plain Python functions with type hints and a docstring (``--tools FILE.py:fn``).

- **Shown to the model** as JSON schemas (transformers' ``get_json_schema``, from the hints and the docstring's
  ``Args:`` section) through the chat template's ``tools=``, or, for a template that ignores them, a system message
  (:func:`tool_instructions`) describing them and the text protocol below.
- **Called by the model** in the text protocol of Hermes and Qwen2.5 templates::

      <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>

  any number of them in one reply (a missing closing tag at the end of a reply is accepted);
  :func:`parse_tool_calls`. Templates with another format (Llama 3.1's bare JSON, Mistral's ``[TOOL_CALLS]``) are
  not parsed.
- **Run** by :class:`ToolRunner` in a worker process of their own, never in the trainer: a call that raises,
  hangs past the timeout (the worker is killed with everything it started, and a new one takes the next call) or
  kills its worker costs that call only. Results are text, capped in size.

Every call gets a tool message back: the result, or one line saying what went wrong (:data:`ERRORS` lists the
kinds), which the environment counts in ``env/tool_errors``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

from grpolab.common.given import NOTHING, Given

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CHARS = 2000
STARTUP_S = 60.0  # the most a worker may take to load the tools
ERRORS = ("unknown tool", "bad arguments", "raised", "timeout", "worker died", "unparsable call")

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


# ---------------------------------------------------------------------- what the model is shown
def tool_schema(fn, spec: str = "") -> dict:
    """The JSON schema of ``fn`` (its name, the docstring's description and arguments, the hints' types); a
    ConfigError naming ``spec`` when the hints or the docstring are missing."""
    from transformers.utils import get_json_schema

    from grpolab.config.train import ConfigError

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for a function it cannot describe
        raise ConfigError(
            f"--tools {spec or getattr(fn, '__name__', fn)}: {e} (a tool needs type hints on every argument and a "
            "docstring with an Args: section describing them)"
        ) from None


def load_tools(specs, given: Given = NOTHING) -> list[dict]:
    """The JSON schemas of the ``--tools`` functions (loaded here only to describe them; calls run in the worker);
    a ConfigError naming the spec when one cannot be loaded or described, or two share a name."""
    from grpolab.common.loader import load_object
    from grpolab.config.train import ConfigError

    schemas = []
    for spec in specs:
        fn = load_object(spec, "--tools", "function", given)
        if not callable(fn):
            raise ConfigError(f"--tools: {spec!r} is not callable")
        schemas.append(tool_schema(fn, spec))
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) != len(names):
        raise ConfigError(f"--tools: two tools share a name ({', '.join(names)}); the model calls them by name")
    return schemas


def tool_instructions(schemas: list[dict]) -> str:
    """The system text that describes tools to a model whose template does not show them: each tool's signature
    and description, and the text protocol."""
    lines = ["You can use these tools:"]
    for s in schemas:
        f = s["function"]
        props = f.get("parameters", {}).get("properties", {})
        args = ", ".join(f"{name}: {p.get('type', 'any')}" for name, p in props.items())
        lines.append(f"- {f['name']}({args}): {f.get('description', '').strip()}")
        lines += [f"    {name}: {p['description']}" for name, p in props.items() if p.get("description")]
    example = schemas[0]["function"]
    first = next(iter(example.get("parameters", {}).get("properties", {})), "x")
    lines.append(
        "To call a tool, write\n"
        f'<tool_call>{{"name": "{example["name"]}", "arguments": {{"{first}": ...}}}}</tool_call>\n'
        "and stop: its result comes back in the next message. Reply without a tool call to give your final answer."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------- what the model wrote
@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call in a reply; ``error`` is set when it could not be parsed (then name and arguments are empty)."""

    name: str
    arguments: dict
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{...}</tool_call>`` blocks of a reply, in order (module docstring)."""
    calls = []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"unparsable call: not JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'unparsable call: expected {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "bad arguments: 'arguments' must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


# ---------------------------------------------------------------------- running them
@dataclasses.dataclass
class ToolResult:
    text: str
    """The tool message's content."""
    error: str = ""
    """'' for a result; else the kind of failure (one of :data:`ERRORS`)."""
    truncated: bool = False


class ToolRunner:
    """Runs tool calls in a worker process (``python -m grpolab.env.tool_worker SPEC ...``), one at a time.

    ``specs``: the tools' ``module:function`` or ``file.py:function`` names (the worker loads them itself);
    ``timeout_s``: wall-clock seconds per call; ``max_chars``: the longest result kept; ``given``: functions given to
    the Python API in place of names (pickled for the worker).
    """

    def __init__(
        self,
        specs: list[str],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_chars: int = DEFAULT_MAX_CHARS,
        given: Given = NOTHING,
    ):
        self.specs, self.timeout_s, self.max_chars, self.given = list(specs), timeout_s, max_chars, given
        self._proc: subprocess.Popen | None = None
        self._pickled: tempfile.TemporaryDirectory | None = None  # made for the first function to pickle
        self._worker_specs = [self._worker_spec(s, i) for i, s in enumerate(self.specs)]

    def _worker_spec(self, spec: str, i: int) -> str:
        """What the worker loads for ``spec``: the name itself, or for a function given to the Python API that no
        module can import (defined in a notebook, a closure) the function pickled by value into a file of this
        runner's own (cloudpickle: the standard pickle stores a function by its importable name only)."""
        fn = self.given.lookup(spec, "--tools")
        if fn is None:
            return spec
        import cloudpickle

        if self._pickled is None:
            self._pickled = tempfile.TemporaryDirectory(prefix="grpolab-tools-")
        path = os.path.join(self._pickled.name, f"tool_{i}.pkl")
        with open(path, "wb") as f:
            cloudpickle.dump(fn, f)
        return "pickled:" + path

    def _start(self) -> subprocess.Popen:
        """A new worker, once it has loaded the tools (its start does not count against a call's timeout)."""
        # the trainer's import path, so that the worker finds every module the trainer found the tools in
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", "grpolab.env.tool_worker", str(self.max_chars), *self._worker_specs]
        errors = tempfile.TemporaryFile()  # what the tools print, and why a worker did not start
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills whatever the tool started too
        )
        self._proc = proc
        if self._read_line(proc, time.monotonic() + max(STARTUP_S, self.timeout_s)) != b"ready\n":
            self._kill()
            errors.seek(0)
            lines = errors.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"the tool worker did not start: {lines[-1] if lines else 'no output'}")
        errors.close()  # the file stays open in the worker; unlinked, it takes no name
        return proc

    def call(self, name: str, arguments: dict) -> ToolResult:
        """Run one call; never raises for what the tool does."""
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._start()
            except RuntimeError as e:
                return ToolResult(f"error: {e}", "worker died")
        proc = self._proc
        deadline = time.monotonic() + self.timeout_s  # the call's, from its first byte written
        request = (json.dumps({"name": name, "arguments": arguments}) + "\n").encode()
        try:
            taken = self._write_all(proc, request, deadline)
        except OSError:  # BrokenPipeError among them
            self._kill()
            return ToolResult(f"error: the tool worker died before {name} ran", "worker died")
        if not taken:
            self._kill()
            return ToolResult(f"error: the tool worker did not take the call to {name} within {self.timeout_s:g} s",
                              "timeout")  # fmt: skip
        line = self._read_line(proc, deadline)
        if line is None:
            died = proc.poll() is not None
            self._kill()
            if died:
                return ToolResult(f"error: {name} ended its process without a result", "worker died")
            return ToolResult(f"error: {name} did not return within {self.timeout_s:g} s", "timeout")
        reply = json.loads(line)
        return ToolResult(reply["text"], reply.get("error", ""), reply.get("truncated", False))

    @staticmethod
    def _write_all(proc: subprocess.Popen, data: bytes, deadline: float) -> bool:
        """Write ``data`` to the worker's stdin before ``deadline`` (False if it did not take it all by then: a
        worker that is stopped or hung reads nothing, and a call's arguments can exceed the pipe's 64 KiB). Written
        by hand, as :meth:`_read_line` reads: ``subprocess`` has no write with a deadline but ``communicate``, which
        closes the pipe."""
        fd = proc.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                return False
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
        return True

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
        """One line from the worker before ``deadline``, or None (timeout, or the worker ended)."""
        fd = proc.stdout.fileno()
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            buf += chunk
        return buf

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        self._kill()
        if self._pickled is not None:
            self._pickled.cleanup()

    def __del__(self):  # a runner that goes away takes its worker with it
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
