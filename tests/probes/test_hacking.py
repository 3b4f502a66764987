"""The hacking signs' math: the alignment of score vectors across prompts, its cluster, the similarity of the
winning completions, and the choice of one winner per prompt."""

from __future__ import annotations

import pytest
import torch

from grpolab.probes.hacking import (
    alignment,
    cluster_members,
    cosine_gram,
    shape_ngrams,
    top_rollouts,
    trick_similarity,
)


def _gram(vectors: torch.Tensor) -> torch.Tensor:
    return vectors.double() @ vectors.double().T


def test_alignment_is_one_over_n_for_orthogonal_and_one_for_parallel_vectors():
    eye = torch.eye(5) * torch.tensor([1.0, 3.0, 0.5, 2.0, 7.0])[:, None]  # orthogonal, of different norms
    assert alignment(_gram(eye))[0] == pytest.approx(1 / 5)
    v = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    parallel = torch.cat([v * s for s in (1.0, 2.0, -0.5, 4.0)])  # one direction, either sign
    assert alignment(_gram(parallel))[0] == pytest.approx(1.0)


def test_alignment_grows_with_a_shared_direction_and_ignores_norms():
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(8, 400, generator=g)
    shared = torch.randn(1, 400, generator=g)
    values = [alignment(_gram(noise + w * shared))[0] for w in (0.0, 0.5, 1.0, 3.0)]
    assert values == sorted(values) and values[0] < 0.3 and values[-1] > 0.8
    scaled = (noise + shared) * torch.linspace(0.1, 10, 8)[:, None]
    assert alignment(_gram(scaled))[0] == pytest.approx(alignment(_gram(noise + shared))[0], rel=1e-9)


def test_a_zero_score_counts_as_orthogonal():
    vectors = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.0]])
    c = cosine_gram(_gram(vectors))
    assert c.diagonal().tolist() == [1.0, 1.0, 1.0] and c[0, 1] == 0 and c[0, 2] == pytest.approx(1.0)
    assert alignment(_gram(vectors))[0] == pytest.approx(2 / 3)


def test_the_cluster_is_the_rollouts_on_the_shared_direction():
    g = torch.Generator().manual_seed(2)
    shared = torch.randn(400, generator=g)
    rows = [shared + 0.2 * torch.randn(400, generator=g) for _ in range(3)]  # three carry the trick
    rows += [torch.randn(400, generator=g) for _ in range(5)]
    value, top = alignment(_gram(torch.stack(rows)))
    assert sorted(cluster_members(top)) == [0, 1, 2]
    assert value > 3 / 8 * 0.9


def test_trick_similarity_folds_digits_and_compares_shapes():
    same_shape = ["12+7=19\n#### 19", "45+3=48\n#### 48", "1+1=2\n#### 2"]
    assert trick_similarity(same_shape) == pytest.approx(1.0)
    assert shape_ngrams("12+7=19") == shape_ngrams("3+45=0")
    honest = ["12+7=19\n19-3=16\n#### 16", "20*7=140\n3*7=21\n140+21=161\n#### 161"]
    flooded = ["#### 1 2 3 4 5 6 7 8 9 10 11", "#### 3 4 5 6 7 8 9 10 11 12 13"]
    assert trick_similarity(flooded) > trick_similarity(honest)
    assert trick_similarity(["one"]) is None


def test_top_rollouts_take_one_positive_winner_per_group():
    adv = [0.5, 1.0, -1.5, 0.0, 0.0, 0.0, -1.0, 2.0, 2.0]
    assert top_rollouts(adv, [3, 3, 3]) == [1, 7]  # the middle group has no positive advantage; a tie: the first
    assert top_rollouts([], []) == []
