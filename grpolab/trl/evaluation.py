"""TRL's evaluation for :class:`grpolab.trl.GRPOTrainer`: the eval datasets TRL takes, and an evaluation's metrics as
TRL's ``evaluate`` returns them and logs them.

TRL's ``evaluate`` (transformers' ``Trainer.evaluate`` over GRPO's ``prediction_step``) draws
``num_generations_eval`` completions of each eval prompt, batch by batch, and scores them with the run's whole reward;
grpolab's group evaluation does the same (:mod:`grpolab.eval.groups`), and this module names its results as TRL does:
transformers' ``{prefix}_loss``, ``{prefix}_model_preparation_time`` (an evaluation before training),
``{prefix}_runtime``, ``{prefix}_samples_per_second``, ``{prefix}_steps_per_second``, then GRPO's metrics under
``eval_`` whatever the prefix (``eval_reward``, ``eval_rewards/<fn>/mean``, ...), and ``epoch``. A dict of datasets is
evaluated dataset by dataset, each with the prefix ``{prefix}_<key>`` (transformers'), so that GRPO's metrics of the
last one are those the merged dict holds, as TRL's; each has its own log_history entry.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

from grpolab.trl.data import is_stream, read_stream
from grpolab.trl.logs import eval_entry, eval_metrics


class EvalPart(NamedTuple):
    """One dataset of an ``eval_dataset``."""

    name: str | None
    """Its key in a dict of datasets (None: the dataset itself)."""
    rows: list[dict]
    samples: int
    """What transformers counts as its samples: its rows (a stream's: 0, it has no length)."""


def eval_parts(dataset) -> list[EvalPart]:
    """The datasets of ``eval_dataset`` as TRL takes it: a ``Dataset`` or a list of dicts; a dict of them or a
    ``DatasetDict`` (each by its key, in order); an ``IterableDataset`` (read whole)."""
    if isinstance(dataset, dict):  # DatasetDict is a dict
        return [part._replace(name=str(key)) for key, d in dataset.items() for part in eval_parts(d)]
    if is_stream(dataset):
        return [EvalPart(None, list(read_stream(dataset, what="eval_dataset")), 0)]
    rows = [dict(r) for r in dataset]
    if not rows:
        raise ValueError("eval_dataset: no row")
    return [EvalPart(None, rows, len(rows))]


def eval_group_size(args) -> int:
    """G of an evaluation: ``num_generations_eval`` (default ``num_generations``), as TRL's."""
    return args.num_generations_eval or args.num_generations


def eval_batch_prompts(args, world_size: int) -> int:
    """The prompts of one eval batch: ``per_device_eval_batch_size`` rows on each of the processes, G a prompt."""
    return max(args.per_device_eval_batch_size * world_size // eval_group_size(args), 1)


def entropy_bonus_on(args) -> bool:
    """Whether TRL's loss has its entropy bonus (it then logs ``policy_loss`` beside ``loss``)."""
    return getattr(args, "entropy_coef", 0.0) != 0.0 or bool(getattr(args, "use_adaptive_entropy", False))


def prepares_models(args, reward_funcs: list, peft: bool) -> bool:
    """Whether TRL's trainer has its accelerator prepare a model when it is built: the reference (``beta`` != 0
    without PEFT) or a reward model. transformers' evaluation before training then prepares none, and gives no
    ``model_preparation_time``."""
    from grpolab.rewards.model import names_a_model

    return (args.beta != 0.0 and not peft) or any(names_a_model(f) for f in reward_funcs)


def evaluation_metrics(
    evaluation,
    part: EvalPart,
    prefix: str,
    args,
    world_size: int,
    num_tokens: int,
    preparation: float | None = None,
) -> dict:
    """What TRL's ``evaluate`` returns for one dataset ``part`` evaluated (``evaluation``: a
    :class:`grpolab.eval.groups.GroupEvaluation`) under the prefix ``prefix``, without ``epoch``; ``preparation``: the
    seconds that set the evaluation up, for an evaluation before training (transformers'
    ``model_preparation_time``, which it gives from the first evaluation that prepared the model on)."""
    from transformers.trainer_utils import speed_metrics

    batch = args.per_device_eval_batch_size * world_size
    steps = math.ceil(part.samples / batch)
    own = {f"{prefix}_model_preparation_time": preparation} if preparation is not None else {}
    own |= speed_metrics(prefix, time.time() - evaluation.seconds, num_samples=part.samples, num_steps=steps)
    return eval_entry(eval_metrics(evaluation, entropy_bonus_on(args)), prefix, own, num_tokens)
