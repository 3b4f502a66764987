"""What a bf16 precision costs against 32-true on this machine: one training forward and backward of SmolLM2-135M.

    python benchmarks/bf16_cost.py [--model smollm2-135m-instruct] [--rows 8] [--prompt 64] [--completion 64]
                                   [--repeats 5] [--threads 2]
    tools/as-cpu avx2 python benchmarks/bf16_cost.py     # as a CPU without bf16 units

Times the trainer's forward (``grpolab.training.forward.LogProbs``, the log-probs in fp32 from the head's output in
every precision) and a backward of their sum over a seeded batch of ``--rows`` rows, in ``32-true``, ``bf16-mixed``
(autocast over fp32 weights) and ``bf16-true`` (bf16 weights), all in one run so that the ratios compare like with
like. Prints the machine probe's line, each precision's median seconds and its ratio to 32-true: the figure
``grpolab.common.precision.NO_UNITS_COST`` quotes for a CPU without bf16 units (docs/precision.md).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from grpolab.common.batch import Batch  # noqa: E402
from grpolab.common.machine import machine  # noqa: E402
from grpolab.common.precision import Precision  # noqa: E402
from grpolab.models.policy import load_policy  # noqa: E402
from grpolab.training.forward import LogProbs  # noqa: E402


def seeded_batch(vocab: int, rows: int, prompt: int, completion: int) -> Batch:
    """``rows`` rows of random ids: prompts ``[rows, prompt]`` and completions ``[rows, completion]``, all real."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (rows, prompt + completion), generator=gen)
    ones = torch.ones_like(ids)
    return Batch(ids[:, :prompt], ones[:, :prompt], ids[:, prompt:], ones[:, prompt:])


def time_step(model, batch: Batch, precision: Precision, repeats: int) -> list[float]:
    """Seconds of a forward and a backward of the summed log-probs, ``repeats`` times after one warm-up."""
    forward = LogProbs(model, precision=precision)
    seconds = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        forward(*batch.tensors).sum().backward()
        if i:
            seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine().describe()}; {args.threads} threads")
    base = load_policy(args.model, torch.float32).model.train()
    batch = seeded_batch(base.config.vocab_size, args.rows, args.prompt, args.completion)
    medians = {}
    for name in ("32-true", "bf16-mixed", "bf16-true"):
        precision = Precision(name)
        model = copy.deepcopy(base).to(precision.param_dtype)
        medians[name] = statistics.median(time_step(model, batch, precision, args.repeats))
        del model
    for name, s in medians.items():
        print(f"{name:>10}: {s:.3f} s a forward and backward, {s / medians['32-true']:.2f}x 32-true")


if __name__ == "__main__":
    main()
