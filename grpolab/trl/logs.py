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
    "clip_ratio/low_min": "loss/clip_low_min",
    "clip_ratio/high_max": "loss/clip_high_max",
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


def sample_reward_std(metrics: dict) -> float | None:
    """TRL's ``reward_std``, its ``nanstd``: the sample std (n - 1) of the n scored rewards (``sampling/rollouts``),
    from grpolab's population std ``reward/std``; None for fewer than two (TRL's NaN)."""
    std, n = metrics.get("reward/std"), metrics.get("sampling/rollouts")
    if std is None or n is None:
        return std
    return std * math.sqrt(n / (n - 1)) if n > 1 else None


def trl_means(window: list[dict]) -> dict:
    """TRL's names (:data:`TRL_NAMES`, each reward function's and logged scalar's) averaged over the metrics
    ``window`` (grpolab's steps, or an evaluation's batches), as TRL averages what it logged since its last entry; a
    name none of them has is left out, but a function's, which is None when it applied to no rollout (TRL's)."""
    functions = reward_function_keys(window[-1])
    entry: dict = {}
    for trl_name, ours in (TRL_NAMES | functions).items():
        value = _mean([sample_reward_std(m) if trl_name == "reward_std" else m.get(ours) for m in window])
        if value is not None or trl_name in functions:  # a function that applied to no rollout: None, as TRL logs
            entry[trl_name] = value
    return entry


RLOO_ABSENT = ("policy_loss", "entropy_coef")
"""TRL's GRPO names that TRL's RLOOTrainer never logs (it has no entropy bonus)."""


NO_REWARD = "no_reward"
"""The name of the reward function that pays nothing, which a DistillationTrainer runs when given none."""

DISTILL_ABSENT = ("reward", "reward_std", "frac_reward_zero_std", "kl", "policy_loss", "entropy_coef",
                  "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                  "clip_ratio/high_max", f"rewards/{NO_REWARD}/mean", f"rewards/{NO_REWARD}/std")  # fmt: skip
"""TRL's GRPO names that TRL's DistillationTrainer never logs (it has no reward, reference KL or clip), and the
reward that pays nothing."""


def trl_entry(window: list[dict], global_step: int, epoch: float, absent: tuple = ()) -> dict:
    """A ``log_history`` entry for the grpolab steps ``window`` (oldest first): TRL's names averaged over the window
    (but those ``absent`` from the trainer's log), then the last step's own metrics, then ``epoch`` and ``step`` as
    TRL ends each entry."""
    last = window[-1]
    entry = {k: v for k, v in trl_means(window).items() if k not in absent}
    entry |= {k: v for k, v in last.items() if k != "step" and not k.startswith("eval/")}
    entry |= {"epoch": epoch, "step": global_step}
    return entry


def summary_entry(window: list[dict], global_step: int, epoch: float, summary: dict, absent: tuple = ()) -> dict:
    """The last ``log_history`` entry, as TRL's: the train summary (``train_loss``, ``train_runtime``, ...) beside
    the TRL-named means of the steps ``window`` logged since the last entry (none when the last step was logged or
    an evaluation came after it: TRL's evaluation takes its pending metrics), without the trainer's own keys."""
    entry: dict = {}
    if window:
        entry = {k: v for k, v in trl_means(window).items() if k not in TRAINER_KEYS and k not in absent}
        if "num_tokens" in window[-1]:  # a count so far, not a mean (grpolab.trl.callbacks)
            entry["num_tokens"] = window[-1]["num_tokens"]
    return entry | summary | {"epoch": epoch, "step": global_step}


def eval_metrics(evaluation, policy_loss: bool) -> dict:
    """TRL's metrics of an evaluation, without their ``eval_`` prefix: the TRL names of a group evaluation's batches
    (:class:`grpolab.eval.groups.GroupEvaluation`) averaged over them, as TRL's ``log`` averages its eval batches'
    (``loss``, as ``evaluation_loop``'s, weighted by each batch's rows; ``policy_loss`` where TRL logs it: with an
    entropy bonus); TRL's trainer's own (``grad_norm``, ``learning_rate``, ``entropy_coef``, ``step_time``) are a
    training step's, never an evaluation's."""
    batches, rows = evaluation.batches, evaluation.rows
    out = {k: v for k, v in trl_means(batches).items() if k not in _TRAIN_ONLY}
    losses = [(m["loss/total"], n) for m, n in zip(batches, rows) if m.get("loss/total") is not None]
    if losses:
        out["loss"] = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    if not policy_loss:
        out.pop("policy_loss", None)
    return out


# TRL's names that only a training step logs
_TRAIN_ONLY = ("grad_norm", "learning_rate", "entropy_coef", "step_time")


def eval_entry(metrics: dict, prefix: str, transformers_keys: dict, num_tokens: int) -> dict:
    """An evaluation's metrics as TRL's ``evaluate`` returns them: transformers' own (``{prefix}_loss``,
    ``{prefix}_runtime`` ... ``transformers_keys``, already prefixed), then ``eval_num_tokens`` (the tokens trained
    on so far, TRL's ``num_input_tokens_seen``) and GRPO's ``metrics`` (:func:`eval_metrics`) under ``eval_``, as
    TRL's ``log`` prefixes them whatever the prefix is."""
    loss = {f"{prefix}_loss": metrics["loss"]} if "loss" in metrics else {}
    grpo = {f"eval_{k}": v for k, v in metrics.items() if k != "loss"}
    return loss | transformers_keys | {"eval_num_tokens": float(num_tokens)} | grpo


def accuracy_keys(metrics: dict) -> dict:
    """grpolab's own held-out accuracy (``eval/accuracy_greedy``, ``eval/accuracy_sampled`` with their intervals,
    per category, pass@k: :mod:`grpolab.eval.accuracy`) as ``eval_<name>``, beside TRL's keys in an evaluation's
    entry."""
    return {"eval_" + k.removeprefix("eval/").replace("/", "_"): v for k, v in metrics.items() if k.startswith("eval/")}
