"""Early signs of reward hacking read from a step's rollouts and their gradients (docs/reward-hacking.md).

At its onset a hack is a rare success in a failing group, so GRPO gives it the group's largest advantage; the same
trick then wins in many groups at once. Two of its traces show before the mean reward moves:

- **gradient alignment across prompts** (:func:`alignment`): the score vectors psi_i of the top-advantage rollouts
  of different prompts point one way. Honest successes on unrelated questions share little beyond the answer's
  format; one trick paid everywhere is one direction of the weights. From the Gram matrix Psi_ij = <psi_i, psi_j>
  (:func:`grpolab.probes.gram.score_gram`): the cosine matrix C = D^-1/2 Psi D^-1/2 and the share of its trace on its
  top eigenvalue, lambda_1 / n, between 1/n (orthogonal scores) and 1 (one direction). The rollouts that load on the
  top eigenvector are the cluster (:func:`cluster_members`), whose completions the doctor shows.
- **the same winning trick across groups** (:func:`trick_similarity`): the top-advantage completions of different
  prompts look alike: the mean Jaccard similarity of their character n-gram sets, with digit runs folded to one
  symbol (a question's numbers are its own; a trick is a shape).

Both are compared with the run's own start by the doctor (:mod:`grpolab.doctor.hacking`), never with a fixed level:
a task whose honest answers share a format starts high.
"""

from __future__ import annotations

import re

import torch

NGRAM = 4
"""Characters per n-gram of :func:`trick_similarity`: short enough to match a shared trick inside different text,
long enough that two answers of one alphabet are not alike by their letters alone."""
_DIGITS = re.compile(r"\d+")


def cosine_gram(psi: torch.Tensor) -> torch.Tensor:
    """C = D^-1/2 Psi D^-1/2 ``[n, n]`` (float64) from a Gram matrix ``[n, n]``: the cosines of the vectors' angles.
    A vector of norm 0 (a rollout whose score is 0) is orthogonal to every other and has C_ii = 1."""
    psi = psi.double()
    psi = 0.5 * (psi + psi.T)
    norm = psi.diagonal().clamp(min=0.0).sqrt()
    live = norm > 0
    inv = torch.where(live, 1.0 / torch.where(live, norm, torch.ones_like(norm)), torch.zeros_like(norm))
    c = inv[:, None] * psi * inv[None, :]
    return c + torch.diag((~live).double())


def alignment(psi: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(lambda_1 / n, top eigenvector ``[n]``) of the cosine matrix of Gram ``psi`` ``[n, n]``: the share of the
    vectors' (unit-normalised) energy in their one most shared direction. 1/n for orthogonal vectors, 1 for parallel
    ones (either sign: a direction is shared whichever way a rollout pushes along it). The eigenvector's sign is
    chosen so that most of its weight is positive."""
    n = psi.shape[0]
    if n == 0:
        return 0.0, torch.zeros(0, dtype=torch.float64)
    vals, vecs = torch.linalg.eigh(cosine_gram(psi))
    top = vecs[:, -1]
    if top.sum() < 0:
        top = -top
    return float(vals[-1].clamp(min=0.0)) / n, top


def cluster_members(top: torch.Tensor) -> list[int]:
    """The rollouts that carry the top direction: those whose loading on the top eigenvector ``[n]`` is at least the
    uniform loading 1/sqrt(n), in the eigenvector's (majority) sign; strongest first."""
    n = top.numel()
    if n == 0:
        return []
    order = torch.argsort(top, descending=True).tolist()
    return [i for i in order if float(top[i]) >= 1.0 / n**0.5 - 1e-12]


def shape_ngrams(text: str, n: int = NGRAM) -> frozenset[str]:
    """The set of character n-grams of ``text`` with every run of digits folded to '0' and white space to one
    space (the whole text as one gram when it is shorter than n)."""
    folded = " ".join(_DIGITS.sub("0", text).split())
    if len(folded) < n:
        return frozenset([folded]) if folded else frozenset()
    return frozenset(folded[i : i + n] for i in range(len(folded) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a & b| / |a | b| (1 for two empty sets: two empty answers are alike)."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def trick_similarity(texts: list[str], n: int = NGRAM) -> float | None:
    """The mean Jaccard similarity of :func:`shape_ngrams` over the pairs of ``texts`` (the top-advantage completion
    of each of several prompts: every pair is of two prompts). None for fewer than two texts."""
    grams = [shape_ngrams(t, n) for t in texts]
    pairs = [(i, j) for i in range(len(grams)) for j in range(i + 1, len(grams))]
    if not pairs:
        return None
    return sum(jaccard(grams[i], grams[j]) for i, j in pairs) / len(pairs)


def top_rollouts(advantages: list[float], sizes: list[int]) -> list[int]:
    """The index (flat, over the step's rollouts in group order) of the highest-advantage rollout of each group whose
    highest advantage is positive: one winner per prompt. A tie goes to the group's first."""
    out, start = [], 0
    for size in sizes:
        group = advantages[start : start + size]
        if group:
            best = max(range(size), key=lambda g: (group[g], -g))
            if group[best] > 0:
                out.append(start + best)
        start += size
    return out
