"""The built-in model's training on the device: a resume bit for bit (``checkpoint``), reward components that
run there, a reward model and a local judge (``rewards``), the hacking signs watching without changing the run
(``hacking``), and on-policy distillation from a teacher on the device (``distill``)."""

from __future__ import annotations

import time
import warnings

import torch

from .common import (
    Check,
    Context,
    Recorder,
    finite,
    last_weights,
    metric_rows,
    quiet,
    rollouts,
    train_rows,
    weight_difference,
)


def check_checkpoint(ctx: Context) -> dict:
    """4 steps straight against 2 steps and a resume to 4: equal metrics, rollouts and weights."""
    import grpolab

    options = dict(model="builtin", device=ctx.dev, precision="bf16-mixed", prompts_per_step=4, group_size=4,
                   max_new_tokens=24, eval_questions=8, eval_samples=0, warmup_steps=0, threads=1,
                   log_rollouts=True, progress=False, doctor="off", save_every=2, seed=0, log=quiet)  # fmt: skip
    ops: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            t0 = time.perf_counter()
            straight = grpolab.train(steps=4, out=str(ctx.work / "ckpt-straight"), **options).dir
            seconds = time.perf_counter() - t0
            grpolab.train(steps=2, out=str(ctx.work / "ckpt-resumed"), **options)
            resumed = grpolab.train(steps=4, resume=True, out=str(ctx.work / "ckpt-resumed"), **options).dir
        finally:
            torch.use_deterministic_algorithms(False)
    for w in caught:
        text = str(w.message)
        if "deterministic" in text:
            ops.add(text.split(" does not have")[0][:120])
    # the 2-step run evaluated at its last step, which the straight run did not: evaluations compare at step 4
    same_metrics = train_rows(straight) == train_rows(resumed)
    drawn = rollouts(straight)
    same_rollouts = drawn == rollouts(resumed)
    wa, wb = last_weights(straight), last_weights(resumed)
    same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    figures = dict(same_metrics=same_metrics, same_rollouts=same_rollouts, same_weights=same_weights,
                   rollouts=len(drawn), tensors=len(wa), straight_run_s=seconds,
                   nondeterministic_ops=sorted(ops))  # fmt: skip
    if not (same_metrics and same_rollouts and same_weights):
        diff = weight_difference(straight, resumed)
        raise AssertionError(f"the resumed run differs: metrics {same_metrics}, rollouts {same_rollouts}, weights "
                             f"{same_weights} (largest relative difference {diff:.2e}); ops without a deterministic "
                             f"algorithm: {sorted(ops) or 'none'}")  # fmt: skip
    return figures


def checkpoint_summary(figures: dict) -> str:
    return (f"metrics, {figures['rollouts']} rollouts and {figures['tensors']} tensors equal; ops without a "
            f"deterministic algorithm: {len(figures['nondeterministic_ops'])}")  # fmt: skip


def reward_model(ctx: Context, tok):
    """A random sequence-classification model over ``tok``, saved with it into the work directory: its path."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=2, num_labels=1,
                                                    pad_token_id=tok.pad_token_id))  # fmt: skip
    rm_dir = ctx.work / "reward-model"
    rm.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    return rm_dir


def check_rewards(ctx: Context) -> dict:
    """A reward model and a local judge as reward components on the device; the reward model's scores there
    against the CPU's in fp32."""
    import grpolab
    from grpolab.models.builtin import build_char_tokenizer

    rm_dir = reward_model(ctx, build_char_tokenizer())
    judge = ctx.work / "judge.txt"
    judge.write_text("Is {{ completion }} the answer to {{ prompt }}? Answer yes or no.\n")
    rec = Recorder()
    t0 = time.perf_counter()
    grpolab.train(model="builtin", steps=2, device=ctx.dev, reward_model=(str(rm_dir),), judge=str(judge),
                  judge_model="builtin", prompts_per_step=4, group_size=4, eval_questions=8, eval_samples=0,
                  warmup_steps=0, threads=1, progress=False, doctor="off", out=str(ctx.work / "rewards"), log=quiet,
                  hooks=rec.hooks)  # fmt: skip
    seconds = time.perf_counter() - t0
    last = rec.metrics[-1]
    components = {k: last.get(k) for k in ("reward/reward-model", "reward/judge", "reward/mean")}
    if not all(map(finite, components.values())):
        raise AssertionError(f"the reward components are not all finite: {components}")
    return dict(components=components, judge_requests=last.get("reward/judge_requests"), run_s=seconds,
                **score_gaps(ctx, rm_dir))  # fmt: skip


