"""A run's group evaluation (:mod:`grpolab.eval.groups`, TRL's evaluation): its settings from the run's resolved
config, drawn through the trainer's rollout service and scored by its reward.

``grpolab.trl`` evaluates this way, during its training (through the recipe's trainer) and in ``evaluate()``
(through a trainer built for it, :func:`grpolab.commands.api.evaluate_groups`); ``grpolab train`` does not.
"""

from __future__ import annotations

from grpolab.config.train import TrainConfig
from grpolab.eval.groups import GroupEvaluation, GroupSettings, RatioOneLoss, group_evaluation
from grpolab.rollout.engine import SamplingSettings
from grpolab.training.update_options import loss_options


def group_settings(cfg: TrainConfig, group_size: int, batch_prompts: int) -> GroupSettings:
    """The group evaluation of a run with the resolved config ``cfg``: ``group_size`` completions a prompt,
    ``batch_prompts`` prompts a batch, sampled as the run samples, its loss at ratio 1 from the run's objective (none
    with a KL term, GDPO's normalize-then-sum or rtg advantages: :mod:`grpolab.eval.groups`)."""
    gen, objective, terms = cfg.generation, cfg.objective, cfg.terms
    sampling = SamplingSettings.of(gen)
    loss = None
    plain = objective.reward_normalisation == "sum-then-normalize" and objective.advantage == "grpo"
    if objective.beta == 0 and plain:
        loss = RatioOneLoss(
            loss_options(objective, terms, cfg.max_policy_tokens),
            objective.estimator,
            objective.scale_rewards,
            objective.sample_std,
            objective.mask_truncated,
            objective.top_entropy_quantile,
            terms.entropy_coef,
        )
    return GroupSettings(group_size, max(batch_prompts, 1), sampling, cfg.run.seed, loss)


def evaluate_groups(trainer, parts: list[list[dict]], group_size: int, batch_prompts: int) -> list[GroupEvaluation]:
    """The group evaluation of each of ``parts`` (held-out records) with ``trainer``'s policy as it is now
    (:class:`grpolab.training.trainer.GRPOTrainer`: its service and reward), on every rank."""
    settings = group_settings(trainer.cfg, group_size, batch_prompts)
    service = trainer.sampling_stage.service
    with trainer.update_stage.train_module.full_weights(), service.current_weights():
        return [group_evaluation(service, records, settings, trainer.world) for records in parts]
