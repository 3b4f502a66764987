"""Running untrusted programs: the sandbox (``runner``) and the harness that runs inside it (``harness``)."""

from grpolab.sandbox.runner import Job, Limits, Outcome, Sandbox, SandboxError

__all__ = ["Job", "Limits", "Outcome", "Sandbox", "SandboxError"]
