"""Peak memory and time of the update's forward+backward on long completions, as the update runs it.

    python benchmarks/update_memory.py --rows 8 --tokens 1024 [--micro-batch-tokens 2048] [--gradient-checkpointing]
                                       [--precision 32-true|bf16-mixed|bf16-true] [--fp32-head] [--profile N]

SmolLM2-135M-Instruct (``--model``), ``--rows`` completions of one prompt whose lengths vary (``--tokens``, then 37
fewer each row), random token ids: one forward and backward of the completion log-probs over the passes the update
would plan (the whole batch, or ``--micro-batch-tokens``), with the shared prompt prefix as in training. Prints the
time, the process's peak memory (max RSS) before and after, and the log-probs' sum (equal across plans up to float
rounding). Run one configuration per process: max RSS only grows. ``--precision``: the weights' dtype and the
autocast of ``--precision`` (the trainer's own forward, ``grpolab.training.forward.LogProbs``); ``--profile N``: also
print torch.profiler's table of the N operators with the most self CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="the longest completion; each next row 37 fewer")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="plan passes by this token budget (0: one pass)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "bf16-true"))
    p.add_argument("--fp32-head", action="store_true")
    p.add_argument("--profile", type=int, default=0, help="print the profiler's N rows by self CPU time")
    args = p.parse_args()

    import torch

    from grpolab.common.batch import Batch, left_pad, select
    from grpolab.common.precision import Precision
    from grpolab.models.policy import enable_activation_checkpointing, load_policy
    from grpolab.training.forward import LogProbs
    from grpolab.training.update import token_budget_chunks

    torch.set_num_threads(args.threads)
    precision = Precision(args.precision, fp32_head=args.fp32_head)
    policy = load_policy(args.model, precision.param_dtype)
    policy.model.train()
    if args.gradient_checkpointing:
        enable_activation_checkpointing(policy.model)
    N, T = args.rows, args.tokens
    prompt_ids, prompt_mask = left_pad([policy.prompt_ids({"prompt": "What is 12 + 30?"})] * N, policy.pad_id)
    lengths = torch.tensor([max(1, T - 37 * i) for i in range(N)])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [N, T]
    ids = torch.randint(100, 40000, (N, T), generator=torch.Generator().manual_seed(0)) * completion_mask
    batch = Batch(prompt_ids, prompt_mask, ids, completion_mask)
    rows = torch.arange(N)
    budget = args.micro_batch_tokens
    passes = token_budget_chunks(rows, prompt_mask.sum(1), lengths, budget) if budget else [rows]

    forward = LogProbs(policy.model, shared_prefix=True, precision=precision)  # the trainer's, under its autocast
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    t0 = time.perf_counter()
    total = 0.0
    with profiler or contextlib.nullcontext():
        for idx in passes:
            logp = forward(*select(batch, idx))  # [n, T']
            (logp.sum() / completion_mask.sum()).backward()
            total += float(logp.detach().sum())
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"precision {args.precision}{' (fp32 head)' if args.fp32_head else ''}, rows {N}, tokens {T} "
        f"(real {int(lengths.sum())}), micro-batch-tokens {budget} ({len(passes)} passes), "
        f"checkpointing {args.gradient_checkpointing}: {seconds:.1f} s, peak {peak_mb:.0f} MB "
        f"(+{peak_mb - loaded_mb:.0f} MB over the loaded model), log-prob sum {total:.3f}"
    )
    if profiler is not None:  # the profiler's own overhead is in the time above: compare unprofiled runs
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))


if __name__ == "__main__":
    main()
