"""Probes of GRPO's gradient [Foundations]: advantage statistics, the per-rollout score
Gram matrix, and the spectrum of the per-rollout gradient matrix."""

from grpolab.probes.advantage_stats import advantage_stats
from grpolab.probes.gram import gram_relative_error, score_gram, score_gram_reference, token_weights
from grpolab.probes.spectrum import RANK_RTOL, singular_values_from_gram, spectrum_metrics

__all__ = [
    "RANK_RTOL",
    "advantage_stats",
    "gram_relative_error",
    "score_gram",
    "score_gram_reference",
    "singular_values_from_gram",
    "spectrum_metrics",
    "token_weights",
]
