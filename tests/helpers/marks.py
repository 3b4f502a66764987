"""Marks that depend on the machine: the sandbox's bubblewrap, and a test run as each kind of CPU."""

from __future__ import annotations

import os
import sys

import pytest


def bwrap_runs() -> bool:
    from grpolab.sandbox import runner

    return runner.available("bwrap", os.path.realpath(sys.executable))


needs_bwrap = pytest.mark.skipif(
    not bwrap_runs() and not os.environ.get("GRPOLAB_REQUIRE_BWRAP"),
    reason="bubblewrap is not installed or does not run here (make test installs it)",
)


EACH_CPU = pytest.mark.parametrize("units", [True, False], ids=["cpu-bf16-units", "cpu-no-bf16-units"])
"""A test run once on a CPU with bf16 units and once without (``units``; with the ``machine_kind`` fixture)."""
