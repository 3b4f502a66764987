"""How one draw is shared among generator workers: rows split into contiguous parts (:func:`contiguous_parts`), each
part's request (:func:`draw_header`), and the workers' answers put back in the call's order (:func:`merge_parts`).
Pure: lists and tensors in, out."""

from __future__ import annotations

import dataclasses

import torch

from grpolab.common.batch import Batch
from grpolab.rollout.remote.common import settings_json
from grpolab.rollout.sampler import Sampled


def contiguous_parts(n: int, k: int) -> list[list[int]]:
    """Rows 0..n-1 in ``k`` (--generators N) contiguous parts, sizes as even as they go (fewer when n < k), whatever
    number of workers is live: each part is drawn as one batch by some worker, so the rows, and every bit of what
    is computed for them, do not depend on which workers are live, lost or late."""
    k = max(1, min(k, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


def draw_header(request: tuple, rows: list[int], digest: bool) -> dict:
    """The frame asking a worker to draw ``rows`` of ``request`` (version, prompts, keys, settings); ``digest``: ask
    for the checksum of the weights it drew with."""
    version, prompts, keys, settings = request
    # every part padded as the whole call would be: each row computed as the trainer's own engine computes it
    settings = dataclasses.replace(settings, prompt_width=max(settings.prompt_width, *map(len, prompts)))
    return {
        "kind": "draw",
        "version": version,
        "prompts": [prompts[i] for i in rows],
        "keys": [list(keys[i]) for i in rows],
        "settings": settings_json(settings),
        "digest": digest,
    }


def merge_parts(n: int, parts: list[tuple[list[int], list[torch.Tensor | None]]], pad_id: int) -> Sampled:
    """The workers' rows in the call's order, padded as one draw pads them (prompts left, completions right).

    Args:
        n (int): rows in the call (N).
        parts (list): per part, its row indices in the call and its six tensors: prompt ids and mask ``[n_i, p_i]``
            (left-padded), completion ids and mask ``[n_i, c_i]`` (right-padded), the sampler's log-probs and
            entropies ``[n_i, c_i]`` (either may be None: vLLM's entropy is absent).
        pad_id (int): the padding token id.

    Returns:
        Sampled: ``Batch`` of prompt ids and mask ``[N, P]``, completion ids and mask ``[N, T]`` with ``P``, ``T``
        the widest part's, and the log-probs and entropies ``[N, T]`` (or None).
    """
    P = max(t[0].shape[1] for _, t in parts)
    T = max(t[2].shape[1] for _, t in parts)
    first = parts[0][1]
    out = [
        first[0].new_full((n, P), pad_id),
        first[1].new_zeros((n, P)),
        first[2].new_full((n, T), pad_id),
        first[3].new_zeros((n, T)),
        *(None if first[j] is None else first[j].new_zeros((n, T)) for j in (4, 5)),  # absent: vLLM's entropy
    ]
    for rows, t in parts:
        idx = torch.tensor(rows)
        p, c = t[0].shape[1], t[2].shape[1]
        out[0][idx, P - p :] = t[0]
        out[1][idx, P - p :] = t[1]
        for j in (2, 3, 4, 5):
            if out[j] is not None:
                out[j][idx, :c] = t[j]
    return Sampled(Batch(*out[:4]), out[4], out[5])
