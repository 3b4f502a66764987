"""Step time of grpolab against TRL's GRPOTrainer on the same model, prompts and settings.

    pip install -e ".[bench]"      # trl, an optional extra: never a runtime dependency
    python benchmarks/vs_trl.py --model smollm2-135m-instruct [--prompts 4 --group-size 8 --max-new-tokens 32 --steps 5
                                [--few-shot K] [--reward task|parity] --threads 2] [--rollout-engine hf,vllm]
                                [--shapes 4x8x32,32x8x128]

Each configuration runs in its own process (so none inherits another's allocator or
threads): TRL with its default GRPOConfig (gradient checkpointing on), TRL with gradient
checkpointing off, grpolab (its defaults: shared prompt prefix on, no activation
checkpointing) and grpolab with --gradient-checkpointing. All use the same built-in
arithmetic prompts (with K solved examples before each question for --few-shot K), G, B,
maximum completion length, mu = 1, beta = 0, temperature 1, top-p 1, fp32 on the CPU, one
process. Prints the median step time of each over the steps after the warm-up, its peak
memory (max RSS of the process), the ratios, and, in grpolab's process, the sampling
throughput of grpolab's sampler next to ``model.generate`` on the same batch.

``--rollout-engine hf,vllm`` adds grpolab with the vllm rollout engine (``grpolab-vllm``: vLLM in
the trainer's process, compiled unless ``--vllm-eager``; its start time is printed) and TRL with
``use_vllm=True`` in colocate mode (``trl-vllm``; its error is printed if it fails). The
``grpolab-vllm`` process also measures the new tokens/s of the vllm engine, grpolab's sampler and
``model.generate`` on the same batch, and splits each step into generate / sync / update.
``--shapes BxGxT,...`` runs the comparison for each shape in turn; ``--steps 0`` measures only the
sampling throughputs (one pass each: for long completions a step costs minutes on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = ("trl-default", "trl-no-ckpt", "trl-vllm", "grpolab", "grpolab-ckpt", "grpolab-vllm")
VLLM_CONFIGS = ("trl-vllm", "grpolab-vllm")


def parity_reward(completions: list[str], records: list[dict]) -> list[float]:
    """--reward parity: 1 if the completion has an odd number of characters. Meaningless, but about half of
    every group scores 1, so every rollout has a nonzero advantage and every update is dense."""
    return [float(len(c) % 2) for c in completions]


def _prompts(n: int) -> list[dict]:
    from grpolab.data.arithmetic import TrainSampler

    return TrainSampler(0).draw(0, n)


def _few_shot(k: int) -> list[dict]:
    """The K solved examples grpolab's trainer puts before each question (seed 0, default task)."""
    from grpolab.data.arithmetic import ArithmeticSpec, TrainSampler, test_set

    spec = ArithmeticSpec()
    exclude = {r["question"] for r in test_set(500, spec)}
    return [
        {"question": r["question"], "answer": r["answer"]} for r in TrainSampler(0, spec, exclude=exclude).few_shot(k)
    ]


def run_trl(args, checkpointing: bool, use_vllm: bool = False) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from grpolab.models.policy import load_policy
    from grpolab.rewards.builtin import accuracy_reward, format_reward

    policy = load_policy(args.model, few_shot=_few_shot(args.few_shot))
    records = _prompts(args.prompts * (args.steps + args.warmup))
    if policy.chat:
        rows = [{"prompt": policy.chat_messages(r), "ground_truth": r["ground_truth"]} for r in records]
    else:
        shots = "".join(f"{ex['question']}\n{ex['answer']}\n\n" for ex in policy.few_shot)
        rows = [{"prompt": shots + r["question"] + "\n", "ground_truth": r["ground_truth"]} for r in records]
    dataset = Dataset.from_list(rows)

    def reward(completions, ground_truth, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        recs = [{"ground_truth": g} for g in ground_truth]
        if args.reward == "parity":
            return parity_reward(texts, recs)
        return [a + 0.1 * f for a, f in zip(accuracy_reward(texts, recs), format_reward(texts, recs))]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    cfg = trl_config(
        args,
        "/tmp/grpolab-trl-bench",
        learning_rate=5e-5,
        gradient_checkpointing=checkpointing,
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False} if use_vllm else {}),
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        callbacks=[Timer()],
    )
    torch.manual_seed(0)
    trainer.train()
    return times


def trl_config(args, output_dir: str, **over):
    """TRL's GRPOConfig as the benchmarks run it: its defaults but fp32 on the CPU, mu = 1, beta = 0, temperature 1,
    top-p 1, the shape and step count of ``args``; ``over``: anything else."""
    from trl import GRPOConfig

    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        max_steps=args.steps + args.warmup,
        num_iterations=1,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1000,
        disable_tqdm=True,
    )
    return GRPOConfig(**{**options, **over})


