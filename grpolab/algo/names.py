"""The names of the algorithm's choices, without torch: what the config validates options against (the config is
read, and a bad option refused, before torch is imported: ``--nproc P`` checks it once, then relaunches)."""

ESTIMATORS = ("vanilla", "grpo", "grpo_std", "rloo", "oracle")
"""``--estimator``: the advantage's baseline (grpolab.algo.advantages)."""
SCALES = ("group", "batch", "none")
"""``--scale-rewards``: which spread the advantages are divided by."""
CREDITS = ("grpo", "rtg-group", "rtg-mc")
"""``--advantage``: how an episode's turns share its credit [Foundations, Sec. 6]."""
CORRECTIONS = ("none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask")
"""How the sampler/trainer mismatch is reweighted (grpolab.algo.engine_correction)."""
CORRECTION_CHOICES = ("auto", *CORRECTIONS)
"""``--engine-correction``: a mode of :data:`CORRECTIONS`, or auto (grpolab.algo.engine_correction.resolve_correction)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum")
"""``--aggregation``: how per-token terms combine (grpolab.algo.loss.aggregate)."""
IMPORTANCE_SAMPLING = ("token", "sequence", "sequence-sum")
LOSS_TYPES = ("clip", "cispo", "sapo", "luspo", "vespo")
"""``--loss-type``: the per-token policy term (grpolab.algo.loss.policy_term)."""
NORMALISATIONS = ("sum-then-normalize", "normalize-then-sum")
"""``--reward-normalisation``: several reward functions summed before the advantage, or each normalised first (GDPO)."""

DISTILL_LOSSES = ("rkl-reward", "rkl", "fkl", "jsd")
"""--distill-loss's choices (grpolab.algo.distill): the per-token reward, then the full-vocabulary divergences."""
