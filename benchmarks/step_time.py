"""Where a GRPO step's time goes, for the demo configuration.

Runs the trainer for a few steps and prints the median time per step of
generation, scoring and the update, and the update's time divided by one plain
forward+backward pass over the same rollouts (the floor for mu = 1: the update
can skip zero-advantage rollouts, so it can come in under 1.0).

    python benchmarks/step_time.py [--steps 20] [--warmup 3] [--threads 1] [--key value ...]
    python benchmarks/step_time.py --shared-prefix-ab [--key value ...]

Extra ``--key value`` pairs override TrainConfig fields (e.g. --group-size 16).
``--shared-prefix-ab`` runs two trainers in this process, ``--shared-prefix on`` and ``off``,
one step of each in turn (same seed: the same rollouts, so the same update work), and prints
both update times and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from grpolab.commands.parsing import parse_config  # noqa: E402
from grpolab.common import streams  # noqa: E402
from grpolab.config.train import TrainConfig  # noqa: E402
from grpolab.models.logprobs import completion_logprobs  # noqa: E402
from grpolab.rollout.sampler import sample  # noqa: E402
from grpolab.training.recipe import build_trainer
from grpolab.training.trainer import GRPOTrainer  # noqa: E402


def plain_forward_backward(trainer: GRPOTrainer, step: int) -> float:
    """Seconds for one forward+backward over the step's rollouts: masked token-mean of log-probs."""
    cfg, policy = trainer.cfg, trainer.policy
    records = trainer.task_stage.sampler.draw(step, cfg.groups.prompts_per_step)
    prompts = [policy.prompt_ids(r) for r in records for _ in range(cfg.groups.group_size)]
    keys = [
        (streams.ROLLOUT, cfg.run.seed, step, b, g)
        for b in range(cfg.groups.prompts_per_step)
        for g in range(cfg.groups.group_size)
    ]
    batch = sample(
        policy.model,
        prompts,
        keys,
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        eos_id=policy.eos_id,
        pad_id=policy.pad_id,
    )
    policy.model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logp = completion_logprobs(policy.model, batch, cfg.generation.temperature)  # [N, T]
    (logp.sum() / batch.completion_mask.sum()).backward()
    elapsed = time.perf_counter() - t0
    policy.model.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument(
        "--shared-prefix-ab", action="store_true", help="update time with --shared-prefix on vs off, in turn"
    )
    args, rest = ap.parse_known_args()
    if args.shared_prefix_ab:
        return shared_prefix_ab(args, rest)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config(TrainConfig, ["--out", tmp, "--no-progress", *rest], "step_time", "")
        trainer = build_trainer(cfg)
        rows, floors = [], []
        for step in range(1, args.warmup + args.steps + 1):
            m = trainer.step(step).metrics
            if step > args.warmup:
                rows.append(m)
                floors.append(plain_forward_backward(trainer, step))
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    floor = statistics.median(floors)
    print(
        f"config: B={cfg.groups.prompts_per_step} G={cfg.groups.group_size} max_new_tokens={cfg.generation.max_new_tokens} mu={cfg.objective.mu} "
        f"threads={torch.get_num_threads()} model={cfg.policy.model}; median over {args.steps} steps after {args.warmup} warm-up"
    )
    print(f"  generate   {med('time/generate_s'):.3f} s")
    print(f"  score      {med('time/score_s'):.3f} s")
    print(
        f"  update     {med('time/update_s'):.3f} s   (active rollouts: {statistics.median(r['loss/active_frac'] for r in rows):.2f} of the batch)"
    )
    print(f"  step       {med('time/step_s'):.3f} s")
    print(f"  plain forward+backward over the same rollouts: {floor:.3f} s")
    print(f"  update / plain forward+backward = {med('time/update_s') / floor:.2f}")
    ratios = [r["time/update_s"] / f for r, f in zip(rows, floors)]
    print(f"  (per-step ratio, median: {statistics.median(ratios):.2f}; min {min(ratios):.2f}, max {max(ratios):.2f})")
    import resource

    print(
        f"  peak memory (max RSS of this process): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )


def shared_prefix_ab(args, rest: list[str]) -> None:
    times = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            mode: build_trainer(
                parse_config(
                    TrainConfig,
                    ["--out", f"{tmp}/{mode}", "--no-progress", *rest, "--shared-prefix", mode],
                    "step_time",
                    "",
                )
            )
            for mode in times
        }
        for step in range(1, args.warmup + args.steps + 1):
            rewards = {}
            for mode, trainer in trainers.items():
                m = trainer.step(step).metrics
                rewards[mode] = m["reward/mean"]
                if step > args.warmup:
                    times[mode].append(m["time/update_s"])
            assert rewards["on"] == rewards["off"], "the two trainers drew different rollouts"
    cfg = trainers["on"].cfg
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"config: B={cfg.groups.prompts_per_step} G={cfg.groups.group_size} max_new_tokens={cfg.generation.max_new_tokens} mu={cfg.objective.mu} "
        f"beta={cfg.objective.beta} few_shot={cfg.prompt.few_shot} threads={torch.get_num_threads()} model={cfg.policy.model}; "
        f"median over {args.steps} steps after {args.warmup} warm-up, the two trainers in turn"
    )
    print(f"  update, --shared-prefix off: {off:.3f} s")
    print(f"  update, --shared-prefix on:  {on:.3f} s")
    print(
        f"  off / on = {off / on:.2f}x  (per-step ratio, median: "
        f"{statistics.median(a / b for a, b in zip(times['off'], times['on'])):.2f}x)"
    )


if __name__ == "__main__":
    main()
