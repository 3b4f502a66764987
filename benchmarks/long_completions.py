"""Step time and memory of grpolab against TRL's GRPOTrainer as completions grow long.

    pip install -e ".[bench]"      # trl, an optional extra
    python benchmarks/long_completions.py [--shapes 2x4x128,2x4x512,2x4x1024] [--steps 2] [--warmup 1]
                                          [--configs trl-default,trl-static-cache,trl-bf16,grpolab,grpolab-vllm]
                                          [--rollout-dtypes float32,bfloat16] [--precisions 32-true,bf16-mixed]
                                          [--threads 2]
                                          [--micro-batch-tokens 2048] [--plot docs/img/long_completions.png]
                                          [--names trl-bf16,grpolab-mixed-head-nockpt] [--replot FILE.json]

SmolLM2-135M-Instruct (``--model``), B prompts x G rollouts of T new tokens each (``--shapes BxGxT,...``). Every
completion runs to T: a parity reward (1 for an odd number of characters, so about half of each group scores 1 and
every rollout carries gradient), and the end-of-sequence token cannot stop a completion in either tool (TRL:
``generation_kwargs={"min_new_tokens": T}``; grpolab: ``--ignore-eos``). mu = 1, beta = 0, temperature 1, fp32 on
the CPU, one process per configuration (none inherits another's allocator or threads), ``--threads`` threads each:

- ``trl-default``: TRL's GRPOConfig defaults (gradient checkpointing on) but fp32 (its bf16 default is off on a CPU);
- ``trl-static-cache``: the same with ``generation_kwargs={"cache_implementation": "static"}``, the preallocated cache
  an informed TRL user would set for long completions;
- ``trl-bf16``: TRL's defaults with ``bf16=True``, its GPU default: accelerate's bf16 autocast over the fp32 model
  (on the CPU too, with ``use_cpu=True``), generation included;
- ``grpolab``: grpolab's hf engine with ``--micro-batch-tokens`` (the update in passes of that many tokens; 0: one
  pass) and ``--gradient-checkpointing`` unless ``--no-checkpointing``;
- ``grpolab-vllm``: the same with the vllm rollout engine in the trainer's process (eager; its KV cache
  ``VLLM_CPU_KVCACHE_SPACE`` = 1 GiB, enough for 20k tokens).

Each grpolab configuration runs once per ``--precisions`` entry and, under 32-true, once per ``--rollout-dtypes``
entry (``--rollout-dtype``; the engine correction is ``auto``): bfloat16 rollouts under the fp32 trainer are named
``grpolab-bf16`` and ``grpolab-vllm-bf16``; ``--precision bf16-mixed`` (bf16 autocast over fp32 masters, rollouts
in bf16 by ``--rollout-dtype auto``) ``grpolab-mixed`` and ``grpolab-vllm-mixed``, with ``--fp32-head``
``grpolab-mixed-head``. A name ending in ``-nockpt`` (``--names``) runs without activation checkpointing.

Both tools train the same model object, loaded by grpolab, so TRL's generation also runs on grpolab's grouped-query
attention (``grpolab/models/attention.py``): the comparison is of the trainers, not of that kernel.

Prints, per configuration and T: the median step time over the steps after the warm-up, split into generation and
update (grpolab's own timers; TRL: the time in its ``_generate``, and the rest of the step), and the process's peak
memory (max RSS). Then one line per T and engine:
``T=1024: TRL default / grpolab step 2.73x, memory 0.41 (grpolab / TRL)``, against each TRL configuration run.
``--json`` writes every figure,
``--plot`` draws time and memory against T.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

TRL_CONFIGS = ("trl-default", "trl-static-cache", "trl-bf16")
CONFIGS = (*TRL_CONFIGS, "grpolab", "grpolab-vllm")
DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16"}
PRECISION_SUFFIX = {"bf16-mixed": "-mixed", "bf16-mixed-head": "-mixed-head"}  # (32-true: DTYPE_SUFFIX's)


def run_trl(args) -> list[dict]:
    """TRL's GRPOTrainer on the shape; per step its time and the time spent in generation."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from vs_trl import _prompts, parity_reward, trl_config

    from grpolab.models.policy import load_policy

    policy = load_policy(args.model)
    records = _prompts(args.prompts * (args.steps + args.warmup))
    dataset = Dataset.from_list([{"prompt": policy.chat_messages(r)} for r in records])

    def reward(completions, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return parity_reward(texts, [{}] * len(texts))

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.gen0 = time.perf_counter(), generating[0]

        def on_step_end(self, *a, **k):
            total = time.perf_counter() - self.t0
            gen = generating[0] - self.gen0
            steps.append({"step": total, "generate": gen, "update": total - gen})
            print(f"STEP {len(steps)} {total:.2f} s: generate {gen:.2f} s, rest {total - gen:.2f} s", flush=True)

    generation = {"min_new_tokens": args.max_new_tokens}  # EOS cannot end a completion before T
    if args.only == "trl-static-cache":
        generation["cache_implementation"] = "static"
    bf16 = {"bf16": True} if args.only == "trl-bf16" else {}
    cfg = trl_config(args, "/tmp/grpolab-trl-long", generation_kwargs=generation, learning_rate=1e-6, **bf16)
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        callbacks=[Timer()],
    )
    generating = [0.0]
    inner = trainer._generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        generating[0] += time.perf_counter() - t0
        lengths = [len(c) for c in out[1]] if isinstance(out, tuple) and len(out) > 1 else []
        if lengths:
            print(f"LENGTHS {min(lengths)}-{max(lengths)}", flush=True)
        return out

    trainer._generate = timed_generate
    torch.manual_seed(0)
    trainer.train()
    return steps


