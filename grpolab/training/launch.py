"""Running a command on several processes of this machine: ``--nproc P`` relaunches it under torchrun.

Each child sees ``WORLD_SIZE`` and runs its share instead of relaunching; :func:`processes` is the
context a command runs in (rank 0 prints; every rank leaves the process group at the end).
"""

from __future__ import annotations

import contextlib
import os
import sys


def relaunches(nproc: int) -> bool:
    """--nproc > 1 outside a torchrun launch: this command will start P processes."""
    return nproc > 1 and "WORLD_SIZE" not in os.environ


@contextlib.contextmanager
def processes(nproc: int, argv: list[str]):
    """``--nproc P`` > 1 outside torchrun: relaunch ``grpolab ARGV`` under torchrun (this process is
    replaced). Inside: yields whether this process is rank 0 (the one that prints), and leaves the
    process group at the end."""
    if relaunches(nproc):
        relaunch_under_torchrun(nproc, drop_flag(argv, "--nproc"))
    from grpolab.common import distributed

    try:
        yield int(os.environ.get("RANK", "0")) == 0
    except BaseException:
        distributed.shutdown()  # a failing rank must not wait for the others
        raise
    else:
        distributed.shutdown(synchronize=True)


def drop_flag(args: list[str], flag: str) -> list[str]:
    """args without ``FLAG VALUE`` / ``FLAG=VALUE`` (torchrun's parser would take ``--nproc`` for its own option)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> None:
    """Replace this process by ``torchrun --standalone --nproc-per-node P -m grpolab ARGV`` (one node,
    a free rendezvous port). Each child sees WORLD_SIZE and runs its share instead of relaunching."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "grpolab",
        *argv,
    ]
    print("launching: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    os.execv(sys.executable, cmd)