def score_gaps(ctx: Context, rm_dir) -> dict:
    """The reward model's scores on the device in fp32 against the CPU's (the rule), and in the run's own dtype (bf16
    on CUDA; a figure)."""
    from grpolab.rewards.model import RewardModelSettings, load_reward_model

    texts = [f"{a} + {b} = {a + b}" for a in range(4) for b in range(4)]
    scores, placed = {}, {}
    for name, device, dtype in (("here", ctx.device, "auto"), ("here32", ctx.device, "float32"),
                                ("cpu", torch.device("cpu"), "float32")):  # fmt: skip
        model = load_reward_model(str(rm_dir), RewardModelSettings(device, dtype), lambda r: "", chat=False)
        scores[name] = model.score_texts(texts).float().cpu()
        placed[name] = str(next(model.model.parameters()).device), str(next(model.model.parameters()).dtype)
    gap32 = float((scores["here32"] - scores["cpu"]).abs().max())
    gap = float((scores["here"] - scores["cpu"]).abs().max())
    spread = float(scores["cpu"].std())
    if not gap32 <= max(1e-3 * spread, 1e-5):
        raise AssertionError(f"the reward model in fp32 on {placed['here32'][0]} scores {gap32:.3g} away from the "
                             f"CPU's (spread {spread:.3g})")  # fmt: skip
    return dict(reward_model_device=placed["here"][0], reward_model_dtype=placed["here"][1],
                score_gap_vs_cpu_fp32=gap, score_gap_fp32_vs_cpu_fp32=gap32, score_spread=spread)  # fmt: skip


def rewards_summary(figures: dict) -> str:
    components = ", ".join(f"{k} {v:.3g}" for k, v in figures["components"].items())
    return (f"reward model on {figures['reward_model_device']}: in fp32 "
            f"{figures['score_gap_fp32_vs_cpu_fp32']:.2g} "
            f"and in {figures['reward_model_dtype'].removeprefix('torch.')} {figures['score_gap_vs_cpu_fp32']:.2g} "
            f"from the CPU's fp32 scores (spread {figures['score_spread']:.2g}); {components}")  # fmt: skip


def check_hacking(ctx: Context) -> dict:
    """6 steps under bf16-mixed with the hacking signs every 2 steps (a Gram pass on the device), the honeypots and an
    audit, against the same run with them off: equal rollouts and weights, every sign finite."""
    import grpolab

    options = dict(model="builtin", device=ctx.dev, precision="bf16-mixed", prompts_per_step=8, group_size=4,
                   max_new_tokens=24, eval_questions=8, eval_samples=1, eval_every=3, warmup_steps=0, threads=1,
                   log_rollouts=True, progress=False, doctor="off", save_every=6, seed=0, steps=6, log=quiet)  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        t0 = time.perf_counter()
        on = grpolab.train(out=str(ctx.work / "hacking-on"), hacking_every=2, honeypots="auto",
                           audit_reward="grpolab.rewards.builtin:accuracy_reward", **options).dir  # fmt: skip
        seconds = time.perf_counter() - t0
        off = grpolab.train(out=str(ctx.work / "hacking-off"), hacking_every=0, honeypots="none", **options).dir
    finally:
        torch.use_deterministic_algorithms(False)
    rows = train_rows(on)
    signs = {
        k: [r[k] for r in rows if k in r] for k in ("hacking/align", "hacking/trick_sim", "hacking/audit_disagree")
    }
    signs["hacking/honeypot_paid"] = [
        r["hacking/honeypot_paid"] for r in metric_rows(on) if "hacking/honeypot_paid" in r
    ]
    wa, wb = last_weights(on), last_weights(off)
    same_rollouts = rollouts(on) == rollouts(off)
    same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    figures = dict(same_rollouts=same_rollouts, same_weights=same_weights, signs=signs, run_s=seconds)
    if not (same_rollouts and same_weights):
        raise AssertionError(f"the signs changed the run: rollouts equal {same_rollouts}, weights equal {same_weights} "
                             f"(largest relative difference {weight_difference(on, off):.2e})")  # fmt: skip
    if len(signs["hacking/align"]) != 3 or not all(finite(v) for vs in signs.values() for v in vs):
        raise AssertionError(f"the signs are not all measured and finite: {signs}")
    return figures


