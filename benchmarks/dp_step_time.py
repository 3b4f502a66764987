"""Step time of data-parallel GRPO: one process against P processes (torchrun, gloo), same global batch.

Runs ``grpolab train`` as a user would, once per layout, and reads rank 0's per-step
timings from metrics.jsonl (a rank-0 step includes waiting for the others at the
gradient reduction, so it is the step's wall time). Layouts, in one run of this script:

- P=1, 1 thread: the default single-process run;
- P=1, T threads: the same cores as P processes, used by intra-op threads instead;
- P processes x 1 thread (DDP), and with --fsdp also FSDP2.

    python benchmarks/dp_step_time.py [--nproc 2] [--steps 10] [--warmup 2] [--fsdp] [--key value ...]

Extra ``--key value`` pairs go to ``grpolab train`` (e.g. --group-size 16 --max-new-tokens 64).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpolab.training.runlog import read_metrics


def run(out: Path, extra: list[str], steps: int) -> tuple[list[dict], float]:
    cmd = [
        sys.executable,
        "-m",
        "grpolab",
        "train",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--eval-every",
        "0",
        "--eval-questions",
        "8",
        "--eval-samples",
        "1",
        "--save-every",
        "0",
        "--no-progress",
        *extra,
    ]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return read_metrics(out / "metrics.jsonl")[1:], wall  # row 0 is the step-0 evaluation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="processes of the data-parallel layout")
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--fsdp", action="store_true", help="also time FSDP2 with --nproc processes")
    args, rest = ap.parse_known_args()
    P = args.nproc
    layouts = [
        ("P=1 x 1 thread", ["--threads", "1"]),
        (f"P=1 x {P} threads", ["--threads", str(P)]),
        (f"P={P} x 1 thread (DDP)", ["--nproc", str(P), "--threads", "1"]),
    ]
    if args.fsdp:
        layouts.append((f"P={P} x 1 thread (FSDP2)", ["--nproc", str(P), "--threads", "1", "--fsdp"]))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(layouts):
            rows, wall = run(Path(tmp) / f"run{i}", [*rest, *flags], args.warmup + args.steps)
            rows = rows[args.warmup :]
            med = lambda k, rows=rows: statistics.median(r[k] for r in rows)  # noqa: E731
            results[name] = {
                "step": med("time/step_s"),
                "generate": med("time/generate_s"),
                "update": med("time/update_s"),
                "wall": wall,
                "reward": statistics.fmean(r["reward/mean"] for r in rows),
            }
    print(
        f"grpolab train {' '.join(rest) or '(defaults: B=16 G=8 max_new_tokens=48, built-in model)'}; "
        f"median over {args.steps} steps after {args.warmup} warm-up; one run of each layout, in turn"
    )
    base = results["P=1 x 1 thread"]["step"]
    print(f"  {'layout':<26} {'step s':>8} {'generate s':>11} {'update s':>9} {'speed-up':>9} {'process wall s':>15}")
    for name, r in results.items():
        print(
            f"  {name:<26} {r['step']:>8.3f} {r['generate']:>11.3f} {r['update']:>9.3f} {base / r['step']:>8.2f}x {r['wall']:>15.1f}"
        )
    print(
        "  (mean reward over the measured steps, equal across layouts up to rounding: "
        + ", ".join(f"{r['reward']:.4f}" for r in results.values())
        + ")"
    )


if __name__ == "__main__":
    main()