def run_grpolab(args, checkpointing: bool, engine: str = "hf") -> list[float]:
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import build_trainer

    cfg = TrainConfig(
        model=args.model,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        mu=1,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        few_shot=args.few_shot,
        threads=args.threads,
        steps=max(1, args.steps + args.warmup),
        out="/tmp/grpolab-bench-run",
        progress=False,
        gradient_checkpointing=checkpointing,
        device="cpu",
        rollout_engine=engine,
        vllm_compile=not args.vllm_eager,
        **({"reward_fn": "vs_trl:parity_reward", "format_weight": 0.0} if args.reward == "parity" else {}),
    )
    trainer = build_trainer(cfg, log=print)
    times = []
    for step in range(1, args.steps + args.warmup + 1 if args.steps else 1):  # --steps 0: sampling only
        t0 = time.perf_counter()
        m = trainer.step(step).metrics
        times.append(time.perf_counter() - t0)
        print(
            f"STEP {step} {times[-1]:.2f} s: generate {m['time/generate_s']:.2f} s, sync {m['time/sync_s']:.2f} s, "
            f"update {m['time/update_s']:.2f} s, rollouts with nonzero advantage {m['loss/active_frac']:.2f}",
            flush=True,
        )
    if not checkpointing:
        sampling_throughput(trainer, args.steps + args.warmup + 1, 2 if args.steps else 1, args.skip_generate)
    return times


def _vllm_new_tokens(trainer, prompts: list, keys: list) -> int:
    """The vllm engine's new tokens for ``prompts``."""
    from grpolab.rollout.engine import SamplingSettings

    settings = SamplingSettings(trainer.cfg.generation.max_new_tokens, 1.0, 1.0)
    return int(trainer.sampling_stage.engine.generate(prompts, keys, settings).batch.completion_mask.sum())


def _sampler_new_tokens(trainer, prompts: list, keys: list) -> int:
    """grpolab's sampler's new tokens for ``prompts``."""
    from grpolab.rollout.sampler import sample

    policy = trainer.policy
    return int(
        sample(
            policy.model,
            prompts,
            keys,
            max_new_tokens=trainer.cfg.generation.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            eos_id=policy.eos_id,
            pad_id=policy.pad_id,
        ).completion_mask.sum()
    )


def _generate_new_tokens(trainer, prompts: list, keys: list) -> int:
    """``model.generate``'s new tokens for ``prompts``, up to and with each row's EOS."""
    import torch

    from grpolab.common.batch import left_pad

    policy = trainer.policy
    ids, mask = left_pad(prompts, policy.pad_id)
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=trainer.cfg.generation.max_new_tokens,
            pad_token_id=policy.pad_id,
            eos_token_id=policy.eos_id,
        )
    gen = out[:, ids.shape[1] :]  # [N, T]
    ended = (gen == policy.eos_id).int().cumsum(1)
    return int(((ended == 0) | ((ended == 1) & (gen == policy.eos_id))).sum())  # tokens up to and with EOS


NEW_TOKENS = {"vllm": _vllm_new_tokens, "grpolab": _sampler_new_tokens, "generate": _generate_new_tokens}


def sampling_throughput(trainer, step: int, repeats: int = 2, skip_generate: bool = False) -> None:
    """New tokens per second of grpolab's sampler, of ``model.generate`` and (with the vllm engine) of vLLM on the
    same B x G prompts (all sample at temperature 1 with a KV cache, up to the same length; generate's rows run until
    the longest ends). ``repeats`` passes each; the last counts (warm caches)."""
    from grpolab.common import streams

    cfg, policy = trainer.cfg, trainer.policy
    prompts = [
        policy.prompt_ids(r)
        for r in trainer.task_stage.sampler.draw(step, cfg.groups.prompts_per_step)
        for _ in range(cfg.groups.group_size)
    ]
    keys = [(streams.ROLLOUT, cfg.run.seed, step, i) for i in range(len(prompts))]
    policy.model.eval()
    rates = {}
    names = ("vllm", "grpolab", "generate") if cfg.engine.rollout_engine == "vllm" else ("grpolab", "generate")
    names = tuple(n for n in names if not (skip_generate and n == "generate"))
    for name in names * repeats:
        t0 = time.perf_counter()
        new = NEW_TOKENS[name](trainer, prompts, keys)
        rates[name] = (new, time.perf_counter() - t0)
    prompt_tokens = sum(map(len, prompts))
    for name, (new, sec) in rates.items():
        print(
            f"SAMPLING {name} {new / sec:.1f} new tokens/s ({new} new tokens in {sec:.2f} s; {len(prompts)} rows, "
            f"{prompt_tokens} prompt tokens)",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--reward",
        choices=["task", "parity"],
        default="task",
        help="task: accuracy + 0.1 format on the arithmetic questions; parity: a dense reward so every "
        "rollout has a nonzero advantage (no update can be skipped)",
    )
    p.add_argument("--few-shot", type=int, default=0, help="K solved examples before each question (the same in both)")
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} to run (comma-separated)"
    )
    p.add_argument(
        "--rollout-engine",
        default="hf",
        help="grpolab's rollout engines to compare, comma-separated: hf, vllm (vllm adds grpolab-vllm and trl-vllm)",
    )
    p.add_argument(
        "--vllm-eager", action="store_true", help="grpolab-vllm: eager vLLM (starts in seconds, samples slower)"
    )
    p.add_argument("--skip-generate", action="store_true", help="leave model.generate out of the sampling throughputs")
    p.add_argument("--shapes", default="", help="BxGxT,...: run everything for each (prompts x group x new tokens)")
    p.add_argument("--only", choices=CONFIGS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.only:
        run_one(args)
        return
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s] or [
        (args.prompts, args.group_size, args.max_new_tokens)
    ]
    for args.prompts, args.group_size, args.max_new_tokens in shapes:
        compare(args, _without_shapes(sys.argv[1:]))


