"""The Qwen model's updates and speed, timed (they run alone): an update at lr 1e-6 registering in each precision
(``precisions``), and the hf engine's decode ms/token beside transformers' generate (``decode``)."""

from __future__ import annotations

import functools

import torch

from .common import Check, Context, Recorder, check_learning_signal, finite, first_line, peak_text, qwen, train_qwen

PRECISIONS = (("32-true", "kahan"), ("bf16-mixed", "kahan"), ("16-mixed", "kahan"), ("bf16-true", "kahan"),
              ("bf16-true", "none"))  # fmt: skip
"""The precisions check's runs: (precision, compensation)."""


def check_precisions(ctx: Context) -> dict:
    """The Qwen model, 3 steps (--cpu: 2) at lr 1e-6 in each precision: the share of the weights with a nonzero
    gradient whose exact value (Kahan: weight + compensation) moved, the step time, the peak memory, the fp16
    scaler's skips."""
    out: dict = {}
    for name, comp in PRECISIONS:
        key = name if name != "bf16-true" else f"bf16-true/{comp}"
        out[key] = precision_run(ctx, key, name, comp)
    ran = {k: v for k, v in out.items() if "skipped" not in v}
    bad = [k for k, v in ran.items() if not all(map(finite, v["loss"]))]
    if bad:
        raise AssertionError(f"non-finite losses in {bad}")
    held_updates = [k for k in ran if k != "bf16-true/none" and ran[k]["moved_share"] < 0.99]
    if held_updates:
        raise AssertionError(
            "under 99% of the weights with a gradient moved in "
            + ", ".join(f"{k} ({ran[k]['moved_share']:.2%})" for k in held_updates)
        )
    return out


def precision_run(ctx: Context, key: str, name: str, comp: str) -> dict:
    """One run of :func:`check_precisions` in precision ``name`` with compensation ``comp``: its figures, or why it
    was skipped (``{"skipped": ...}``: a precision this device refuses)."""
    from grpolab.common.precision import PrecisionError
    from grpolab.training.optim import exact_weights

    model, tok = qwen(ctx)
    held: dict = {}

    def begin(trainer, held=held):
        params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
        held["params"], held["opt"] = params, trainer.update_stage.optimizer
        held["before"] = [exact_weights(trainer.update_stage.optimizer, p).clone() for p in params]
        held["grad"] = [torch.zeros(p.numel(), dtype=torch.bool, device=p.device) for p in params]
        for p, mask in zip(params, held["grad"]):
            p.register_post_accumulate_grad_hook(functools.partial(mark_gradient, mask))
        ctx.reset_peak()

    rec = Recorder(begin)
    try:
        steps = 2 if ctx.cpu else 3
        train_qwen(ctx, ctx.work / f"precision-{key.replace('/', '-')}", model, tok, steps, rec.hooks, lr=1e-6,
                   precision=name, compensation=comp)  # fmt: skip
    except PrecisionError as e:
        return {"skipped": str(e).splitlines()[0]}
    check_learning_signal(rec.metrics)
    after = [exact_weights(held["opt"], p) for p in held["params"]]
    moved = sum(int(((a != b) & g).sum()) for a, b, g in zip(after, held["before"], held["grad"]))
    counted = sum(int(g.sum()) for g in held["grad"])
    steps = rec.metrics
    figures = dict(
        moved_share=moved / max(counted, 1),
        weights_with_gradient=counted,
        step_s=[m["time/step_s"] for m in steps],
        update_s=[m["time/update_s"] for m in steps],
        peak_gib=ctx.peak_gib(),
        overflow_skips=sum(m.get("precision/overflow_skips") or 0 for m in steps),
        loss_scale=steps[-1].get("precision/loss_scale"),
        loss=[m["loss/total"] for m in steps],
    )
    del model, held, rec
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def mark_gradient(mask: torch.Tensor, param: torch.Tensor) -> None:
    """A gradient hook: ``mask`` marks the entries of ``param`` that have had a nonzero gradient."""
    mask.logical_or_(param.grad.reshape(-1) != 0)


