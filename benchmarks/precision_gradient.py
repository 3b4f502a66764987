"""What each --precision does to the step's gradient, and how far each sampler/trainer pairing disagrees.

    python benchmarks/precision_gradient.py --model smollm2-135m-instruct --data data/last_letter/train.parquet \
        --reward-fn examples/last_letter/reward.py:last_letter [--prompts 32] [--group-size 8] [--out DIR]

1. **The gradient.** G rollouts of each probe prompt are drawn once by the fp32 sampler (fixed keys). On those same
   rollouts the step's gradient (grpo_std advantages, the clipped term at ratio 1, seq-mean-token-mean over the
   prompts whose rewards vary; the token weights computed once, from the fp32 trainer's log-probs) is taken by the
   trainer's own forward (``grpolab.training.forward.LogProbs``) under each precision: 32-true (the reference),
   bf16-mixed with and without --fp32-head, 16-mixed with and without it (fp16 autocast on this CPU: the loss scaled
   by 2^16 and the gradient unscaled, as the scaler would), and bf16-true (the weights cast to bf16). Each against
   32-true's: relative error ||g - g32|| / ||g32|| and cosine. The yardstick: 32-true's gradient on a second draw
   with other keys, the step-to-step sampling noise the precision's error adds to.
2. **The mismatch.** Each sampler draws its own rollouts with the same keys, and the trainer that computes alike
   scores them: per pairing the sd of the token log-ratio log pi_trainer - log pi_sampler and the share of tokens
   whose ratio leaves [0.9, 1.1] (as ``engine/*`` logs them). The pairings: fp32 sampler / 32-true, bf16 sampler /
   32-true (bf16 rollouts under an fp32 trainer), the pure bf16 copy and the copy that computes as autocast does
   (grpolab's sampler under --rollout-dtype auto and a mixed precision: fp32 embeddings, norms and residual stream,
   bf16 products, attention rounded as autocast's) against bf16-mixed, the latter with the LM head in fp32 on both
   sides too, and the same for fp16 / 16-mixed.

Prints a line per measurement and writes precision_gradient.json into ``--out``; ``--tables FILE`` prints the
markdown tables of docs/precision.md. fp16 runs here through the CPU's autocast (grpolab refuses 16-mixed training
on a CPU: there is no loss-scaling path worth running there); the FP16 paper's claim is about the numbers, which
the CPU computes as a GPU would, to kernel order.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from pathlib import Path

import torch
from precision import probe_setup  # benchmarks/precision.py, beside this file

from grpolab.algo.advantages import compute_advantages
from grpolab.algo.engine_correction import MAX_KEYS, mismatch_metrics, mismatch_sums
from grpolab.algo.loss import logp_weights
from grpolab.analysis.pool import probe_sampler
from grpolab.common import streams
from grpolab.common.precision import Precision
from grpolab.common.rng import set_threads
from grpolab.training.forward import LogProbs

# (name, precision, fp32 head): the trainers whose gradient is compared with 32-true's
TRAINERS = (
    ("32-true", "32-true", False),
    ("bf16-mixed", "bf16-mixed", False),
    ("bf16-mixed, fp32 head", "bf16-mixed", True),
    ("16-mixed", "16-mixed", False),
    ("16-mixed, fp32 head", "16-mixed", True),
    ("bf16-true", "bf16-true", False),
)
# (name, sampler dtype, its fp32 head, whether it computes as autocast does, the trainer that scores its rollouts)
PAIRINGS = (
    ("fp32 sampler / 32-true", "float32", False, False, "32-true"),
    ("bf16 sampler / 32-true", "bfloat16", False, False, "32-true"),
    ("bf16 sampler / bf16-mixed", "bfloat16", False, False, "bf16-mixed"),
    ("bf16 autocast sampler / bf16-mixed", "bfloat16", False, True, "bf16-mixed"),
    ("bf16 sampler / bf16-mixed, both fp32 head", "bfloat16", True, False, "bf16-mixed, fp32 head"),
    ("bf16 autocast sampler / bf16-mixed, both fp32 head", "bfloat16", True, True, "bf16-mixed, fp32 head"),
    ("fp16 autocast sampler / 16-mixed", "float16", False, True, "16-mixed"),
    ("fp16 autocast sampler / 16-mixed, both fp32 head", "float16", True, True, "16-mixed, fp32 head"),
)
FP16_LOSS_SCALE = 2.0**16


def draw(policy, task, records, args, dtype: str, head: bool, autocast: bool, seed_shift: int = 0) -> list[tuple]:
    """Each prompt's G rollouts from the sampler in ``dtype`` (``head``: its LM head in fp32; ``autocast``: computing
    as autocast does, fp32 outside the products): (batch, sampler log-probs ``[G, T]``, rewards ``[G]``), keyed by
    the probe's stream (``seed_shift`` > 0: other keys)."""
    out = []
    engine = probe_sampler(policy, task, "hf", print, records, rollout_dtype=dtype, fp32_head=head, autocast=autocast)
    with contextlib.closing(engine) as sample:
        for k, record in enumerate(records):
            key = (streams.PROBE, args.seed + seed_shift, 0, k)
            rows, _, _ = sample.service.sample([record] * args.group_size, [(*key, i) for i in range(args.group_size)],
                                               sample.settings)  # fmt: skip
            out.append((rows.batch, rows.logprobs, rows.scores.total))
    return out


