"""What a weight sync sends and how long it takes, per engine and precision, on SmolLM2-135M-Instruct.

    python benchmarks/sync/per_sync.py [--cases vllm-lora,worker-lora,worker-1e-6,worker-1e-5] [--steps 10]
                                       [--pairs 1] [--before DIR] [--json FILE]

Each case is ``--steps`` steps of ``grpolab train`` (2 prompts x 4 rollouts of up to 16 tokens, one thread for the
trainer and one for the worker), run with this checkout ("after") and, with ``--before DIR``, with the code in DIR
(a checkout of another commit: "before"), alternated ``--pairs`` times in one sitting (before, after, before, ...):

- ``vllm-lora``: LoRA rank 16, the vllm engine in the trainer's process (fp32, two threads; this checkout's run
  with ``--lora-sync adapter``, since ``auto`` merges on the CPU);
- ``worker-lora``: LoRA rank 16, one generator worker on localhost (fp32);
- ``worker-1e-6``, ``worker-1e-5``: full fine-tuning under bf16-mixed with bf16 rollouts (``--rollout-dtype
  bfloat16``) on one worker, at learning rate 1e-6 and 1e-5.

Per sync it prints the bytes that travelled (``generators/sync_bytes`` or ``vllm/sync_bytes`` where the code
reports them; for code that does not, every weight in the dtype it is sent in, which is what such code sends:
:func:`full_bytes`), the share of the elements that changed (``generators/sync_delta_frac``, where reported), and
the trainer's seconds for the sync (``time/sync_s``), the median over steps 2..N (step 1's sync is the first).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL = "smollm2-135m-instruct"

CASES = {
    "vllm-lora": ["--rollout-engine", "vllm", "--lora-rank", "16", "--lr", "1e-5", "--threads", "2"],
    "worker-lora": ["--lora-rank", "16", "--lr", "1e-5"],
    "worker-1e-6": ["--precision", "bf16-mixed", "--rollout-dtype", "bfloat16", "--lr", "1e-6"],
    "worker-1e-5": ["--precision", "bf16-mixed", "--rollout-dtype", "bfloat16", "--lr", "1e-5"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_bytes(case: str) -> int:
    """What code that sends every weight sends a sync in ``case``: vLLM is handed every served tensor under each of
    its names in the policy's dtype (fp32); a worker gets each distinct tensor once, in fp32 (the LoRA cases, an
    fp32 trainer) or, under bf16-mixed, in the trainer's fp32 too (the sampler keeps fp32 outside its products)."""
    import torch

    from grpolab.models.policy import load_policy

    policy = load_policy(MODEL)
    seen, total = set(), 0
    for name, t in policy.model.named_parameters(remove_duplicate=case != "vllm-lora"):
        key = (t.data_ptr(), name if case == "vllm-lora" else "")
        if key not in seen:
            seen.add(key)
            total += t.numel() * torch.float32.itemsize
    return total


def whole_now(case: str) -> int:
    """A whole version as this checkout sends it to a worker in ``case`` (what a joining worker takes): the flat
    buffers of its layout (LoRA: the base and the factors in fp32; bf16-mixed: the products' weights in bf16, the
    rest fp32)."""
    import contextlib

    import torch

    from grpolab.models.lora import add_lora
    from grpolab.models.policy import load_policy
    from grpolab.rollout.remote.versions import HeldVersions

    model = load_policy(MODEL).model
    lora = "lora" in case
    if lora:
        model = add_lora(model, 16, 32.0)
    products = None if lora else torch.bfloat16
    held = HeldVersions(model, contextlib.nullcontext, torch.float32, 0, "auto", product_dtype=products)
    return sum(b.numel() * b.element_size() for b in held.slot.buffers.values())


def run(case: str, code: Path, steps: int, label: str) -> dict:
    """One run of ``case`` with the code in ``code``: per-sync medians over steps 2..N."""
    out = Path(tempfile.mkdtemp(prefix=f"grpolab-sync-{case}-{label}-"))
    port = free_port()
    cmd = [sys.executable, "-m", "grpolab", "train", "--model", MODEL, "--out", str(out), "--steps", str(steps)]
    cmd += ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "16", "--threads", "1"]
    if label == "after" and case == "vllm-lora":
        cmd += ["--lora-sync", "adapter"]  # auto merges on the CPU (docs/vllm.md): the adapter asked for
    cmd += ["--eval-every", "0", "--save-every", "0", "--warmup-steps", "0", "--no-progress", "--seed", "0"]
    cmd += ["--reward-fn", "vs_trl:parity_reward", "--format-weight", "0", *CASES[case]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT / "benchmarks")])}
    worker = None
    if case.startswith("worker"):
        cmd += ["--generators", "1", "--generator-listen", f"127.0.0.1:{port}"]
        wcmd = [sys.executable, "-m", "grpolab", "generator", "--connect", f"127.0.0.1:{port}", "--threads", "1"]
        worker = subprocess.Popen(wcmd, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # run in the code's own directory: ``python -m`` puts the working directory first on the path
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code)
    if worker is not None:
        worker.wait(timeout=120)
    if res.returncode:
        raise SystemExit(f"{case} ({label}) failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 2 and "time/sync_s" in r]
    got = {"case": case, "code": label, "steps": len(rows) + 1}
    got["sync_s"] = statistics.median(r["time/sync_s"] for r in rows)
    for key in ("generators/sync_bytes", "vllm/sync_bytes", "generators/sync_delta_frac", "generators/sync_s",
                "vllm/sync_s"):  # fmt: skip
        if all(key in r for r in rows):
            got[key.split("/")[1] if key.endswith("frac") else key] = statistics.median(r[key] for r in rows)
    got["bytes"] = got.get("generators/sync_bytes", got.get("vllm/sync_bytes"))
    got["measured_bytes"] = got["bytes"] is not None
    got["final_reward"] = rows[-1].get("reward/mean")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--before", default="", help="a checkout of the code to compare with (alternated)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    results = []
    for case in args.cases.split(","):
        full = full_bytes(case)
        whole = whole_now(case) if case.startswith("worker") else None
        if whole is not None:
            print(f"{case:>12}: a whole version {full / 2**20:.2f} MiB before, {whole / 2**20:.2f} MiB now", flush=True)
        for _ in range(args.pairs):
            codes = ([("before", Path(args.before))] if args.before else []) + [("after", ROOT)]
            for label, code in codes:
                got = run(case, code, args.steps, label)
                if got["bytes"] is None:
                    got["bytes"] = full
                got["full_bytes"], got["whole_now"] = full, whole
                results.append(got)
                frac = got.get("sync_delta_frac")
                print(
                    f"{case:>12} {label:>6}: {got['bytes'] / 2**20:8.2f} MiB a sync"
                    f"{'' if got['measured_bytes'] else ' (every weight)'}, {got['sync_s']:.3f} s"
                    + (f", {frac:.4f} of the elements changed" if frac is not None else "")
                    + f"; reward at step {got['steps']} {got['final_reward']}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
