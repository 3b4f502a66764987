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
   The reward is ``vs_trl:parity_reward`` (half of each group scores 1), so every update is a real one.
3. **The model** (:func:`predicted_step`). With K = 1 the next step's draw runs while the trainer scores and
   updates. On N workers, each on a device of its own, a step takes the longer of the trainer's side (score +
   update) and a worker's (the draw's work over N), then the N broadcasts, one a worker in turn. Its inputs are
   measured apart: the draw on the worker's own clock (``generators/draw_s``), the trainer's score and update
   times, one broadcast to an idle worker (1). Checked at N = 1 against the measured step: on this 2-core machine
   the trainer and its one worker have a core each, as separate devices would; N > 1 cannot be faster here.
4. **A part's draw against its rows.** One engine draws 8, 4, 2, 1 rows of ``--tokens`` tokens: the model takes a
   part of 8 / N rows at its measured cost, not at 1 / N of the whole.

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


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
    from grpolab.rollout.remote.pool import WorkerPool
    from grpolab.rollout.spec import EngineSpec

    set_threads(1)
    policy = load_policy(args.model, torch.float32)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        port = free_port()
        proc = worker(port)
        pool = WorkerPool(
            policy.model, EngineSpec(policy.eos_id, policy.pad_id, dtype), listen=f"127.0.0.1:{port}",
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


def draw_by_rows(args) -> dict[int, float]:
    """Seconds one engine (hf, fp32, one thread, as a worker's) takes to draw a part of 8, 4, 2 and 1 rows of
    ``--tokens`` tokens each (every row to T): a part of B / N rows is not B / N of the work (a decode step reads
    every weight whatever the batch)."""
    import torch

    from grpolab.common.rng import set_threads
    from grpolab.models.policy import load_policy
    from grpolab.rollout.engine import EngineSpec, HFEngine
    from grpolab.rollout.sampler import SamplingSettings

    set_threads(1)
    policy = load_policy(args.model, torch.float32)
    engine = HFEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id))
    prompt = policy.tokenizer("What is 17 + 25? Answer with a number.")["input_ids"]
    settings = SamplingSettings(max_new_tokens=args.tokens, temperature=1.0, ignore_eos=True)
    out = {}
    for rows in (8, 4, 2, 1):
        t0 = time.perf_counter()
        engine.generate([prompt] * rows, [(0, 0, i) for i in range(rows)], settings)
        out[rows] = time.perf_counter() - t0
        print(f"draw of {rows} row(s) x {args.tokens} tokens on one engine: {out[rows]:.2f} s", flush=True)
    return out


def step_times(args, mode: str) -> dict:
    """One ``grpolab train`` run at K = 1 in ``mode`` (process | workers): its per-step times."""
    out = Path(tempfile.mkdtemp(prefix=f"grpolab-gen-{mode}-"))
    port = free_port()
    cmd = [sys.executable, "-m", "grpolab", "train", "--model", args.model, "--out", str(out)]
    cmd += ["--steps", str(args.steps + 1), "--prompts-per-step", "2", "--group-size", "4", "--threads", "1"]
    cmd += ["--max-new-tokens", str(args.tokens), "--ignore-eos", "--max-staleness", "1", "--no-progress"]
    cmd += ["--eval-every", "0", "--save-every", "0", "--warmup-steps", "0", "--doctor", "off"]
    cmd += ["--reward-fn", "vs_trl:parity_reward", "--format-weight", "0"]  # half of each group scores: a real update
    cmd += ["--generator", "process", "--generator-threads", "1"] if mode == "process" else []
    cmd += ["--generators", "1", "--generator-listen", f"127.0.0.1:{port}"] if mode == "workers" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    procs = [worker(port)] if mode == "workers" else []
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for p in procs:
        p.wait(timeout=120)
    if res.returncode:
        raise SystemExit(f"{mode} run failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 2]  # after the first step (the start, the first draw alone)
    keys = ("time/step_s", "time/generate_s", "time/score_s", "time/update_s", "time/sync_s")
    med = {k.removeprefix("time/"): statistics.median(r[k] for r in rows) for k in keys}
    if mode == "workers":
        med["draw_s"] = statistics.median(r["generators/draw_s"] for r in rows)  # the worker's own clock
    print(
        f"K=1 T={args.tokens} {mode:>8}: step {med['step_s']:.2f} s (waiting for the draw {med['generate_s']:.2f} s, "
        f"score {med['score_s']:.2f} s, update {med['update_s']:.2f} s, weights {med['sync_s']:.2f} s)"
        + (f"; the draw on the worker {med['draw_s']:.2f} s" if "draw_s" in med else "")
        + f"; median of steps 2-{args.steps + 1}",
        flush=True,
    )
    return {"mode": mode, **med, "rows": rows}


def predicted_step(part: float, trainer: float, broadcast: float, n: int) -> float:
    """The step at K = 1 on ``n`` workers, each on a device of its own. Each worker draws its part of the next step
    (``part`` seconds) while the trainer scores and updates (``trainer``); then the new weights go to each worker in
    turn (``broadcast`` each), which neither side can overlap: a worker takes them after its draw, and the draw after
    next is sent once they are there."""
    return max(trainer, part) + n * broadcast


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
    # The model's inputs, each measured apart: the draw on the worker's clock, the trainer's own work (score +
    # update), one broadcast to an idle worker (part 1, fp32: this run's rollout dtype), and how a part's draw
    # scales with its rows (part 4).
    draw, trainer = workers["draw_s"], workers["score_s"] + workers["update_s"]
    one = results["broadcast"][0]["seconds"]
    rows = draw_by_rows(args)
    results["draw_by_rows"] = rows
    results["model"] = {"draw_s": draw, "trainer_s": trainer, "broadcast_s": one, "predicted": {}}
    print(
        f"the model's inputs: the draw on one worker {draw:.2f} s; the trainer's score + update {trainer:.2f} s; "
        f"one broadcast to an idle worker {one:.2f} s"
    )
    for n in (1, 2, 4, 8):
        part = draw * rows[8 // n] / rows[8]  # 8 rows a step split n ways: the measured cost of 8 / n rows
        predicted = predicted_step(part, trainer, one, n)
        results["model"]["predicted"][n] = predicted
        print(
            f"predicted step with {n} worker(s), each on a device of its own: {predicted:.2f} s (a part's draw "
            f"{part:.2f} s; if the draw split evenly: {predicted_step(draw / n, trainer, one, n):.2f} s)"
        )
    at1 = results["model"]["predicted"][1]
    print(
        f"check at N=1 (trainer and worker one core each here): predicted {at1:.2f} s against measured "
        f"{workers['step_s']:.2f} s (measured / predicted {workers['step_s'] / at1:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