def trainer_module(model, name: str, temperature: float) -> tuple[LogProbs, Precision]:
    """The trainer's forward of TRAINERS' ``name`` over ``model`` (bf16-true: a bf16 copy of it)."""
    _, precision, head = next(t for t in TRAINERS if t[0] == name)
    p = Precision(precision, "kahan", head)
    if p.param_dtype != torch.float32:
        model = copy.deepcopy(model).to(p.param_dtype)
    return LogProbs(model, temperature, precision=p), p


def scores(module: LogProbs, groups) -> list[torch.Tensor]:
    with torch.no_grad():
        return [module(*batch).double() for batch, _, _ in groups]


def step_weights(groups, logp32: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """d loss / d logp ``[G, T]`` of each group (None: no reward spread), from the fp32 trainer's log-probs."""
    N = sum(b.completion_ids.shape[0] for b, _, _ in groups)
    out = []
    for (batch, _, rewards), logp in zip(groups, logp32):
        if not bool((rewards != rewards[0]).any()):
            out.append(None)
            continue
        adv = compute_advantages(rewards[None, :].double(), "grpo_std")[0]  # [G]
        out.append(logp_weights(logp, logp, adv, batch.completion_mask, num_seqs=N))
    return out


def gradient(module: LogProbs, precision: Precision, groups, weights) -> torch.Tensor:
    """The step's gradient, flat ``[D]`` float64: grad sum_k sum_it w_it log pi(o_it) under ``precision``."""
    params = [p for p in module.model.parameters()]
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    scale = FP16_LOSS_SCALE if precision.scaled else 1.0
    for (batch, _, _), w in zip(groups, weights):
        if w is None:
            continue
        logp = module(*batch)
        grads = torch.autograd.grad((logp.double() * w).sum() * scale, params, allow_unused=True)
        for t, g in zip(total, grads):
            if g is not None:
                t += g.double() / scale
    flat = torch.cat([t.reshape(-1) for t in total])
    assert bool(torch.isfinite(flat).all()), "a non-finite gradient (fp16 overflow?)"
    return flat


def compare(g: torch.Tensor, ref: torch.Tensor) -> dict:
    n = float(ref.norm())
    return {"rel_error": float((g - ref).norm()) / n, "cosine": float(g @ ref) / (float(g.norm()) * n)}


def mismatch(groups, trainer: list[torch.Tensor]) -> dict:
    sums = None
    for (batch, sampler_logp, _), logp in zip(groups, trainer):
        part = mismatch_sums(logp, sampler_logp.double(), batch.completion_mask)
        sums = part if sums is None else {k: (max if k in MAX_KEYS else sum)((sums[k], part[k])) for k in part}
    return {"tokens": int(sums["tok"]), **mismatch_metrics(sums)}


def tables(path: str) -> str:
    r = json.loads(Path(path).read_text())
    lines = ["| trainer | relative error vs 32-true | cosine vs 32-true |", "| --- | ---: | ---: |"]
    for name, f in r["gradient"].items():
        lines.append(f"| {name} | {f['rel_error']:.3g} | {f['cosine']:.6f} |")
    y = r["yardstick"]
    lines.append(f"| 32-true, a second draw (other keys) | {y['rel_error']:.3g} | {y['cosine']:.4f} |")
    lines += ["", "| sampler / trainer | tokens | log-ratio sd | outside [0.9, 1.1] | sequence log-ratio sd | "
              "max \\|log R\\| |", "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, m in r["mismatch"].items():
        lines.append(f"| {name} | {m['tokens']} | {m['engine/logratio_std']:.3g} | {m['engine/ratio_outside_frac']:.4f} "
                     f"| {m['engine/seq_logratio_std']:.3g} | {m['engine/seq_logratio_max']:.3g} |")  # fmt: skip
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model, or a run (its --step-index checkpoint)")
    p.add_argument("--step-index", type=int, default=0)
    p.add_argument("--data", default="")
    p.add_argument("--reward-fn", action="append", default=[])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/precision-gradient")
    p.add_argument("--pairings-only", action="store_true", help="measure the sampler/trainer pairings only")
    p.add_argument(
        "--trainers",
        default=",".join(name for name, _, _ in TRAINERS[1:]),
        help="which trainers' gradients to compare with 32-true's (comma-separated names of TRAINERS)",
    )
    p.add_argument("--no-pairings", action="store_true", help="the gradients only")
    p.add_argument("--tables", metavar="JSON", help="print the markdown tables of a saved precision_gradient.json")
    return p.parse_args()


def gradients(policy, task, records, args, fp32) -> tuple[dict, dict]:
    """1. Each of ``--trainers``' gradient on the fp32 draw against 32-true's; and the yardstick, 32-true's on a
    second draw with other keys."""
    model, T = policy.model, args.temperature
    found = {}
    ref_module, ref_precision = trainer_module(model, "32-true", T)
    weights = step_weights(fp32, scores(ref_module, fp32))
    reference = gradient(ref_module, ref_precision, fp32, weights)
    for name in (n for n, _, _ in TRAINERS[1:] if n in args.trainers.split(",")):
        module, precision = trainer_module(model, name, T)
        found[name] = compare(gradient(module, precision, fp32, weights), reference)
        f = found[name]
        print(f"gradient {name:<24} rel error {f['rel_error']:.3e} cosine {f['cosine']:.6f}", flush=True)
    other = draw(policy, task, records, args, "float32", False, False, seed_shift=1)
    other_weights = step_weights(other, scores(ref_module, other))
    yardstick = compare(gradient(ref_module, ref_precision, other, other_weights), reference)
    print(f"gradient 32-true, other keys      rel error {yardstick['rel_error']:.3e} "
          f"cosine {yardstick['cosine']:.4f}", flush=True)  # fmt: skip
    return found, yardstick


def mismatches(policy, task, records, args, fp32) -> dict:
    """2. Each pairing's sampler draws with the same keys (the fp32 one's rollouts are ``fp32``), its trainer scores
    them: the log-ratio's spread."""
    found = {}
    for name, dtype, head, autocast, trainer in PAIRINGS:
        same = (dtype, head, autocast) == ("float32", False, False)
        groups = fp32 if same else draw(policy, task, records, args, dtype, head, autocast)
        module, _ = trainer_module(policy.model, trainer, args.temperature)
        m = found[name] = mismatch(groups, scores(module, groups))
        print(f"mismatch {name:<44} log-ratio sd {m['engine/logratio_std']:.3e} outside [0.9, 1.1] "
              f"{m['engine/ratio_outside_frac']:.4f} seq sd {m['engine/seq_logratio_std']:.3e}", flush=True)  # fmt: skip
    return found


def main() -> None:
    args = parse_args()
    if args.tables:
        print(tables(args.tables))
        return
    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    policy, task, records, step = probe_setup(args)  # benchmarks/precision.py's
    records = records[: args.prompts]
    results: dict = {"args": vars(args), "step": step, "gradient": {}, "mismatch": {}}
    fp32 = draw(policy, task, records, args, "float32", False, False)
    live = sum(bool((r != r[0]).any()) for _, _, r in fp32)
    print(f"fp32 draw: {len(fp32)} prompts x {args.group_size}, {live} with reward spread", flush=True)
    if not args.pairings_only:
        results["gradient"], results["yardstick"] = gradients(policy, task, records, args, fp32)
    if not args.no_pairings:
        results["mismatch"] = mismatches(policy, task, records, args, fp32)
    results["seconds"] = time.perf_counter() - t0
    (out / "precision_gradient.json").write_text(json.dumps(results, indent=2))
    print(f"{out / 'precision_gradient.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
