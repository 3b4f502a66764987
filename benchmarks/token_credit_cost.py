"""What ``--log-token-credit K`` costs: step time with it against without, in one run.

One training run in this process, recording on every other step: odd steps run without the
recording, even steps with it. Both halves share the machine's state (a drift in its speed falls
on both) and the run's rollouts come from the same policy. The recording draws no random
numbers, so the run trains as it would without it (on the built-in model: the same metrics,
rollouts and weights bit for bit, docs/token-credit.md); what differs between the halves is the
recording's work: the K rows' values kept during the update, one forward over them after it,
and their records.

    python benchmarks/token_credit_cost.py [--preset builtin|smollm2] [--k 4] [--steps 40] [--warmup 2] \
        [--key value ...]

``--preset smollm2``: SmolLM2-135M-Instruct on the real-model demo's preset (grpolab.commands.demo). Extra
``--key value`` pairs are TrainConfig fields (e.g. --rollout-engine vllm).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

from grpolab.commands.demo import REAL_MODEL_PRESET
from grpolab.commands.parsing import parse_config
from grpolab.config.train import TrainConfig
from grpolab.training.recipe import build_trainer

# The demo preset's fields that are not training ones here.
SKIP = {"steps", "eval_every", "eval_questions", "eval_samples", "save_every", "log_samples"}


def config(preset: str, extra: list[str], out: str) -> TrainConfig:
    """The run's TrainConfig: the preset's fields, then ``extra`` parsed as `grpolab train` parses its flags."""
    fields = {} if preset == "builtin" else {k: v for k, v in REAL_MODEL_PRESET.items() if k not in SKIP}
    if preset == "smollm2":
        fields["model"] = "smollm2-135m-instruct"
    flags = [a for k, v in fields.items() for a in ("--" + k.replace("_", "-"), *_values(v))]
    cfg = parse_config(TrainConfig, [*flags, *extra], "token_credit_cost", "")
    return dataclasses.replace(cfg, out=out, progress=False).resolved()


def _values(v) -> list[str]:
    return [str(x) for x in v] if isinstance(v, tuple) else [str(v)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("builtin", "smollm2"), default="builtin")
    parser.add_argument("--k", type=int, default=4, help="rollouts recorded per step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = config(args.preset, extra, tmp)
        trainer = build_trainer(base, log=lambda *a: None)
        times: dict[bool, list[dict]] = {False: [], True: []}
        for step in range(1, args.steps + 1):
            on = step % 2 == 0
            trainer.cfg = dataclasses.replace(base, log_token_credit=args.k if on else 0)
            metrics = trainer.step(step).metrics
            if step > args.warmup:
                times[on].append(metrics)
            print(f"step {step:3d} {'with' if on else 'without':>7}: {metrics['time/step_s']:.3f} s", flush=True)

    def median(on: bool, key: str) -> float:
        return statistics.median(m[key] for m in times[on] if key in m)

    off, on = median(False, "time/step_s"), median(True, "time/step_s")
    print(f"\npreset {args.preset}, K = {args.k}; {len(times[False])} steps without, {len(times[True])} with")
    print(f"median step, without:             {off:.3f} s  (update {median(False, 'time/update_s'):.3f} s)")
    print(f"median step, --log-token-credit:  {on:.3f} s  (update {median(True, 'time/update_s'):.3f} s)")
    print(f"ratio with / without:             {on / off:.3f}")
    active = [statistics.fmean(m["loss/active_frac"] for m in times[h]) for h in (False, True)]
    print(f"rollouts the update ran (loss/active_frac), mean: {active[0]:.3f} without, {active[1]:.3f} with")
    credit = median(True, "time/credit_s")
    print(
        f"the forward after the update and the records (time/credit_s), median: {credit * 1e3:.1f} ms = {credit / off:.1%}"
    )


if __name__ == "__main__":
    main()
