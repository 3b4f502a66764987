"""What a teacher costs a step: `grpolab train` runs with and without --teacher, alternated A, B, A, B ... in one
sitting on one machine (evaluations only at the ends, on 8 questions), each run's median step time (its first step left out: start-up), and the teacher's own
forward (time/teacher_s) as a share of the distilling step.

    python benchmarks/distillation/cost.py --teacher runs/demo/checkpoints/step_500 --pairs 3 --steps 20
    python benchmarks/distillation/cost.py --model smollm2-135m-instruct --teacher DIR --pairs 2 --steps 4 \\
        --extra "--prompts-per-step 4 --group-size 4 --max-new-tokens 24"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(out: Path, args, teacher: bool) -> dict:
    """One run; its median step time and the teacher's median seconds a step (steps 2 on)."""
    cmd = [sys.executable, "-m", "grpolab", "train", "--nproc", "1", "--out", str(out), "--model", args.model, "--steps",
           str(args.steps), "--eval-questions", "8", "--eval-samples", "1", "--eval-every", "0", "--save-every", "100000", "--no-progress", "--threads", "0",
           "--hacking-every", "0", "--honeypots", "none", *shlex.split(args.extra)]  # fmt: skip
    if teacher:
        cmd += ["--teacher", args.teacher, *shlex.split(args.distill)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step", 0) >= 2 and "time/step_s" in r]
    return {
        "step_s": statistics.median(r["time/step_s"] for r in steps),
        "teacher_s": statistics.median(r.get("time/teacher_s", 0.0) for r in steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--extra", default="", help="more flags for both runs")
    ap.add_argument("--distill", default="", help="more flags for the distilling run (e.g. --distill-loss jsd)")
    args = ap.parse_args()
    plain, taught = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            plain.append(run(Path(tmp) / f"plain{k}", args, teacher=False))
            taught.append(run(Path(tmp) / f"teacher{k}", args, teacher=True))
            print(f"pair {k}: plain {plain[-1]['step_s']:.3f} s, with the teacher {taught[-1]['step_s']:.3f} s "
                  f"(its forward {taught[-1]['teacher_s']:.3f} s)", flush=True)  # fmt: skip
    a = statistics.fmean(r["step_s"] for r in plain)
    b = statistics.fmean(r["step_s"] for r in taught)
    t = statistics.fmean(r["teacher_s"] for r in taught)
    print(f"{args.model}: plain step {a:.3f} s, distilling step {b:.3f} s ({b / a:.2f}x); the teacher's forward "
          f"{t:.3f} s, {t / b:.1%} of the distilling step")  # fmt: skip


if __name__ == "__main__":
    main()
