"""Running a command on several processes of this machine: ``--nproc P`` relaunches it under torchrun.

Each child sees ``WORLD_SIZE`` and runs its share instead of relaunching; :func:`processes` is the
context a command runs in (rank 0 prints; every rank leaves the process group at the end).
``--nproc 0`` (the default) lets :func:`auto_processes` choose: one process per core where that is faster.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

AUTO_MIN_STEPS = 50
"""``--nproc 0`` starts several processes only for runs of at least this many steps. On the demo (this project's 2-core
AVX2 machine; docs/benchmarks.md) two processes took 1.9 s more to start (8.0 s against 6.1 s to the first
evaluation) and 0.28 s less a step: a run of a few dozen steps gains seconds at most, and a short run (a test, a first
look) stays one process, simpler to read and to stop."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def has_accelerator() -> bool:
    """A GPU's device node on this machine (NVIDIA's or ROCm's), looked for without importing torch: the processes
    are chosen before the relaunch, and torch's import is seconds."""
    return any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd"))


def auto_processes(
    cfg, small_model: bool, cores: int | None = None, accelerator: bool | None = None, min_steps: int = AUTO_MIN_STEPS
) -> tuple[int, str]:
    """``--nproc`` for ``cfg`` (a :class:`grpolab.config.train.TrainConfig`, its model's defaults filled in): its own
    when given (> 0); for 0, as many processes as pay, and why.

    Several processes pay for a ``small_model`` (the built-in 0.5 M-parameter Llama, whose products are too small for
    intra-op threads: one thread a process is fastest, docs/distributed.md) trained on the CPU, one thread each, for
    at least ``min_steps`` steps, with the rollouts drawn in the trainer's processes by the hf engine: then one
    process per core, as many as divide the step's prompts (each takes whole groups) and as the config allows on that
    many processes. Anything else runs on one process. The result does not depend on the count beyond rounding: every
    rollout is drawn from its own key (docs/distributed.md)."""
    if cfg.run.nproc > 0:
        return cfg.run.nproc, "--nproc"
    cores = usable_cores() if cores is None else cores
    accelerator = has_accelerator() if accelerator is None else accelerator
    device = cfg.machine.device
    reason = None
    if not small_model:
        reason = "a model larger than the built-in one uses every core through its threads"
    elif device != "cpu" and (device != "auto" or accelerator):
        reason = "one process per device"
    elif cfg.machine.threads != 1:
        reason = f"--threads {cfg.machine.threads}"
    elif cfg.run.steps < min_steps:
        reason = f"a run under {min_steps} steps starts faster on one"
    elif cfg.engine.rollout_engine != "hf" or cfg.engine.placement != "inline":
        reason = "the rollouts are drawn outside the trainer's processes"
    if reason is not None or cores < 2:
        return 1, reason or "one core"
    for p in range(cores, 1, -1):
        try:
            cfg.validate_world(p)
        except ValueError:
            continue
        return p, f"one per core ({cores} cores)"
    return 1, f"--prompts-per-step {cfg.groups.prompts_per_step} splits over no process count up to {cores}"


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
    # torchrun's own default, set here so that it does not print a banner saying it set it (each process sets its
    # torch threads from --threads in any case)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.execv(sys.executable, cmd)
