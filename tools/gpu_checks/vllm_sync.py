"""The vllm rollout engine on the device (``vllm``): a step, the weight sync after it, the engine's mismatch; and the
same with a LoRA adapter that vLLM serves unmerged (``vllm-lora``)."""

from __future__ import annotations

import time

import torch

from .common import Check, Context, Recorder, Skip, quiet


def _engine_run(ctx: Context, name: str, **options) -> dict:
    """2 steps of the built-in model with the vllm engine (``options`` added): the engine's log-probs of a fixed
    batch against the trainer's after each step (the weight sync), the sync's time and bytes, engine/*."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed")
    import grpolab
    from grpolab.models.logprobs import completion_logprobs

    held: dict = {}
    gaps: list[float] = []

    def fixed_tokens(trainer):
        held["adapter"] = trainer.sampling_stage.engine.adapter
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
    run = dict(model="builtin", steps=2, device=ctx.dev, rollout_engine="vllm", precision="32-true", lr=2e-3,
               prompts_per_step=4, group_size=4, eval_questions=8, eval_samples=0, warmup_steps=0, threads=1,
               progress=False, doctor="off", out=str(ctx.work / name), log=quiet, hooks=rec.hooks)  # fmt: skip
    grpolab.train(**(run | options))
    seconds = time.perf_counter() - t0
    engine = {k: v for k, v in rec.metrics[-1].items() if k.startswith("engine/")}
    sync = [m.get("time/sync_s") for m in rec.metrics]
    if not max(gaps) < held["moved"] / 10:
        raise AssertionError(f"the engine's log-probs are {max(gaps):.3g} from the trainer's after a step that moved "
                             f"them {held['moved']:.3g}: the weights did not reach it")  # fmt: skip
    return dict(sync_gap_per_step=gaps, moved_by_the_steps=held["moved"], sync_s=sync, mismatch=engine, run_s=seconds,
                sync_bytes=[m.get("vllm/sync_bytes") for m in rec.metrics], unmerged=held["adapter"] is not None)  # fmt: skip


def check_vllm(ctx: Context) -> dict:
    """The vllm engine: 2 steps, its log-probs against the trainer's after each (the weight sync), engine/*."""
    return _engine_run(ctx, "vllm")


def check_vllm_lora(ctx: Context) -> dict:
    """The vllm engine serving a LoRA adapter unmerged (``--lora-sync adapter``: vLLM's LoRA layers, the base pushed
    once and the adapter after each step): 2 steps at rank 4, as :func:`check_vllm` compares them."""
    figures = _engine_run(ctx, "vllm-lora", lora_rank=4, lora_sync="adapter", lr=2e-2)
    if not figures["unmerged"]:
        raise AssertionError("--lora-sync adapter: the engine merged the adapter")
    return figures


def vllm_summary(figures: dict) -> str:
    return (f"engine vs trainer after each step {', '.join(f'{g:.1e}' for g in figures['sync_gap_per_step'])} "
            f"(the steps moved them {figures['moved_by_the_steps']:.2g})")  # fmt: skip


def vllm_lora_summary(figures: dict) -> str:
    last = figures["sync_bytes"][-1]
    return (
        f"{vllm_summary(figures)}; a step's sync {last / 2**10:.0f} KiB" if last is not None else vllm_summary(figures)
    )


VLLM = Check(
    "vllm", "in-process", check_vllm, vllm_summary,
    "the vllm engine (skipped when vllm is not installed): 2 steps of the built-in model, the weight sync (the "
    "engine's log-probs against the trainer's after each step) and the mismatch (engine/*)",
    passes="after each step the engine's log-probs lie within a tenth of how far the step moved the trainer's "
    "(the weights reached it)",
)  # fmt: skip
VLLM_LORA = Check(
    "vllm-lora", "in-process", check_vllm_lora, vllm_lora_summary,
    "the vllm engine serving a LoRA adapter unmerged (skipped when vllm is not installed): 2 steps of the built-in "
    "model with a rank-4 adapter and --lora-sync adapter (vLLM's LoRA layers; the base pushed once, the adapter "
    "after each step), compared as in vllm",
    passes="the adapter is served unmerged, and after each step the engine's log-probs lie within a tenth of how far "
    "the step moved the trainer's (each new version reached it)",
)  # fmt: skip
