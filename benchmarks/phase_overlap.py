"""Can generation and the update run at the same time on this machine? Each phase alone and beside the other.

    python benchmarks/phase_overlap.py [--rows 8] [--tokens 128] [--update-rows 4] [--update-len 256] [--passes 3]
                                       [--json FILE]

SmolLM2-135M-Instruct in fp32, each phase in its own process (started fresh, the model loaded and warmed up before
the clock starts):

- decode: grpolab's hf engine drawing ``--rows`` completions of one 64-token prompt, every row run to ``--tokens``
  new tokens (EOS cannot stop it);
- update: ``--passes`` forward and backward passes over ``--update-rows`` x ``--update-len`` tokens (the update's
  work; the optimizer's step is a small share of it).

Each phase alone at one thread and at two, then both at once, one thread each, started together. What it says for
an asynchronous loop on this 2-core CPU: the synchronous step runs the phases one after the other, each with both
cores (decode(2) + update(2)); a generator one step behind (``--max-staleness 1``) runs them side by side on a core
each (the longer of the two beside the other); with the generator on a second device of its own, the longer of the
two phases alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _phase(role: str, threads: int, args, start, results) -> None:
    """One process: load SmolLM2, warm ``role`` up, wait for ``start``, time it, put (role, threads, seconds)."""
    import torch

    torch.set_num_threads(threads)
    from grpolab.models.policy import load_policy
    from grpolab.rollout.engine import EngineSpec, HFEngine
    from grpolab.rollout.sampler import SamplingSettings

    policy = load_policy("smollm2-135m-instruct", torch.float32)
    model = policy.model
    if role == "decode":
        engine = HFEngine(model, EngineSpec(policy.eos_id, policy.pad_id))
        prompt = policy.tokenizer("Count the letters in each word you see, one line a word. " * 8)["input_ids"][:64]

        def run(tokens: int) -> None:
            keys = [(0, 0, 0, i) for i in range(args.rows)]
            engine.generate([prompt] * args.rows, keys, SamplingSettings(tokens, 1.0, ignore_eos=True))

        run(8)  # warm-up: the packed copy, the kernels
        work = lambda: run(args.tokens)  # noqa: E731
    else:
        model.train()
        ids = torch.randint(0, model.config.vocab_size, (args.update_rows, args.update_len))

        def step(passes: int) -> None:
            for _ in range(passes):
                model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        step(1)  # warm-up
        work = lambda: step(args.passes)  # noqa: E731
    start.wait()
    t0 = time.perf_counter()
    work()
    results.put((role, threads, time.perf_counter() - t0))


def _run(roles: list[tuple[str, int]], args) -> dict[str, float]:
    """The phases of ``roles`` in processes of their own, timed from one common start."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(len(roles)), ctx.Queue()
    procs = [ctx.Process(target=_phase, args=(role, threads, args, start, results)) for role, threads in roles]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        role, threads, seconds = results.get(timeout=1800)
        out[role] = seconds
    for p in procs:
        p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--update-rows", type=int, default=4)
    ap.add_argument("--update-len", type=int, default=256)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    t = {}
    for role in ("decode", "update"):
        for threads in (1, 2):
            t[f"{role} alone, {threads} thread{'s' if threads > 1 else ''}"] = _run([(role, threads)], args)[role]
            print(f"{role} alone at {threads} thread(s): {t[list(t)[-1]]:.2f} s", flush=True)
    both = _run([("decode", 1), ("update", 1)], args)
    t["decode beside the update, 1 thread"] = both["decode"]
    t["update beside decode, 1 thread"] = both["update"]
    print(f"together, a thread each: decode {both['decode']:.2f} s, update {both['update']:.2f} s")
    sync = t["decode alone, 2 threads"] + t["update alone, 2 threads"]
    overlapped = max(both.values())
    two_devices = max(t["decode alone, 2 threads"], t["update alone, 2 threads"])
    print(f"synchronous step (decode then update, 2 threads each): {sync:.2f} s")
    print(f"one step behind, side by side on a core each: {overlapped:.2f} s ({sync / overlapped:.2f}x)")
    print(f"one step behind, the generator on a device of its own: {two_devices:.2f} s ({sync / two_devices:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "seconds": t, "sync": sync, "overlapped": overlapped}, f, indent=2)


if __name__ == "__main__":
    main()
