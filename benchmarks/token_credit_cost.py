"""What ``--log-token-credit K`` costs: step time with it against without, in one run of this script.

Runs ``grpolab train`` as a user would, alternating the two settings (off, on, off, on, ...) so
that a drift in the machine's speed falls on both, and reads the per-step timings from
metrics.jsonl. The recording draws no random numbers, so both runs train on the same rollouts
to the same weights: the script checks that their rewards and losses are equal, so the
difference in step time is the recording's alone (and says so when they are not: a sampler
that is not deterministic from run to run).

    python benchmarks/token_credit_cost.py [--preset builtin|smollm2] [--k 4] [--steps 20] [--repeats 2] \
        [--key value ...]

``--preset smollm2``: SmolLM2-135M-Instruct on the real-model demo's preset (grpolab.demo). Extra
``--key value`` pairs go to ``grpolab train``.
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

from grpolab.demo import REAL_MODEL_PRESET
from grpolab.runlog import read_metrics

# The demo preset's fields that are not training ones here: evaluation happens once at each end, on few questions.
SKIP = {"steps", "eval_every", "eval_questions", "eval_samples", "save_every", "log_samples"}


def preset_flags(name: str) -> list[str]:
    if name == "builtin":
        return []
    flags = ["--model", "smollm2-135m-instruct"]
    for key, value in REAL_MODEL_PRESET.items():
        if key in SKIP:
            continue
        flags.append("--" + key.replace("_", "-"))
        flags += [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
    return flags


def run(out: Path, flags: list[str], steps: int) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "grpolab", "train", "--out", str(out), "--steps", str(steps)]
    cmd += ["--eval-every", "0", "--eval-questions", "8", "--eval-samples", "1", "--save-every", "0", "--no-progress"]
    cmd += flags
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if res.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return read_metrics(out / "metrics.jsonl")[1:], time.perf_counter() - t0  # row 0: the step-0 evaluation


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    """Where two runs' training metrics first differ (None when they never do)."""
    keys = ("reward/mean", "loss/policy", "grad/norm", "completion/len_mean")
    for x, y in zip(a, b):
        for k in keys:
            if x.get(k) != y.get(k):
                return f"step {x['step']}, {k}: {x.get(k)} against {y.get(k)}"
    return None if len(a) == len(b) else "different numbers of steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("builtin", "smollm2"), default="builtin")
    parser.add_argument("--k", type=int, default=4, help="rollouts recorded per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternated")
    args, extra = parser.parse_known_args()
    flags = preset_flags(args.preset) + extra
    steps = {"off": [], "on": []}
    credit, update, same = [], {"off": [], "on": []}, []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            rows = {}
            for name, more in (("off", []), ("on", ["--log-token-credit", str(args.k)])):
                rows[name], wall = run(Path(tmp) / f"{name}{rep}", flags + more, args.steps)
                kept = rows[name][args.warmup :]
                steps[name] += [r["time/step_s"] for r in kept]
                update[name] += [r["time/update_s"] for r in kept]
                credit += [r["time/credit_s"] for r in kept if "time/credit_s" in r]
                print(
                    f"run {rep + 1} {name:>3}: {wall:.0f} s, median step {statistics.median(steps[name][-len(kept) :]):.3f} s"
                )
            differ = first_difference(rows["off"], rows["on"])
            if differ:  # the step times then compare different work: say so
                print(f"run {rep + 1}: the two settings trained differently from {differ}")
            same.append(differ is None)
    off, on = statistics.median(steps["off"]), statistics.median(steps["on"])
    print(f"\npreset {args.preset}, K = {args.k}, {args.repeats} x {args.steps - args.warmup} steps per setting")
    print(f"same rewards, losses and gradient norms with and without: {sum(same)} of {len(same)} pairs of runs")
    print(f"median step, without:             {off:.3f} s  (update {statistics.median(update['off']):.3f} s)")
    print(f"median step, --log-token-credit:  {on:.3f} s  (update {statistics.median(update['on']):.3f} s)")
    print(f"ratio with / without:             {on / off:.3f}")
    print(
        f"recording after the update (time/credit_s), median: {statistics.median(credit) * 1e3:.1f} ms"
        f" = {statistics.median(credit) / off:.1%} of a step"
    )


if __name__ == "__main__":
    main()
