"""What the network seam costs: generator workers (``--generators N``) against the generator process in the machine.

    python benchmarks/generators.py [--model smollm2-135m-instruct] [--syncs 3] [--steps 3] [--tokens 256]
                                    [--json FILE]

On SmolLM2-135M-Instruct (fp32 trainer, one thread per process):

1. **The weight broadcast.** A pool with one worker on localhost (gloo); ``--syncs`` weight syncs in the rollout
   dtype (float32, then bfloat16): seconds a sync against the bytes sent, and the rate.
2. **A step at K = 1.** ``--max-staleness 1``, 2 prompts x 4 rollouts of ``--tokens`` new tokens each (every row
   to T: ``--ignore-eos``), ``--steps`` steps after one unmeasured step, with the draws in the generator process
   (``--generator process``, weights through shared memory) and on one worker (``--generators 1``, a
   ``grpolab generator`` process on localhost): the median step, generation wait, update and sync times.
3. **The model.** With K = 1 the next step's draw runs while the trainer updates. On N workers, each on a device
   of its own, a step takes the longer of the trainer's side (update + the weights' send) and the draw's
   (its work over N workers, plus the draw's frames): the prediction from (2)'s phase times, checked at N = 1
   against the measured step. On this 2-core machine trainer and worker share the cores, so N > 1 cannot be
   faster here, and the N = 1 check is of a machine where both phases already share 2 cores.

Prints every figure; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(port: int, threads: int = 1) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "grpolab", "generator", "--connect", f"127.0.0.1:{port}", "--threads", str(threads)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def broadcast(args) -> list[dict]:
    """Seconds a weight sync takes to one worker, per rollout dtype."""
    import torch

    from grpolab.common.rng import set_threads
    from grpolab.models.policy import load_policy
    from grpolab.rollout.workers import WorkerPool

    set_threads(1)
    policy = load_policy(args.model, torch.float32)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        port = free_port()
        proc = worker(port)
        pool = WorkerPool(
            policy.model, eos_id=policy.eos_id, pad_id=policy.pad_id, dtype=dtype, listen=f"127.0.0.1:{port}",
            say=lambda s: None,
        )  # fmt: skip
        size = sum(b.numel() * b.element_size() for b in pool.slot.buffers.values())
        times = []
        for _ in range(args.syncs):
            t0 = time.perf_counter()
            pool.weights_changed()
            times.append(time.perf_counter() - t0)
        pool.close()
        proc.wait(timeout=60)
        s = statistics.median(times)
        row = {"dtype": str(dtype).removeprefix("torch."), "bytes": size, "seconds": s, "all": times}
        print(
            f"broadcast {row['dtype']:>8}: {size / 1e6:,.0f} MB a sync, median {s:.3f} s over {args.syncs} "
            f"({size / s / 1e9:.2f} GB/s; each: {', '.join(f'{t:.3f}' for t in times)})",
            flush=True,
        )
        rows.append(row)
    return rows


def step_times(args, mode: str) -> dict:
    """One ``grpolab train`` run at K = 1 in ``mode`` (process | workers): its per-step times."""
    out = Path(tempfile.mkdtemp(prefix=f"grpolab-gen-{mode}-"))
    port = free_port()
    cmd = [sys.executable, "-m", "grpolab", "train", "--model", args.model, "--out", str(out)]
    cmd += ["--steps", str(args.steps + 1), "--prompts-per-step", "2", "--group-size", "4", "--threads", "1"]
    cmd += ["--max-new-tokens", str(args.tokens), "--ignore-eos", "--max-staleness", "1", "--no-progress"]
    cmd += ["--eval-every", "0", "--save-every", "0", "--warmup-steps", "0", "--doctor", "off"]
    cmd += ["--generator", "process", "--generator-threads", "1"] if mode == "process" else []
    cmd += ["--generators", "1", "--generator-listen", f"127.0.0.1:{port}"] if mode == "workers" else []
    procs = [worker(port)] if mode == "workers" else []
    res = subprocess.run(cmd, capture_output=True, text=True)
    for p in procs:
        p.wait(timeout=120)
    if res.returncode:
        raise SystemExit(f"{mode} run failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 2]  # after the first step (the start, the first draw alone)
    keys = ("time/step_s", "time/generate_s", "time/update_s", "time/sync_s")
    med = {k.removeprefix("time/"): statistics.median(r[k] for r in rows) for k in keys}
    print(
        f"K=1 T={args.tokens} {mode:>8}: step {med['step_s']:.2f} s (waiting for the draw {med['generate_s']:.2f} s, "
        f"update {med['update_s']:.2f} s, weights {med['sync_s']:.2f} s), median of steps 2-{args.steps + 1}",
        flush=True,
    )
    return {"mode": mode, **med, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--json", default="")
    args = p.parse_args()
    results = {"broadcast": broadcast(args)}
    process, workers = step_times(args, "process"), step_times(args, "workers")
    results["steps"] = [process, workers]
    overhead = workers["step_s"] - process["step_s"]
    print(
        f"the network path's overhead at N=1: {overhead:+.2f} s a step ({workers['step_s'] / process['step_s']:.2f}x)"
    )
    # The model: at K = 1 the next step's draw runs beside the update, so a step is the longer of the trainer's
    # side (update + weights) and the draw's own time (the worker's clock, generators/draw_s) over N workers.
    draw = statistics.median(r["generators/draw_s"] for r in workers["rows"])
    trainer_side = workers["update_s"] + workers["sync_s"]
    results["model"] = {"draw_s": draw, "trainer_s": trainer_side, "predicted": {}}
    print(
        f"the model's inputs (N=1 run): update {workers['update_s']:.2f} s + weights {workers['sync_s']:.2f} s "
        f"= {trainer_side:.2f} s; the draw on the worker {draw:.2f} s; broadcast alone {results['broadcast'][0]['seconds']:.2f} s"
    )
    for n in (1, 2, 4, 8):
        predicted = max(trainer_side, draw / n)
        results["model"]["predicted"][n] = predicted
        print(f"predicted step with {n} worker(s), each on a device of its own: {predicted:.2f} s")
    print(
        f"check at N=1: predicted {max(trainer_side, draw):.2f} s against measured {workers['step_s']:.2f} s "
        f"({workers['step_s'] / max(trainer_side, draw):.2f}x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
