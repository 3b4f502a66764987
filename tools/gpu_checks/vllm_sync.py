"""The vllm rollout engine on the device (``vllm``): a step, the weight sync after it, the engine's mismatch."""

from __future__ import annotations

import time

import torch

from .common import Check, Context, Recorder, Skip, quiet


def check_vllm(ctx: Context) -> dict:
    """The vllm engine: 2 steps, its log-probs against the trainer's after each (the weight sync), engine/*."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed")
    import grpolab
    from grpolab.models.logprobs import completion_logprobs

    held: dict = {}
    gaps: list[float] = []

    def fixed_tokens(trainer):
        held["batch"] = trainer.sampling_stage.collector.collect(0).groups.rows.batch
        with torch.no_grad():
            held["start"] = completion_logprobs(trainer.policy.model, held["batch"], 1.0)

    def compare(trainer, step, metrics):
        batch = held["batch"]
        with torch.no_grad():
            expected = completion_logprobs(trainer.policy.model, batch, 1.0)
        mask = batch.completion_mask.bool()
        gaps.append(float((trainer.sampling_stage.engine.score(batch) - expected)[mask].abs().max()))
        held["moved"] = float((expected - held["start"])[mask].abs().max())

    rec = Recorder(fixed_tokens, compare)
    t0 = time.perf_counter()
    grpolab.train(model="builtin", steps=2, device=ctx.dev, rollout_engine="vllm", precision="32-true", lr=2e-3,
                  prompts_per_step=4, group_size=4, eval_questions=8, eval_samples=0, warmup_steps=0, threads=1,
                  progress=False, doctor="off", out=str(ctx.work / "vllm"), log=quiet, hooks=rec.hooks)  # fmt: skip
    seconds = time.perf_counter() - t0
    engine = {k: v for k, v in rec.metrics[-1].items() if k.startswith("engine/")}
    sync = [m.get("time/sync_s") for m in rec.metrics]
    if not max(gaps) < held["moved"] / 10:
        raise AssertionError(f"the engine's log-probs are {max(gaps):.3g} from the trainer's after a step that moved "
                             f"them {held['moved']:.3g}: the weights did not reach it")  # fmt: skip
    return dict(sync_gap_per_step=gaps, moved_by_the_steps=held["moved"], sync_s=sync, mismatch=engine, run_s=seconds)


def vllm_summary(figures: dict) -> str:
    return (f"engine vs trainer after each step {', '.join(f'{g:.1e}' for g in figures['sync_gap_per_step'])} "
            f"(the steps moved them {figures['moved_by_the_steps']:.2g})")  # fmt: skip


VLLM = Check(
    "vllm", "in-process", check_vllm, vllm_summary,
    "the vllm engine (skipped when vllm is not installed): 2 steps of the built-in model, the weight sync (the "
    "engine's log-probs against the trainer's after each step) and the mismatch (engine/*)",
    passes="after each step the engine's log-probs lie within a tenth of how far the step moved the trainer's "
    "(the weights reached it)",
)  # fmt: skip
