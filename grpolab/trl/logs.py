"""grpolab's step metrics under TRL's names: the entries of ``trainer.state.log_history``.

TRL logs, every ``logging_steps`` optimizer steps, the mean of each metric over the steps since its last entry. An
entry here is the same: the mean over the window's grpolab steps of each metric below, by TRL's name, beside every
grpolab metric of the window's last step by its own name (``reward/mean``, ``loss/clip_frac``, ``probe/...``).
"""

from __future__ import annotations

import math

# TRL's name -> grpolab's
TRL_NAMES = {
    "loss": "loss/total",
    "grad_norm": "grad/norm",
    "learning_rate": "charts/lr",
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "frac_reward_zero_std": "reward/frac_zero_std",
    "completions/mean_length": "completion/len_mean",
    "completions/min_length": "completion/len_min",
    "completions/max_length": "completion/len_max",
    "completions/clipped_ratio": "completion/truncated_frac",
    "completions/mean_terminated_length": "completion/done_len_mean",
    "completions/min_terminated_length": "completion/done_len_min",
    "completions/max_terminated_length": "completion/done_len_max",
    "kl": "loss/kl",
    "policy_loss": "loss/policy",
    "entropy": "policy/entropy",
    "entropy_coef": "loss/entropy_coef",
    "clip_ratio/low_mean": "loss/clip_low_frac",
    "clip_ratio/high_mean": "loss/clip_high_frac",
    "clip_ratio/region_mean": "loss/clip_frac",
    "step_time": "time/step_s",
}

# What transformers' Trainer, not TRL's metrics, puts in an entry: its loss, gradient norm and learning rate, logged
# at a logging step only (TRL's summary entry carries the last steps' metrics without them)
TRAINER_KEYS = ("loss", "grad_norm", "learning_rate")

# reward/<x> keys that are not one function's mean
_REWARD_STATS = {"mean", "std", "group_std_mean", "frac_zero_std", "accuracy", "format", "errors"}


def reward_function_keys(metrics: dict) -> dict[str, str]:
    """``rewards/<fn>/mean`` -> ``reward/<fn>`` for each reward component's mean logged in ``metrics``, and ``name``
    -> ``reward/logged/<name>`` for each scalar a reward function logged with ``log_metric`` (TRL logs it by its own
    name)."""
    out = {}
    for key in metrics:
        if key.startswith("reward/logged/"):
            out[key.removeprefix("reward/logged/")] = key
            continue
        if not key.startswith("reward/"):
            continue
        name = key.removeprefix("reward/")
        if name.endswith("/std") and "reward/" + name.removesuffix("/std") in metrics:  # a component's spread
            out[f"rewards/{name}"] = key
            continue
        if name in _REWARD_STATS or name.startswith("judge_") or "/" in name:
            continue
        out[f"rewards/{name}/mean"] = key
    return out


def _mean(values: list) -> float | None:
    kept = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def trl_entry(window: list[dict], global_step: int, epoch: float) -> dict:
    """A ``log_history`` entry for the grpolab steps ``window`` (oldest first): TRL's names averaged over the window,
    then the last step's own metrics, then ``epoch`` and ``step`` as TRL ends each entry."""
    last = window[-1]
    functions = reward_function_keys(last)
    entry: dict = {}
    for trl_name, ours in (TRL_NAMES | functions).items():
        value = _mean([m.get(ours) for m in window])
        if value is not None or trl_name in functions:  # a function that applied to no rollout: None, as TRL logs
            entry[trl_name] = value
    entry |= {k: v for k, v in last.items() if k != "step" and not k.startswith("eval/")}
    entry |= {"epoch": epoch, "step": global_step}
    return entry


def summary_entry(window: list[dict], global_step: int, epoch: float, summary: dict) -> dict:
    """The last ``log_history`` entry, as TRL's: the train summary (``train_loss``, ``train_runtime``, ...) beside
    the TRL-named means of the steps ``window`` logged since the last entry (none when the last step was logged or
    an evaluation came after it: TRL's evaluation takes its pending metrics), without the trainer's own keys."""
    entry: dict = {}
    if window:
        pending = trl_entry(window, global_step, epoch)
        entry = {k: v for k, v in pending.items() if "/" not in k or k.startswith(TRL_PREFIXES)}
        entry = {k: v for k, v in entry.items() if k not in TRAINER_KEYS}
    return entry | summary | {"epoch": epoch, "step": global_step}


TRL_PREFIXES = ("rewards/", "completions/", "clip_ratio/")
"""TRL's metric names with a slash; grpolab's own (``reward/mean``) have theirs too, and stay out of the summary."""


def eval_entry(metrics: dict, global_step: int, epoch: float) -> dict:
    """A ``log_history`` entry of an evaluation: ``eval_reward`` (the first reward function's mean on sampled
    completions, as TRL's eval_reward is the sampled reward), ``eval_accuracy_greedy`` and every ``eval/*`` metric as
    ``eval_<name>``."""
    out = {"eval_" + k.removeprefix("eval/").replace("/", "_"): v for k, v in metrics.items() if k.startswith("eval/")}
    if "eval_accuracy_sampled" in out:
        out["eval_reward"] = out["eval_accuracy_sampled"]
    return out | {"epoch": epoch, "step": global_step}
