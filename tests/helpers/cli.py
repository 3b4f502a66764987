"""The command line as a user runs it: ``grpolab ARGS`` in this process or in a subprocess, and a batch of commands on
the processes of one torchrun launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from .paths import REPO, TESTS


def run_cli(args: list[str], cwd, timeout: int = 300, process: bool | None = None) -> subprocess.CompletedProcess:
    """``grpolab ARGS`` as a user would run it: its exit status, stdout and stderr.

    In a subprocess (``process`` True, or a command that starts processes of its own: ``--nproc``), with a
    ``timeout`` of minutes; otherwise ``grpolab.commands.cli.main`` in this process, in ``cwd``, its output captured:
    the same code from the parsed command line on, without an interpreter's and torch's start-up (seconds a call).
    """
    if process is None:
        args = [str(a) for a in args]
        process = "--nproc" in args and args[args.index("--nproc") + 1] != "1"
    if not process:
        return run_main(args, cwd, timeout)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "grpolab", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def torchrun_batch(commands: list[list[str]], cwd, nproc: int = 2, timeout: int = 600) -> None:
    """``grpolab ARGS`` for each of ``commands``, in order, on ``nproc`` processes of one torchrun launch
    (tools/torchrun_batch.py): what ``grpolab ARGS --nproc P`` runs in each of its processes, without starting P
    interpreters (and importing torch and transformers) per command. The relaunch from ``--nproc`` itself is tested
    by the commands that still use it."""
    spec = Path(cwd) / "torchrun_batch.json"
    spec.write_text(json.dumps([[str(a) for a in args] for args in commands]))
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200", "PYTHONPATH": path}
    script = REPO / "tools" / "torchrun_batch.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    res = subprocess.run([*cmd, str(spec)], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


class RanPastDeadline(BaseException):
    """Raised in a command run in this process (:func:`run_main`) that ran past its deadline: a BaseException, so
    that no ``except Exception`` of the command's turns it into an ordinary error line."""


def run_main(args: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    """``grpolab ARGS`` through ``main`` in this process (see :func:`run_cli`); torch's thread count is restored after.

    A command still running after ``timeout`` seconds is interrupted (SIGALRM, in the main thread: pytest-timeout
    watches from a thread of its own, at 600 s) and the test fails naming the command, instead of stalling."""
    import contextlib
    import io
    import signal

    from grpolab.commands.cli import main

    def past(signum, frame):
        raise RanPastDeadline(f"grpolab {' '.join(map(str, args))} still running after {timeout:g} s")

    out, err = io.StringIO(), io.StringIO()
    threads, old_cwd, old_columns = torch.get_num_threads(), os.getcwd(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"
    code = 0
    timed = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
    if timed:
        before = signal.signal(signal.SIGALRM, past)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        os.chdir(old_cwd)
        torch.set_num_threads(threads)
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