def precisions_summary(figures: dict) -> str:
    parts = []
    for k, v in figures.items():
        if "skipped" in v:
            parts.append(f"{k} skipped ({v['skipped'].split(': ', 1)[-1][:70].rstrip(';.,')})")
            continue
        step = v["step_s"][1:] or v["step_s"]  # the first step warms up
        scaler = f", {v['overflow_skips']} overflow skips" if v["loss_scale"] is not None else ""
        parts.append(f"{k} moved {v['moved_share']:.2%}, {sum(step) / len(step):.2f} s/step{peak_text(v['peak_gib'])}"
                     f"{scaler}")  # fmt: skip
    return "; ".join(parts)


def check_decode(ctx: Context) -> dict:
    """Decode ms/token at 8 rows: grpolab's hf engine beside transformers' generate (static cache, compiled on
    CUDA), on the Qwen model (bf16 on CUDA, fp32 on the CPU)."""
    from benchmarks.decode_gpu import runner, timed

    model, _ = qwen(ctx)
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    model = model.to(dtype).eval()
    T = 16 if ctx.cpu else 512
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, min(30000, model.config.vocab_size), (64,), generator=g).tolist()] * 8
    names = ("grpolab", "grpolab-fused", "generate") if ctx.cpu else ("grpolab", "grpolab-fused", "generate-static")
    out: dict = {"rows": 8, "T": T, "dtype": str(dtype).removeprefix("torch.")}
    if ctx.cpu:
        out["generate-static"] = {"skipped": "the static cache's compile takes minutes on a CPU; CUDA only"}
    for name in names:
        try:
            run = runner(name, model, prompts)
            # the compiled static cache warms up at the timed length: a shorter warm-up recompiles in the timed run
            warm = timed(lambda: run(T if name == "generate-static" else 16), ctx.device)  # noqa: B023
            ctx.reset_peak()
            seconds = timed(lambda: run(T), ctx.device)  # noqa: B023
            out[name] = {"ms_per_token": seconds / T * 1e3, "warmup_s": warm, "peak_gib": ctx.peak_gib()}
        except Exception as e:  # a configuration that cannot run here is said, and the others go on
            out[name] = {"error": first_line(e)}
    if "ms_per_token" not in out["grpolab"]:
        raise AssertionError(f"grpolab's hf engine: {out['grpolab']['error']}")
    return out


def decode_summary(figures: dict) -> str:
    rates = [f"{k} {v['ms_per_token']:.2f}" if "ms_per_token" in v else f"{k} ({next(iter(v.values()))[:60]})"
             for k, v in figures.items() if isinstance(v, dict)]  # fmt: skip
    return f"ms/token, {figures['rows']} rows, T={figures['T']}, {figures['dtype']}: " + ", ".join(rates)


PRECISIONS_CHECK = Check(
    "precisions", "timed", check_precisions, precisions_summary,
    "the Qwen model, 3 steps (--cpu: 2) at lr 1e-6 in each precision (32-true, bf16-mixed, 16-mixed, bf16-true "
    "with Kahan summation and without): the share of weights with a gradient whose exact value moved, step time, "
    "peak memory, the fp16 scaler's skipped steps",
    passes="finite losses and a learning signal in every precision the device runs; in each but pure bf16 "
    "without compensation, at least 99% of the weights with a gradient moved",
)  # fmt: skip
DECODE = Check(
    "decode", "timed", check_decode, decode_summary,
    "the hf engine's decode ms/token at 8 rows for T = 512 (--cpu: 16) on the Qwen model in bf16 (--cpu: fp32), "
    "beside transformers' generate with the static cache (compiled on CUDA: CUDA graphs)",
    passes="grpolab's hf engine decodes at the timed length (the other configurations are figures, their errors "
    "said)",
)  # fmt: skip
