"""The checks of tools/gpu_check.py, one :class:`~gpu_checks.common.Check` each, and :data:`CHECKS`, the registry:
the one place that lists them, in the order they run. A module per group of related checks (training, vision,
vllm_sync, processes, performance); what they share is in common. tools/ is not a package: tools/gpu_check.py (run
as a script, or imported with tools/ on ``sys.path``) imports this one as ``gpu_checks``."""

from __future__ import annotations

from .common import Check
from .performance import DECODE, PRECISIONS_CHECK
from .processes import DISTRIBUTED, WORKERS
from .training import CHECKPOINT, DISTILL, HACKING, REWARDS
from .vision import QWEN_VL, VISION
from .vllm_sync import VLLM, VLLM_LORA

CHECKS: tuple[Check, ...] = (
    CHECKPOINT,
    REWARDS,
    HACKING,
    DISTILL,
    VISION,
    VLLM,
    VLLM_LORA,
    DISTRIBUTED,
    WORKERS,
    PRECISIONS_CHECK,
    DECODE,
    QWEN_VL,
)
"""Every check, in the order they run (a background check's processes start before the first check, and the timed
ones wait for them to end)."""
BY_NAME: dict[str, Check] = {c.name: c for c in CHECKS}
if len(BY_NAME) != len(CHECKS):
    raise ValueError(f"two checks share a name: {[c.name for c in CHECKS]}")
