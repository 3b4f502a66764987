"""Throughput of the code reward's sandbox: N programs of ~0.1 s each, with 1 and 2 workers, against bare processes.

    python benchmarks/sandbox_throughput.py [--programs 64] [--seconds 0.1] [--isolation auto|bwrap|unshare]

Each program busy-waits ``--seconds`` of CPU and is checked by one test. Rows:

- ``bare subprocess``: ``python -I -c program`` per program, one after another (no harness, no isolation, no
  limits): what running the programs costs at all;
- ``sandbox, W worker(s)``: the same programs through ``grpolab.rewards.rewarder.code_reward``'s sandbox.

The overhead per program is (sandbox with 1 worker - bare) / N; the speed-up of 2 workers is the ratio of the
two sandbox rows. A trivial program (no busy wait) gives the fixed cost alone. Figures are one run's, on this
machine: compare ratios, not seconds, across machines.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from grpolab.sandbox import Job, Limits, Sandbox

PROGRAM = "import time\n_t = time.process_time()\nwhile time.process_time() - _t < {seconds}:\n    pass\nok = 1\n"


def bare(programs: list[str]) -> float:
    python = os.path.realpath(sys.executable)
    t0 = time.perf_counter()
    for p in programs:
        subprocess.run([python, "-I", "-c", p], check=True, env={"PATH": "/usr/bin:/bin"})
    return time.perf_counter() - t0


def sandboxed(programs: list[str], workers: int, isolation: str) -> tuple[float, Sandbox]:
    sandbox = Sandbox(Limits(timeout_s=30, cpu_s=30), workers=workers, isolation=isolation)
    try:
        t0 = time.perf_counter()
        outs = sandbox.run([Job(p, tests=("assert ok == 1",)) for p in programs])
        seconds = time.perf_counter() - t0
    finally:
        sandbox.close()
    bad = [o for o in outs if o.status != "passed"]
    if bad:
        raise SystemExit(f"{len(bad)} program(s) did not pass: {bad[0]}")
    return seconds, sandbox


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=0.1, help="CPU seconds each program busy-waits")
    ap.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "unshare"))
    args = ap.parse_args()
    n = args.programs
    print(f"{n} programs; {os.cpu_count()} CPU core(s); python {sys.version.split()[0]}")
    for label, seconds in (("trivial program", 0.0), (f"{args.seconds:g} s program", args.seconds)):
        programs = [PROGRAM.format(seconds=seconds) + f"# {i}\n" for i in range(n)]
        base = bare(programs)
        one, sandbox = sandboxed(programs, 1, args.isolation)
        two, _ = sandboxed(programs, 2, args.isolation)
        print(f"\n{label} ({sandbox.describe().split(';')[0]})")
        print(f"  {'bare subprocess, 1 at a time':<30} {base:7.2f} s  {1e3 * base / n:7.1f} ms/program")
        print(f"  {'sandbox, 1 worker':<30} {one:7.2f} s  {1e3 * one / n:7.1f} ms/program")
        print(f"  {'sandbox, 2 workers':<30} {two:7.2f} s  {1e3 * two / n:7.1f} ms/program")
        print(f"  overhead of the sandbox per program: {1e3 * (one - base) / n:.1f} ms; 2 workers: {one / two:.2f}x")


if __name__ == "__main__":
    main()
