"""`grpolab demo`'s wall time and what it learned, this checkout against another, alternated in one sitting.

    python benchmarks/demo/wall.py --before DIR [--pairs 3] [--as-cpu avx2] [--args "--nproc 1"] [--json FILE]

Runs ``python -m grpolab demo --no-progress --out TMP`` with the code in DIR ("before": a checkout of another commit)
and with this checkout ("after"), in turn, ``--pairs`` times (before, after, before, ...), each process on its own
with the machine otherwise idle, under ``tools/as-cpu KIND`` when asked. Each run's directory is kept under
``--keep DIR`` when given.

For each run it prints the wall time, the held-out accuracies before and after training (greedy and sampled, with
their 95% intervals) and where the time went, read from the run's files so that both checkouts are measured alike:

- start-up: from the launch to config.json (written once the trainer is built: imports, model, task, processes);
- evaluations and steps: the sums of ``time/eval_s`` and ``time/step_s`` (generation, update) in metrics.jsonl
  (rank 0's clocks);
- other: the rest of the training loop (logs, checks, checkpoints): from config.json to metrics.jsonl's last write,
  less the evaluations and the steps;
- report: from metrics.jsonl's last write to report.html (the table, the plot, the page).

Then the mean wall time of each side and their ratio (after / before).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_demo(code: Path, out: Path, as_cpu: str, extra: list[str]) -> dict:
    """One ``grpolab demo`` with the code in ``code`` (run from there: ``python -m`` puts the working directory first
    on sys.path), its output in ``out``; returns its wall time, accuracies and phases."""
    cmd = [sys.executable, "-m", "grpolab", "demo", "--no-progress", "--out", str(out), *extra]
    if as_cpu:  # the checkout's own: it runs the command from its checkout's root
        cmd = [str(code / "tools" / "as-cpu"), as_cpu, *cmd]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_WAIT_POLICY": "PASSIVE"}
    t0 = time.time()
    res = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if res.returncode:
        raise SystemExit(f"{code}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    (out / "demo.log").write_text(res.stdout + res.stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy_greedy" in r]
    steps = [r for r in rows if "time/step_s" in r]
    built = (out / "config.json").stat().st_mtime
    logged = (out / "metrics.jsonl").stat().st_mtime
    reported = (out / "report.html").stat().st_mtime
    eval_s = sum(r["time/eval_s"] for r in rows if "time/eval_s" in r)
    step_s = sum(r["time/step_s"] for r in steps)
    world = json.loads((out / "config.json").read_text()).get("world_size", 1)
    acc = {
        f"{when}_{kind}": [r[f"eval/accuracy_{kind}"], r[f"eval/accuracy_{kind}_lo"], r[f"eval/accuracy_{kind}_hi"]]
        for when, r in (("before", evals[0]), ("after", evals[-1]))
        for kind in ("greedy", "sampled")
    }
    return {
        "wall_s": wall,
        "processes": world,
        "startup_s": built - t0,
        "eval_s": eval_s,
        "evaluations": len(evals),
        "steps_s": step_s,
        "generate_s": sum(r.get("time/generate_s", 0.0) for r in steps),
        "update_s": sum(r.get("time/update_s", 0.0) for r in steps),
        "other_s": (logged - built) - eval_s - step_s,
        "report_s": reported - logged,
        **acc,
    }


def line(side: str, r: dict) -> str:
    acc = lambda k: f"{r[k][0]:.3f} [{r[k][1]:.3f}, {r[k][2]:.3f}]"  # noqa: E731
    return (
        f"{side:6s} wall {r['wall_s']:6.1f} s on {r['processes']}: start-up {r['startup_s']:5.1f}, "
        f"{r['evaluations']} evals {r['eval_s']:5.1f}, steps {r['steps_s']:6.1f} (gen {r['generate_s']:5.1f}, "
        f"update {r['update_s']:5.1f}), other {r['other_s']:5.1f}, report {r['report_s']:4.1f} | "
        f"greedy {acc('before_greedy')} -> {acc('after_greedy')}; sampled {acc('before_sampled')} -> "
        f"{acc('after_sampled')}"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a checkout of the code to compare against")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--as-cpu", default="", help="run each demo under tools/as-cpu KIND (avx2, bf16)")
    ap.add_argument("--args", default="", help="more flags for this checkout's demo (quoted)")
    ap.add_argument("--before-args", default="", help="more flags for the other checkout's demo (quoted)")
    ap.add_argument("--keep", default="", help="keep each run's directory under here")
    ap.add_argument("--json", default="", help="write every run's figures here")
    args = ap.parse_args(argv)
    sides = {
        "before": (Path(args.before).resolve(), shlex.split(args.before_args)),
        "after": (ROOT, shlex.split(args.args)),
    }
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for side, (code, extra) in sides.items():
                out = Path(args.keep or tmp) / f"{side}-{i}"
                shutil.rmtree(out, ignore_errors=True)
                r = run_demo(code, out, args.as_cpu, extra)
                runs[side].append(r)
                print(f"pair {i + 1} " + line(side, r), flush=True)
    mean = {side: statistics.mean(r["wall_s"] for r in rs) for side, rs in runs.items()}
    print(
        f"mean wall: before {mean['before']:.1f} s, after {mean['after']:.1f} s: "
        f"after / before {mean['after'] / mean['before']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
