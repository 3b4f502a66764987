"""vLLM's log-probs against the trainer's replay under each sampling setting: top-p alone, top-k, min-p, the
repetition penalty and all four together (docs/vllm.md, "Sampling settings and how each is replayed").

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/sampling/engine_settings.py [--model smollm2-135m-instruct]
        [--prompts 8] [--group 4] [--max-new-tokens 48] [--temperature 1.0] [--threads 2] [--compiled]

For each setting, the same B prompts (arithmetic questions in the model's chat template) x G rollouts drawn by the
vllm engine (``VLLMEngine.generate``: the setting in each request's ``SamplingParams``, vLLM's ``processed_logprobs``
of the sampled tokens), then what the update does with them: the trainer's log-probs of those tokens and its offset
log p_T - log p_sampling from its own logits (``completion_logprobs(rules=...)``), the engine's log-probs put on the
trainer's scale with it (``on_full_support``), and the ``engine/*`` statistics the update logs
(``mismatch_sums``/``mismatch_metrics``). The model is loaded once, in fp32, and vLLM started once for every setting
(fp32, eager unless ``--compiled``); no weight moves. A wrong replay shows as a log-ratio far from 0 on every token
(the offset itself: about -0.1 a token at top-p 0.9, the last column, the log-ratio the engine's log-probs give
without the offset); vLLM's numerics alone as a small spread around 0.

Prints one row per setting, and the same rows as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

SETTINGS = {
    "top-p 0.9": dict(top_p=0.9),
    "top-k 20": dict(top_k=20),
    "min-p 0.1": dict(min_p=0.1),
    "repetition penalty 1.2": dict(repetition_penalty=1.2),
    "top-k 20 + top-p 0.9 + min-p 0.05 + penalty 1.1": dict(top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
    "none (temperature only)": {},
}
KEYS = ("engine/logprob_diff_mean", "engine/logratio_mean", "engine/ratio_outside_frac", "engine/seq_logratio_std",
        "without offset: engine/logratio_mean")  # fmt: skip
QUESTIONS = ["12+7", "45-(12+7)", "3*4", "161/7", "9*9-1", "(8+2)*3", "100-37", "6*7", "14+28", "2*(3+4)", "81/9",
             "55-5*5", "7+8+9", "64/8+1", "13*3", "90-45"]  # fmt: skip


def engine_and_policy(model: str, eager: bool, seed: int = 0):
    """The policy (fp32) and a vllm engine on it."""
    from grpolab.config.rollout import EngineSection
    from grpolab.models.policy import load_policy
    from grpolab.rollout.placement import build_engine
    from grpolab.rollout.spec import EngineSpec

    policy = load_policy(model, torch.float32)
    policy.model.eval()
    section = EngineSection(rollout_engine="vllm", rollout_dtype="float32", vllm_compile=not eager)
    return build_engine(EngineSpec.of(section, seed, policy), policy.model), policy


def replay(policy, sampled, temperature: float, rules) -> dict[str, float]:
    """The update's replay of ``sampled`` (:class:`grpolab.rollout.sampler.Sampled`) and its engine/* statistics."""
    from grpolab.algo.engine_correction import mismatch_metrics, mismatch_sums, on_full_support
    from grpolab.models.logprobs import completion_logprobs

    batch = sampled.batch
    with torch.no_grad():
        scores = completion_logprobs(policy.model, batch, temperature, rules=rules)  # [N, T] or [N, T, 2]
    trainer, offset = (scores, torch.zeros_like(scores)) if rules.full_support else scores.unbind(-1)
    engine = on_full_support(sampled.logprobs.to(trainer.dtype), offset)
    stats = mismatch_metrics(mismatch_sums(trainer, engine, batch.completion_mask))
    raw = mismatch_metrics(mismatch_sums(trainer, sampled.logprobs.to(trainer.dtype), batch.completion_mask))
    return stats | {"without offset: engine/logratio_mean": raw["engine/logratio_mean"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compiled", action="store_true", help="vLLM's compiled engine (default: eager)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from grpolab.models.sampling_rules import SamplingRules
    from grpolab.rollout.sampler import SamplingSettings

    t0 = time.perf_counter()
    engine, policy = engine_and_policy(args.model, not args.compiled)
    print(f"{args.model}, vLLM started in {time.perf_counter() - t0:.0f} s; B={args.prompts} x G={args.group} "
          f"x T<={args.max_new_tokens}, temperature {args.temperature}, fp32", flush=True)  # fmt: skip
    prompts = [policy.prompt_ids({"question": q}) for q in QUESTIONS[: args.prompts] for _ in range(args.group)]
    keys = [(1, 0, 0, i // args.group, i % args.group) for i in range(len(prompts))]
    rows = []
    for name, rules in SETTINGS.items():
        settings = SamplingSettings(args.max_new_tokens, args.temperature, **rules)
        sampled = engine.generate(prompts, keys, settings)
        stats = replay(policy, sampled, args.temperature, SamplingRules(**{"top_p": 1.0} | rules))
        tokens = int(sampled.batch.completion_mask.sum())
        rows.append((name, tokens, stats))
        print(f"{name}: {tokens} tokens, " + ", ".join(f"{k} {stats[k]:.3g}" for k in KEYS), flush=True)
    print("\n| setting | tokens | " + " | ".join(f"`{k}`" for k in KEYS) + " |")
    print("| --- | ---: |" + " ---: |" * len(KEYS))
    for name, tokens, stats in rows:
        print(f"| {name} | {tokens} | " + " | ".join(f"{stats[k]:.2e}" for k in KEYS) + " |")


if __name__ == "__main__":
    main()