def hacking_summary(figures: dict) -> str:
    align = ", ".join(f"{v:.3f}" for v in figures["signs"]["hacking/align"])
    return f"rollouts and weights equal with the signs on and off; hacking/align {align}"


def check_distill(ctx: Context) -> dict:
    """3 steps under bf16-mixed distilling from a teacher (the built-in model's weights, saved perturbed) with
    rkl-reward and with jsd over the whole vocabulary: the teacher's forward and its term on the device, every
    distill/* figure finite, the teacher's KL above 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpolab
    from grpolab.models.policy import ASSET_DIR
    from grpolab.training.runlog import read_metrics

    teacher, tokenizer = AutoModelForCausalLM.from_pretrained(ASSET_DIR), AutoTokenizer.from_pretrained(ASSET_DIR)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    teacher.save_pretrained(ctx.work / "teacher")
    tokenizer.save_pretrained(ctx.work / "teacher")
    options = dict(model="builtin", device=ctx.dev, precision="bf16-mixed", prompts_per_step=4, group_size=4,
                   max_new_tokens=24, eval_questions=8, eval_samples=0, warmup_steps=0, threads=1, steps=3,
                   progress=False, doctor="off", seed=0, teacher=str(ctx.work / "teacher"), log=quiet)  # fmt: skip
    figures = {}
    for loss in ("rkl-reward", "jsd"):
        t0 = time.perf_counter()
        out = grpolab.train(out=str(ctx.work / f"distill-{loss}"), distill_loss=loss, **options).dir
        rows = [r for r in train_rows(out) if "distill/kl" in r]
        kl = [r["distill/kl"] for r in rows]
        timed = read_metrics(out / "metrics.jsonl")  # metric_rows leaves the times out
        teacher_s = sum(r.get("time/teacher_s", 0.0) for r in timed)
        figures[loss] = dict(kl=kl, teacher_s=teacher_s, run_s=time.perf_counter() - t0)
        if len(kl) != 3 or not all(finite(v) and v > 0 for v in kl) or not all(finite(r["loss/total"]) for r in rows):
            raise AssertionError(f"{loss}: distill/kl {kl}, losses {[r['loss/total'] for r in rows]}")
    return figures


def distill_summary(figures: dict) -> str:
    return "; ".join(
        f"{loss}: distill/kl {', '.join(f'{v:.4f}' for v in f['kl'])}, teacher {f['teacher_s']:.2f} s of "
        f"{f['run_s']:.1f} s"
        for loss, f in figures.items()
    )


CHECKPOINT = Check(
    "checkpoint", "in-process", check_checkpoint, checkpoint_summary,
    "the built-in model under bf16-mixed: 4 steps, against 2 steps + --resume to 4; metrics, rollouts and weights "
    "bit for bit (torch's deterministic algorithms on; the ops without one are listed)",
    passes="the 2 + 2-step run's metrics, rollouts and weights equal the 4-step run's, bit for bit",
)  # fmt: skip
REWARDS = Check(
    "rewards", "in-process", check_rewards, rewards_summary,
    "a reward model (random, sequence classification) and a local LLM judge (the built-in model) as reward "
    "components on the device, 2 steps; the reward model's scores on the device against the CPU's",
    passes="every reward component finite; the reward model in fp32 on the device within 1e-3 of its scores' "
    "spread (at least 1e-5) of the CPU's scores",
)  # fmt: skip
HACKING = Check(
    "hacking", "in-process", check_hacking, hacking_summary,
    "the built-in model under bf16-mixed, 6 steps with the hacking signs every 2 steps (one Gram pass of the top-"
    "advantage rollouts on the device), the honeypots at each evaluation and an audit, against the same run with "
    "them off",
    passes="the two runs' rollouts and weights are equal bit for bit; hacking/align is measured at steps 2, 4, 6 and "
    "every sign is finite",
)  # fmt: skip
DISTILL = Check(
    "distill", "in-process", check_distill, distill_summary,
    "the built-in model under bf16-mixed, 3 steps distilling from a perturbed copy of itself (--teacher): rkl-reward "
    "(the teacher's log-probs of the sampled tokens) and jsd (both heads over the whole vocabulary, chunked, "
    "backpropagated)",
    passes="every loss and distill/kl finite, the teacher's KL above 0 at each step, for both losses",
)  # fmt: skip
