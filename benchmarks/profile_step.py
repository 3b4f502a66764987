"""Where the demo's GRPO step spends its time, by operator: torch.profiler over a few steps, sorted by self CPU time.

    python benchmarks/profile_step.py [--steps 10] [--warmup 3] [--rows 25] [--threads 0]
                                      [--model smollm2-135m-instruct --prompts 4 --group-size 8 --max-new-tokens 32]
    tools/as-cpu avx2 python benchmarks/profile_step.py      # as a CPU with AVX2 alone

Builds the trainer ``grpolab demo`` trains (the built-in warm start and its settings; with ``--model``, the
real-model demo's preset on that model, ``--prompts``, ``--group-size`` and ``--max-new-tokens`` as given), runs ``--warmup`` steps, then profiles ``--steps`` steps and prints the machine probe's
line, the median step time and the ``--rows`` operators with the most self CPU time (torch.profiler's table). The
evaluations are left out: the steps alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from grpolab.commands.demo import DemoConfig, demo_train_config, warm_start  # noqa: E402
from grpolab.common.machine import machine  # noqa: E402
from grpolab.training.recipe import build_trainer  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--threads", type=int, default=0, help="0: the demo's (the machine's cores)")
    ap.add_argument("--model", default="", help="a real model (the real-model demo's preset); '': the built-in demo")
    ap.add_argument("--prompts", type=int, default=0, help="prompts a step (0: the preset's)")
    ap.add_argument("--group-size", type=int, default=0, help="rollouts a prompt (0: the preset's)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the preset's")
    args = ap.parse_args(argv)
    out = tempfile.mkdtemp(prefix="grpolab-profile-")
    if args.model:
        cfg = demo_train_config(DemoConfig(out=out, progress=False, model=args.model))
    else:
        cfg = demo_train_config(DemoConfig(out=out, progress=False), warm_start(False, _Quiet()))
    over = dict(prompts_per_step=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens)
    cfg = cfg.replace(eval_every=0, save_every=0, threads=args.threads, **{k: v for k, v in over.items() if v})
    trainer = build_trainer(cfg, log=lambda *a, **k: None)
    print(f"machine: {machine().describe()}; threads {cfg.machine.threads or 'auto'}")
    try:
        for t in range(1, args.warmup + 1):
            trainer.step(t)
        seconds = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for t in range(args.warmup + 1, args.warmup + args.steps + 1):
                t0 = time.perf_counter()
                trainer.step(t)
                seconds.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    print(
        f"median step {statistics.median(seconds):.3f} s over {args.steps} steps (profiled: the profiler adds its own)"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


class _Quiet:
    def print(self, *a, **k) -> None:
        pass


if __name__ == "__main__":
    main()
