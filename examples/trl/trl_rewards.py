"""TRL's own reward functions and the keywords TRL's trainer hands a reward function.

- ``trl.rewards``' token-level functions, which read ``completion_ids``: ``get_soft_overlong_punishment`` and
  ``get_repetition_penalty_reward``.
- A function of TRL's documented form that returns ``None`` where it does not apply (no letter in the reply),
  logs a column beside each completion with ``log_extra`` and a metric with ``log_metric``.

Each function's mean is ``rewards/<name>/mean`` (its Nones left out); the metric is logged by its own name.
"""

from task import _text, arguments, last_letter_dataset
from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

from grpolab.trl import GRPOConfig, GRPOTrainer


def letter_judged(completions, target, log_extra=None, log_metric=None, **kwargs):
    """1.0 for the word's last letter as the reply's first letter, 0.0 for another letter, None for no letter."""
    firsts = [next((ch for ch in _text(c).lower() if ch.isalpha()), "") for c in completions]
    log_extra("first_letter", firsts)
    log_metric("replied_with_a_letter", sum(bool(f) for f in firsts) / len(firsts))
    return [float(f == t) if f else None for f, t in zip(firsts, target)]


cli = arguments(__doc__)
dataset = last_letter_dataset(plain=cli.plain)

training_args = GRPOConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    log_completions=True,
    use_cpu=cli.use_cpu,
)
trainer = GRPOTrainer(
    model=cli.model,
    reward_funcs=[
        letter_judged,
        get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4),
        get_repetition_penalty_reward(ngram_size=2, max_penalty=-0.5),
    ],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
for entry in trainer.state.log_history:
    if "reward" in entry:
        shown = {k: v for k, v in entry.items() if k.startswith("rewards/") or k in ("reward", "replied_with_a_letter")}
        print("logged:", shown)
