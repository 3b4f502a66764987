"""What the update reads of the run's options, and the metrics it writes: its sections
(:class:`UpdateSections`), :func:`grpolab.algo.loss.policy_loss`'s options from them (:func:`loss_options`, which
the held-out group evaluation computes its loss with too) and the keys every step's update logs
(:func:`update_metrics`)."""

from __future__ import annotations

from typing import NamedTuple

from grpolab.algo.loss import effective_aggregation
from grpolab.config.objective import ObjectiveSection, OptimizerSection, TermSection, UpdateSection
from grpolab.config.rollout import GenerationSection


def loss_options(objective: ObjectiveSection, terms: TermSection, max_policy_tokens: int) -> dict:
    """The options of :func:`grpolab.algo.loss.policy_loss` that come from the run's config (the objective's and the
    term's sections; ``max_policy_tokens`` Dr. GRPO's max_len); a pass adds its tensors and the step's normalisers."""
    return dict(
        aggregation=effective_aggregation(terms.loss_type, objective.aggregation),
        clip_low=objective.clip_low,
        clip_high=objective.clip_high,
        clip_delta=objective.clip_delta or None,
        beta=objective.beta,
        kl=objective.kl,
        kl_ratio=objective.kl_ratio,
        importance_sampling=objective.importance_sampling,
        loss_type=terms.loss_type,
        params=terms.term_params(),
        off_policy_threshold=terms.off_policy_mask_threshold or None,
        max_len=max_policy_tokens,
    )


def update_metrics(
    lr: float,
    total: float | None = None,
    policy: float | None = None,
    kl: float | None = None,
    clip_frac: float | None = None,
    ratio_mean: float | None = None,
    active_frac: float = 0.0,
    skipped: int = 0,
    grad_norm: float | None = None,
) -> dict:
    """The metrics every step's update logs, under their keys, written once: the loss and its parts, the clipped share
    and mean ratio over loss-carrying tokens, the share of rows that ran, the optimizer steps skipped, the gradient
    norm and the learning rate after the step. A step with no update (:meth:`Updater.skip`) logs None for what it did
    not compute (0 rows ran, 0 steps skipped)."""
    return {
        "loss/total": total,
        "loss/policy": policy,
        "loss/kl": kl,
        "loss/clip_frac": clip_frac,
        "loss/ratio_mean": ratio_mean,
        "loss/active_frac": active_frac,
        "loss/skipped_updates": skipped,
        "grad/norm": grad_norm,
        "charts/lr": lr,
    }


class UpdateSections(NamedTuple):
    """The run's options the update reads, by section (:meth:`of` a run's config)."""

    objective: ObjectiveSection
    """The loss: clip bounds, KL, aggregation, --mu, --engine-correction ..."""
    passes: UpdateSection
    """How the passes run: --micro-batch, --minibatches, --micro-batch-tokens ..."""
    terms: TermSection = TermSection()
    """The per-token policy term (--loss-type) and its constants, the entropy bonus."""
    optimizer: OptimizerSection = OptimizerSection()
    """--max-grad-norm (the rest is the optimizer's and the schedule's, built by the update stage)."""
    generation: GenerationSection = GenerationSection()
    """The sampler's --top-p, --top-k, --min-p and --repetition-penalty: its log-probs of the distribution it sampled
    from are put on the trainer's scale (the engine correction)."""
    max_policy_tokens: int = 0
    """Dr. GRPO's max_len (:attr:`grpolab.config.train.TrainConfig.max_policy_tokens`)."""

    @classmethod
    def of(cls, cfg) -> UpdateSections:
        """The sections of a run's config (:class:`grpolab.config.train.TrainConfig`)."""
        return cls(cfg.objective, cfg.update, cfg.terms, cfg.optimizer, cfg.generation, cfg.max_policy_tokens)
