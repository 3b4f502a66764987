"""Run the `grpolab` command line in a subprocess, as a user would (imported by the CLI tests)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(args: list[str], cwd, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "grpolab", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )
