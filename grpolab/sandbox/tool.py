"""The code-interpreter tool: ``--tools grpolab.sandbox.tool:python``.

The model writes a program; it runs in the code reward's sandbox (:mod:`grpolab.sandbox`: bubblewrap, or unshare,
with the harness's limits), never in the trainer nor in the tool worker, and what it printed comes back as the tool's
result. The sandbox is this module's, started on the first call in the process that runs the tools, with the
code reward's default limits (5 s wall clock and CPU, 1 GiB of memory, no network), overridable through the
environment variables ``GRPOLAB_TOOL_TIMEOUT`` (seconds) and ``GRPOLAB_TOOL_MEMORY_MB``; keep the timeout under
``--tool-timeout``.
"""

from __future__ import annotations

import math
import os

from grpolab.sandbox.runner import Job, Limits, Sandbox

OUTPUT_CHARS = 4000
_SANDBOX: list[Sandbox] = []


def _sandbox() -> Sandbox:
    if not _SANDBOX:
        timeout = float(os.environ.get("GRPOLAB_TOOL_TIMEOUT", 5.0))
        memory = int(os.environ.get("GRPOLAB_TOOL_MEMORY_MB", 1024))
        limits = Limits(timeout_s=timeout, cpu_s=math.ceil(timeout), memory_mb=memory)
        _SANDBOX.append(Sandbox(limits, workers=1))
    return _SANDBOX[0]


def python(code: str) -> str:
    """Run a Python program and return what it printed (stdout and stderr; an uncaught exception's message too).

    Args:
        code: the program, e.g. print(sum(range(10)))
    """
    (outcome,) = _sandbox().run([Job(code, capture=OUTPUT_CHARS)])
    if outcome.status == "timeout":
        return outcome.output + f"\n[stopped: {outcome.error}]"
    if outcome.status in ("memory", "crashed", "forged") and outcome.error not in outcome.output:
        return outcome.output + f"\n[{outcome.error}]"
    return outcome.output