def run_grpolab(args, engine: str, dtype: str, precision: str = "32-true", fp32_head: bool = False) -> list[dict]:
    """grpolab's trainer on the shape; per step its time, generation and update (its own timers)."""
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import build_trainer

    cfg = TrainConfig(
        model=args.model,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=True,
        mu=1,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        lr=1e-6,
        threads=args.threads,
        steps=args.steps + args.warmup,
        out="/tmp/grpolab-long-run",
        progress=False,
        gradient_checkpointing=not (args.no_checkpointing or args.only.endswith("-nockpt")),
        micro_batch_tokens=args.micro_batch_tokens,
        device="cpu",
        rollout_engine=engine,
        rollout_dtype=dtype,
        precision=precision,
        fp32_head=fp32_head,
        vllm_max_len=args.max_new_tokens + 256,
        reward_fn="vs_trl:parity_reward",
        format_weight=0.0,
        eval_every=0,
        save_every=0,
    )
    trainer = build_trainer(cfg, log=print)
    steps = []
    for step in range(1, args.steps + args.warmup + 1):
        t0 = time.perf_counter()
        m = trainer.step(step).metrics
        total = time.perf_counter() - t0
        steps.append({"step": total, "generate": m["time/generate_s"], "update": m["time/update_s"]})
        print(
            f"STEP {step} {total:.2f} s: generate {m['time/generate_s']:.2f} s, sync {m['time/sync_s']:.2f} s, "
            f"update {m['time/update_s']:.2f} s, completion tokens {m['completion/len_mean']:.0f}, "
            f"rollouts with nonzero advantage {m['loss/active_frac']:.2f}",
            flush=True,
        )
    return steps


def run_one(args) -> None:
    """One configuration in this process: its steps and peak memory as two lines the parent reads."""
    import torch

    torch.set_num_threads(args.threads)
    if args.only in TRL_CONFIGS:
        steps = run_trl(args)
    else:
        engine = "vllm" if args.only.startswith("grpolab-vllm") else "hf"
        name = args.only.removesuffix("-nockpt")  # -nockpt: without activation checkpointing
        if "-mixed" in name:  # rollouts in the compute dtype: --rollout-dtype auto
            steps = run_grpolab(args, engine, "auto", "bf16-mixed", name.endswith("-head"))
        else:
            steps = run_grpolab(args, engine, "bfloat16" if args.only.endswith("-bf16") else "float32")
    print("STEPS " + json.dumps(steps))
    print("PEAK_MB " + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))  # Linux: KiB


def measure(args, name: str, argv: list[str]) -> dict:
    """Runs configuration ``name`` in a child process; its median step, generation and update, and peak memory."""
    shape = ["--prompts", str(args.prompts), "--group-size", str(args.group_size), "--tokens", str(args.max_new_tokens)]
    cmd = [sys.executable, __file__, *argv, *shape, "--only", name]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TQDM_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")])
    )
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("STEPS ")), None)
    if res.returncode != 0 or line is None:
        sys.exit(f"{name} at T={args.max_new_tokens} failed:\n{res.stderr[-3000:]}")
    steps = json.loads(line[6:])[args.warmup :]
    out = {k: statistics.median(s[k] for s in steps) for k in ("step", "generate", "update")}
    out["peak_mb"] = next(float(ln[8:]) for ln in res.stdout.splitlines() if ln.startswith("PEAK_MB "))
    out["steps"] = [round(s["step"], 2) for s in steps]
    print(
        f"T={args.max_new_tokens:<5} {name:<13} median step {out['step']:7.2f} s (generate {out['generate']:6.2f} s, "
        f"update {out['update']:6.2f} s) over {len(steps)} steps {out['steps']}; peak memory {out['peak_mb']:,.0f} MB",
        flush=True,
    )
    for ln in res.stdout.splitlines():
        if ln.startswith(("STEP ", "LENGTHS", "notice")):
            print("    " + ln, flush=True)
    return out


