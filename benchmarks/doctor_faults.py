"""The doctor on short built-in runs that each have one fault: what it names first, how grave, at which check step,
and on what evidence; then the same on a healthy run. The faults are those of tests/doctor/test_doctor.py (which asserts
the first finding); this prints the table of docs/doctor.md.

    python benchmarks/doctor_faults.py [--out runs/doctor-faults]

Each run is the tests' small shape (4 prompts x 4 rollouts, 8 steps unless said) at one thread, seconds each.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the reward fixtures the faults use (reward_fixtures:NAME)

FAULTS = {
    "a reward that is always 1": dict(reward_fn=("reward_fixtures:always_one",)),
    "--max-new-tokens 2": dict(max_new_tokens=2),
    "a reward function that rejects every answer's format (raises)": dict(
        reward_fn=("reward_fixtures:strict_answer_tag",)
    ),
    "--lr 1e-9": dict(lr=1e-9),
    "--precision bf16-true --compensation none (plain AdamW on bf16 weights)": dict(
        precision="bf16-true", compensation="none"
    ),
    "--lr 1e-1 --mu 4": dict(lr=1e-1, mu=4),
    "a reward paying for length (15 steps, --lr 1e-3)": dict(
        reward_fn=("reward_fixtures:pays_for_length",), steps=15, eval_every=5, lr=1e-3
    ),
    "--rollout-dtype bfloat16 --engine-correction none": dict(rollout_dtype="bfloat16", engine_correction="none"),
    "--entropy-coef 1 --lr 1e-3 (12 steps)": dict(entropy_coef=1.0, lr=1e-3, steps=12),
    "a reward right 95% of the time, G = 8": dict(reward_fn=("reward_fixtures:mostly_one",), group_size=8),
    "none (15 steps)": dict(steps=15, eval_every=5),
}


def main() -> None:
    from helpers.runs import quiet, small_cfg

    from grpolab.doctor.examine import examine
    from grpolab.training.recipe import train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/doctor-faults")
    args = ap.parse_args()
    out = Path(args.out)
    print("| fault | first finding | severity | found at step | evidence | then |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, (fault, options) in enumerate(FAULTS.items()):
        run = out / f"fault{i}"
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        train(small_cfg(run, **{"steps": 8, "warmup_steps": 0, "log_rollouts": True, **options}), log=quiet)
        found = examine(run)[1]
        seconds = time.perf_counter() - t0
        if not found:
            print(f"| {fault} | none | | | | ({seconds:.0f} s) |")
            continue
        f = found[0]
        rest = ", ".join(g.name for g in found[1:]) or "-"
        cells = [fault, f"{f.name}: {f.title}", f.severity, str(f.first_step), f.evidence, f"{rest} ({seconds:.0f} s)"]
        print("| " + " | ".join(c.replace("|", r"\|") for c in cells) + " |")


if __name__ == "__main__":
    main()