def _without_shapes(argv: list[str]) -> list[str]:
    """argv without ``--shapes X`` / ``--shapes=X`` (each child process runs one shape)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--shapes":
            skip = True
        elif not a.startswith("--shapes="):
            out.append(a)
    return out


def run_one(args) -> None:
    """One configuration, in this process: prints its step times and peak memory."""
    import torch

    torch.set_num_threads(args.threads)
    if args.only.startswith("grpolab"):
        engine = "vllm" if args.only == "grpolab-vllm" else "hf"
        times = run_grpolab(args, checkpointing=args.only == "grpolab-ckpt", engine=engine)
    else:
        times = run_trl(args, checkpointing=args.only == "trl-default", use_vllm=args.only == "trl-vllm")
    import resource

    print("TIMES " + json.dumps(times))
    print("PEAK_MB " + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))  # Linux: KiB


def compare(args, argv: list[str]) -> None:
    """Every selected configuration, each in its own process, then the ratios."""
    medians, peaks = {}, {}
    engines = args.rollout_engine.split(",")
    wanted = args.configs.split(",") + (list(VLLM_CONFIGS) if "vllm" in engines else [])
    configs = [c for c in CONFIGS if c in wanted and (c not in VLLM_CONFIGS or "vllm" in engines)]
    if "hf" not in engines:
        configs = [c for c in configs if c not in ("grpolab", "grpolab-ckpt")]
    if args.steps == 0:  # sampling throughput only: one grpolab process measures every sampler
        configs = ["grpolab-vllm" if "vllm" in engines else "grpolab"]
    shape = ["--prompts", str(args.prompts), "--group-size", str(args.group_size)]
    shape += ["--max-new-tokens", str(args.max_new_tokens)]
    for name in configs:
        cmd = [sys.executable, __file__, *argv, *shape, "--only", name]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TQDM_DISABLE": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("TIMES ")), None)
        if res.returncode != 0 or line is None:
            if name == "trl-vllm":  # report TRL's own error and go on
                err = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith((" ", "WARNING"))]
                print(f"trl-vllm      failed: {err[-1] if err else res.stderr[-500:]}", flush=True)
                continue
            sys.exit(f"{name} failed:\n{res.stderr[-3000:]}")
        times = json.loads(line[6:])[args.warmup :]
        if not times:  # --steps 0
            for ln in res.stdout.splitlines():
                if ln.startswith(("SAMPLING ", "rollout engine")):
                    print(f"{name}: " + ln, flush=True)
            continue
        medians[name] = statistics.median(times)
        peaks[name] = next((float(ln[8:]) for ln in res.stdout.splitlines() if ln.startswith("PEAK_MB ")), float("nan"))
        print(
            f"{name:<13} median step {medians[name]:6.2f} s over {len(times)} steps  ({', '.join(f'{t:.1f}' for t in times)}); "
            f"peak memory {peaks[name]:.0f} MB",
            flush=True,
        )
        for ln in res.stdout.splitlines():
            if ln.startswith(("STEP ", "SAMPLING ", "notice", "rollout engine")):
                print("    " + ln, flush=True)
    print(
        f"config: {args.model}, {args.prompts} prompts x {args.group_size} completions, max {args.max_new_tokens} new tokens, "
        f"few-shot {args.few_shot}, mu=1, beta=0, {args.threads} threads, reward {args.reward}"
    )
    for ours in (c for c in ("grpolab", "grpolab-ckpt", "grpolab-vllm") if c in medians and "trl-default" in medians):
        print(
            f"{ours}: TRL default / {ours} = {medians['trl-default'] / medians[ours]:.2f}x"
            + (
                f", TRL no checkpointing / {ours} = {medians['trl-no-ckpt'] / medians[ours]:.2f}x"
                if "trl-no-ckpt" in medians
                else ""
            )
            + f"; peak memory {peaks[ours] / peaks['trl-default']:.2f} of TRL default's"
        )
    if "grpolab" in medians and "grpolab-vllm" in medians:
        print(f"grpolab (hf) / grpolab-vllm step time = {medians['grpolab'] / medians['grpolab-vllm']:.2f}x")


if __name__ == "__main__":
    main()
