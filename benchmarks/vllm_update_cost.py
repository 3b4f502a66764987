"""Does the update run slower once vLLM lives in the trainer's process? A fixed forward+backward, timed before the
engine starts, after it starts, and after it has generated.

    python benchmarks/vllm_update_cost.py [--rows 32 --prompt 51 --tokens 32] [--repeats 3] [--compiled] [--threads 2]

SmolLM2-135M-Instruct (``--model``), random token ids: ``--rows`` rows of ``--prompt`` prompt and ``--tokens``
completion tokens, the completion log-probs' forward and backward as the update runs them (one pass, no
checkpointing). The vllm engine is grpolab's (in-process, eager unless ``--compiled``, ``VLLM_CPU_KVCACHE_SPACE``
as set, else 2 GiB). For each phase: every repeat's time, the threads torch uses, the process's live threads, its
peak memory, and the CPU seconds of its busiest threads in the last repeat (a thread of vLLM's spinning beside
the trainer's would show there).
"""

from __future__ import annotations

import argparse
import os
import resource
import time


def thread_cpu_s() -> dict[str, tuple[str, float]]:
    """CPU seconds (user + system) of each live thread of this process, by thread id, with its name."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=51)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="start vLLM compiled (a start of 1-2 minutes)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    from grpolab.common.batch import Batch
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.models.policy import load_policy
    from grpolab.rollout.engine import SamplingSettings
    from grpolab.rollout.spec import EngineSpec, VLLMSettings
    from grpolab.rollout.vllm_engine import VLLMEngine

    torch.set_num_threads(args.threads)
    policy = load_policy(args.model)
    model = policy.model.train()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, 1000, (args.rows, n), generator=g)  # noqa: E731
    ones = lambda n: torch.ones(args.rows, n, dtype=torch.long)  # noqa: E731
    batch = Batch(ids(args.prompt), ones(args.prompt), ids(args.tokens), ones(args.tokens))

    def forward_backward(phase: str) -> None:
        times = []
        for _ in range(args.repeats):
            before, t0 = thread_cpu_s(), time.perf_counter()
            completion_logprobs(model, batch).sum().backward()
            times.append(time.perf_counter() - t0)
            after = thread_cpu_s()
            model.zero_grad(set_to_none=True)
        busy = sorted(((cpu - before.get(t, ("", 0.0))[1], name) for t, (name, cpu) in after.items()), reverse=True)
        print(
            f"{phase:<20} forward+backward {', '.join(f'{t:.2f}' for t in times)} s; torch threads "
            f"{torch.get_num_threads()}, live threads {len(after)}, peak memory "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MB; busiest threads (CPU s): "
            + ", ".join(f"{name} {cpu:.2f}" for cpu, name in busy[:4]),
            flush=True,
        )

    forward_backward("before the engine")
    settings = VLLMSettings(max_model_len=args.prompt + args.tokens + 16, eager=not args.compiled)
    engine = VLLMEngine(model, EngineSpec(policy.eos_id, policy.pad_id, vllm=settings))
    forward_backward("engine started")
    prompts = [row.tolist() for row in batch.prompt_ids]
    engine.generate(prompts, [(0, i) for i in range(args.rows)], SamplingSettings(args.tokens, 1.0, ignore_eos=True))
    forward_backward("after a generation")


if __name__ == "__main__":
    main()
