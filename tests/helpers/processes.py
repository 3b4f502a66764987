"""Waits with a deadline, ports, generator workers in processes of their own, and two gloo ranks spawned."""

from __future__ import annotations

import os
import subprocess
import sys
import threading


def within(seconds: float, call):
    """``call()`` in a thread: what it returned or raised, or an AssertionError after ``seconds`` (a regression to a
    wait without a deadline fails here, naming itself, instead of hanging the suite)."""
    got: dict = {}

    def target():
        try:
            got["value"] = call()
        except BaseException as e:  # handed to the test's thread
            got["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a wait without a deadline"
    if "error" in got:
        raise got["error"]
    return got.get("value")


def free_port() -> int:
    """A TCP port free on localhost now (a trainer's --generator-listen)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(port: int, *extra: str, cwd=None) -> subprocess.Popen:
    """``grpolab generator --connect 127.0.0.1:PORT`` in a process of its own, one thread."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "grpolab", "generator", "--connect", f"127.0.0.1:{port}", "--threads", "1", *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_of_two_failing_on_main(rank: int, port: int, timeout: float, said, done) -> None:
    """One of two gloo ranks running :func:`grpolab.common.distributed.on_main` with a call that raises on rank 0 (an
    error that is not a checkpoint's); puts (rank, the error's type and text, seconds it took) in ``said``. Rank 0
    stays until rank 1 has said (``done``, at most ``timeout``), as a run closing its engines would: its exit does not
    end rank 1's wait."""
    import datetime
    import time

    import torch.distributed as dist

    from grpolab.common.distributed import World, on_main

    span = datetime.timedelta(seconds=timeout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=span)

    def save():
        raise RuntimeError("the disk went away")

    t0 = time.monotonic()
    try:
        on_main(save, World(rank, 2), lambda: ValueError("failed on rank 0"))
        said.put((rank, None, "", time.monotonic() - t0))
    except Exception as e:
        said.put((rank, type(e).__name__, str(e), time.monotonic() - t0))
    if rank == 1:
        done.set()
    done.wait(timeout)
    dist.destroy_process_group()