def ratio_lines(results: dict[int, dict[str, dict]]) -> list[str]:
    """``T=1024: TRL default / grpolab step 2.73x, memory 0.41 (grpolab / TRL default)``, per T, TRL configuration
    and grpolab configuration."""
    lines = []
    for T, by in sorted(results.items()):
        for theirs in (c for c in TRL_CONFIGS if c in by):
            trl, label = by[theirs], theirs.removeprefix("trl-").replace("-", " ")
            for ours in (c for c in by if c.startswith("grpolab")):
                lines.append(
                    f"T={T}: TRL {label} / {ours} step {trl['step'] / by[ours]['step']:.2f}x, "
                    f"memory {by[ours]['peak_mb'] / trl['peak_mb']:.2f} ({ours} / TRL {label})"
                )
    return lines


def plot(results: dict[int, dict[str, dict]], path: str) -> None:
    """Step time (generation hatched under update) and peak memory against T, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(dict.fromkeys(n for by in results.values() for n in by))
    colours = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        c = colours(i % 10)  # one colour a configuration: its step solid, its generation dashed
        Ts = sorted(T for T, by in results.items() if name in by)
        ax_t.plot(Ts, [results[T][name]["step"] for T in Ts], marker="o", color=c, label=name)
        ax_t.plot(Ts, [results[T][name]["generate"] for T in Ts], ls="--", marker=".", color=c, alpha=0.7)
        ax_m.plot(Ts, [results[T][name]["peak_mb"] / 1024 for T in Ts], marker="o", color=c, label=name)
    title = "Time per step (solid) and its generation (dashed)"
    ax_t.set(xlabel="new tokens per completion (T)", ylabel="median step time (s)", title=title)
    ax_m.set(xlabel="new tokens per completion (T)", ylabel="peak memory, max RSS (GB)", title="Peak memory")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shapes", default="2x4x128,2x4x512,2x4x1024", help="BxGxT,...: prompts x group x new tokens")
    p.add_argument("--steps", type=int, default=2, help="measured steps per configuration and shape")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} (comma-separated)")
    p.add_argument("--rollout-dtypes", default="float32,bfloat16", help="grpolab's --rollout-dtype values (32-true)")
    p.add_argument(
        "--precisions", default="32-true", help="grpolab's --precision values: 32-true, bf16-mixed, bf16-mixed-head"
    )
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="grpolab's update passes (0: one pass)")
    p.add_argument("--no-checkpointing", action="store_true", help="grpolab without activation checkpointing")
    p.add_argument("--replot", default="", metavar="JSON", help="only redraw --plot from a saved --json")
    p.add_argument("--names", default="", help="run exactly these configurations (e.g. trl-default,grpolab-mixed)")
    p.add_argument("--json", default="", help="write every figure here")
    p.add_argument("--plot", default="", help="draw time and memory against T here (PNG)")
    p.add_argument("--only", help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--group-size", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--tokens", dest="max_new_tokens", type=int, default=128, help=argparse.SUPPRESS)
    return p.parse_args()


def config_names(args) -> list[str]:
    """The configurations to run: ``--names``, else each of ``--configs``, a grpolab one once per ``--precisions``
    entry and, under 32-true, once per ``--rollout-dtypes`` entry."""
    names = []
    for c in (c for c in CONFIGS if c in args.configs.split(",")):
        if c in TRL_CONFIGS:
            names.append(c)
            continue
        for precision in args.precisions.split(","):
            if precision == "32-true":
                names += [c + DTYPE_SUFFIX[d] for d in args.rollout_dtypes.split(",")]
            else:
                names.append(c + PRECISION_SUFFIX[precision])
    return args.names.split(",") if args.names else names


def settings_line(args) -> str:
    """The settings every configuration shares, printed before the ratios."""
    return (
        f"config: {args.model}, B x G = {args.prompts} x {args.group_size}, every completion runs to T (EOS ignored), "
        f"parity reward, mu=1, beta=0, {args.threads} threads; grpolab: --micro-batch-tokens "
        f"{args.micro_batch_tokens}, checkpointing {'off' if args.no_checkpointing else 'on (off in -nockpt)'}, "
        + (f"configurations {args.names}" if args.names else f"precisions {args.precisions} (32-true's rollouts in "
           f"{args.rollout_dtypes})")
        + ", engine correction auto"
    )  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.only:
        run_one(args)
        return
    if args.replot:  # redraw a saved --json's figures
        with open(args.replot) as f:
            plot({int(T): by for T, by in json.load(f).items()}, args.plot or "long_completions.png")
        return
    own = ("--shapes", "--json", "--plot", "--configs", "--rollout-dtypes", "--precisions", "--names")
    argv = [a for a in _without(sys.argv[1:], own)]
    results: dict[int, dict[str, dict]] = {}
    names = config_names(args)
    for shape in args.shapes.split(","):
        args.prompts, args.group_size, args.max_new_tokens = map(int, shape.split("x"))
        for name in names:
            results.setdefault(args.max_new_tokens, {})[name] = measure(args, name, argv)
    print(settings_line(args))
    for line in ratio_lines(results):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(T): by for T, by in results.items()}, f, indent=1)
    if args.plot:
        plot(results, args.plot)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without ``--opt X`` / ``--opt=X`` for each of ``options`` (a child runs one shape and configuration)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in options)):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
