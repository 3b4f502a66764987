"""How long a reward model takes to score one GRPO step's rollouts, each row whole against each group's prompt once.

Reads a run's logged rollouts (``--log-rollouts``) of one step: the completions and, matched to the data file by
their question, the prompts they answer. Scores them with the reward model ``--model`` (grpolab's
``RewardModel.score_texts``) two ways, ``--repeats`` times each, and prints the median seconds:

- whole rows: every prompt + completion in full, in batches within ``--batch-tokens``;
- shared prompt: the rows of a group read their prompt's keys and values from one forward (what training does).

The scores of the two agree to rounding (printed). ``--profile`` prints torch.profiler's table of the shared-prompt
scoring, sorted by self CPU time.

    python benchmarks/reward_model_scoring.py --model runs/last_letter_rm --data data/last_letter/train.parquet \\
        --rollouts runs/rm_t16/rollouts.jsonl --step 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the reward model's directory")
    ap.add_argument("--data", required=True, help="the run's data file (its chat `prompt` column)")
    ap.add_argument("--rollouts", required=True, help="the run's rollouts.jsonl")
    ap.add_argument("--step", type=int, default=1, help="which step's rollouts")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="auto", help="--reward-model-dtype (auto: float32 on a CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import pandas as pd

    from grpolab.rewards.model import RewardModelSettings, load_reward_model, model_texts, same_prompt

    prompts = {
        f"user: {r['prompt'][-1]['content']}": list(r["prompt"]) for r in pd.read_parquet(args.data).to_dict("records")
    }
    rows = [json.loads(line) for line in open(args.rollouts)]
    rows = [r for r in rows if r["step"] == args.step]
    shown = [prompts[r["question"]] for r in rows]
    rm = load_reward_model(
        args.model, RewardModelSettings(dtype=args.dtype, batch_tokens=args.batch_tokens), lambda r: r, chat=True
    )
    texts = model_texts(shown, [r["completion"] for r in rows], rm._template)
    groups = same_prompt(shown)
    lengths = [len(x) for x in rm.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    print(f"{len(texts)} rows in {len(groups)} groups, {statistics.fmean(lengths):.0f} tokens a row on average "
          f"(longest {max(lengths)}), {args.threads} thread(s)")  # fmt: skip

    def timed(fn):
        times, out = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    whole_s, whole = timed(lambda: rm.score_texts(texts))
    shared_s, shared = timed(lambda: rm.score_texts(texts, groups))
    print(f"whole rows:    {whole_s:.3f} s")
    print(f"shared prompt: {shared_s:.3f} s  ({whole_s / shared_s:.2f}x faster)")
    print(f"largest score difference: {float((whole - shared).abs().max()):.2e}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rm.score_texts(texts, groups)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
