"""What the hacking signs cost a run: the built-in model trained with the signs at their default cadence and with
them off (--hacking-every 0 --honeypots none), alternated in one sitting, each run in a fresh process.

    python benchmarks/hacking_cost.py [--pairs 3] [--steps 40] [--out runs/hacking_cost]

Prints, per run and over the pairs: the mean training step (time/step_s: sampling, scoring, the update and the
observers), the signs' own time per step (time/hacking_s), the honeypots' time per evaluation (time/honeypot_s)
against the evaluation's (time/eval_s), and the whole run's wall time; then the ratios on/off. Figures are this
machine's: compare only within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

OFF = ["--hacking-every", "0", "--honeypots", "none"]


def run(out: Path, steps: int, signs: bool) -> dict:
    """One run; its figures."""
    args = [sys.executable, "-m", "grpolab", "train", "--nproc", "1", "--steps", str(steps), "--eval-every", "10", "--threads", "1",
            "--no-progress", "--save-every", "0", "--out", str(out), *([] if signs else OFF)]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if r["step"] > 0 and "time/step_s" in r]
    evals = [r for r in rows if "time/eval_s" in r]
    return {
        "step_s": statistics.fmean(r["time/step_s"] for r in steps_),
        "hacking_s": statistics.fmean(r.get("time/hacking_s", 0.0) for r in steps_),
        "eval_s": statistics.fmean(r["time/eval_s"] for r in evals),
        "honeypot_s": statistics.fmean(r.get("time/honeypot_s", 0.0) for r in evals),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="on/off pairs, alternated (default 3)")
    p.add_argument("--steps", type=int, default=40, help="training steps a run (default 40)")
    p.add_argument("--out", type=Path, default=Path("runs/hacking_cost"))
    a = p.parse_args()
    got: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(a.pairs):
        for kind in ("on", "off") if i % 2 == 0 else ("off", "on"):
            got[kind].append(run(a.out / f"{kind}{i}", a.steps, kind == "on"))
            f = got[kind][-1]
            print(f"pair {i} {kind:>3}: step {f['step_s']:.3f} s (signs {f['hacking_s']:.4f} s), eval {f['eval_s']:.2f} s "
                  f"(honeypots {f['honeypot_s']:.2f} s), wall {f['wall_s']:.1f} s", flush=True)  # fmt: skip
    m = {k: {q: statistics.fmean(f[q] for f in v) for q in v[0]} for k, v in got.items()}
    print(f"\nmean over {a.pairs} pairs, {a.steps} steps each (evaluations every 10 steps):")
    print("| | signs on | signs off | on / off |\n|---|---|---|---|")
    for q, name in (("step_s", "training step (s)"), ("eval_s", "evaluation (s)"), ("wall_s", "run wall time (s)")):
        print(f"| {name} | {m['on'][q]:.3f} | {m['off'][q]:.3f} | {m['on'][q] / m['off'][q]:.3f} |")
    share = m["on"]["hacking_s"] / m["on"]["step_s"]
    print(f"\nthe signs' own time: {m['on']['hacking_s'] * 1000:.1f} ms a step ({100 * share:.2f}% of a step); the "
          f"honeypots: {m['on']['honeypot_s']:.2f} s an evaluation ({100 * m['on']['honeypot_s'] / m['on']['eval_s']:.1f}% "
          "of it)")  # fmt: skip


if __name__ == "__main__":
    main()
