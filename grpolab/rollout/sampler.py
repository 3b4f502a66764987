"""Rollouts: sample completions from the policy (the ``hf`` rollout engine's sampler).

Sampling is a hand-written loop over the model's KV cache rather than
``model.generate`` for two reasons no library option covers: (1) each rollout
draws its randomness from its own counter-based stream, keyed by
``(seed, step, prompt, rollout)``, so a rollout does not depend on which batch
or process produced it (resume and multi-process runs reproduce it exactly);
(2) rows that have emitted EOS are dropped from the batch and the cache, so
finished sequences cost nothing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch
from transformers import DynamicCache

from grpolab.common.batch import Batch, left_pad
from grpolab.models.logprobs import logprob_entropy, sampling_logprobs
from grpolab.models.shared_prefix import distinct_prompts


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a rollout is sampled: the same for every row of a call."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    ignore_eos: bool = False  # every row runs to max_new_tokens; an end-of-sequence token sampled on the way is kept


def rollout_uniforms(keys: list[tuple[int, ...]], length: int) -> torch.Tensor:
    """``[N, length]`` float64 uniforms in [0, 1), row n a pure function of ``keys[n]``.

    Kept in float64: cast to float32, a draw within 2^-25 of 1 would round to 1.0
    and select past the end of the CDF.
    """
    rows = [np.random.default_rng(list(k)).random(length) for k in keys]
    return torch.from_numpy(np.stack(rows))


def _pick(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Inverse-CDF sampling: the token where the (top-p) CDF first exceeds ``u``.

    logits ``[n, V]``, u ``[n]`` -> ``[n]``. Temperature 0 is greedy.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # float64 CDF: with u < 1 the selected token always has probability > 0
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # [n, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # smallest prefix with mass >= top_p
        cdf = (sorted_p * keep).cumsum(-1)
        j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)
        return order.gather(1, j).squeeze(1)
    cdf = probs.cumsum(-1)
    j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)
    return j.squeeze(1)


def nucleus_log_mass(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log of the probability mass that top-p sampling keeps (the smallest prefix with mass >= top_p, :func:`_pick`'s
    rule) at temperature T: ``[n, V] -> [n]``; 0 with top_p = 1. A kept token's log-prob under the distribution that
    was sampled from is its log-prob at T minus this."""
    if top_p >= 1.0 or temperature == 0.0:
        return torch.zeros(logits.shape[0], device=logits.device)
    sorted_p = torch.softmax(logits.double() / temperature, dim=-1).sort(dim=-1, descending=True).values
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return torch.log((sorted_p * keep).sum(-1)).float()


class Sampled(NamedTuple):
    """Sampled rollouts with what the sampler saw at each completion token (0 on padding)."""

    batch: Batch
    logprobs: torch.Tensor  # [N, T] log pi_sampler(o_t | q, o_<t): the distribution sampled from (top-p: renormalised)
    entropy: torch.Tensor  # [N, T] the sampling policy's entropy, nats


def sample(
    model,
    prompts: list[list[int]],
    keys: list[tuple[int, ...]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
) -> Batch:
    """Sample one completion per prompt (repeat a prompt G times for a group).

    ``keys[n]`` seeds rollout n's random stream. Completions stop at EOS (kept,
    and masked in) or after ``max_new_tokens``. Each distinct prompt is prefilled
    once and its cache copied to its rows: the same tokens as a prefill per row.
    """
    return _sample(model, prompts, keys, max_new_tokens, temperature, top_p, eos_id, pad_id, False).batch


def sample_with_stats(
    model,
    prompts: list[list[int]],
    keys: list[tuple[int, ...]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
) -> Sampled:
    """:func:`sample`, the same tokens, with the sampler's log-prob of each sampled token and the entropy of
    its distribution at every completion token ``[N, T]``, from the logits it already has: no extra forward."""
    return _sample(model, prompts, keys, max_new_tokens, temperature, top_p, eos_id, pad_id, True)


def _prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The KV cache of every row's prompt, the logits of its first completion token ``[N, V]``, and the prompts'
    position ids ``[N, P]``. Each distinct prompt is prefilled once (a group's G rows share theirs) and its cache
    copied to its rows."""
    # Position ids count real tokens only, so left padding does not shift them.
    position = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P]
    first, inverse = distinct_prompts(prompt_ids, prompt_mask)  # [U], [N]
    cache = DynamicCache()
    out = model(
        input_ids=prompt_ids[first],
        attention_mask=prompt_mask[first],
        position_ids=position[first],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache.batch_select_indices(inverse)  # [U, ...] -> [N, ...]
    return cache, out.logits[:, -1][inverse], position


@torch.no_grad()
def _sample(model, prompts, keys, max_new_tokens, temperature, top_p, eos_id, pad_id, want_stats: bool) -> Sampled:
    N = len(prompts)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))  # [N, P]
    u = rollout_uniforms(keys, max_new_tokens).to(device)  # [N, T]
    out_ids = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((N,), max_new_tokens, dtype=torch.long, device=device)

    cache, logits, position = _prefill(model, prompt_ids, prompt_mask)  # logits [N, V]
    attn = prompt_mask
    next_pos = position[:, -1] + 1  # [n]
    active = torch.arange(N, device=device)  # rows still generating
    ent = torch.zeros((N, max_new_tokens), device=device) if want_stats else None
    lp = torch.zeros((N, max_new_tokens), device=device) if want_stats else None
    for t in range(max_new_tokens):
        if want_stats:
            logp = sampling_logprobs(logits, temperature)  # [n, V]
            ent[active, t] = logprob_entropy(logp)
        tok = _pick(logits, u[active, t], temperature, top_p)  # [n]
        if want_stats:
            lp[active, t] = logp.gather(1, tok[:, None]).squeeze(1) - nucleus_log_mass(logits, temperature, top_p)
        out_ids[active, t] = tok
        done = tok == eos_id
        lengths[active[done]] = t + 1
        if t == max_new_tokens - 1:
            break
        if done.any():
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
            cache.batch_select_indices(keep)
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)  # [n, P + t + 1]
        out = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1]
        next_pos = next_pos + 1

    T = int(lengths.max())
    completion_mask = (torch.arange(T, device=device)[None, :] < lengths[:, None]).long()  # [N, T]
    completion_ids = out_ids[:, :T].masked_fill(completion_mask == 0, pad_id)
    batch = Batch(prompt_ids, prompt_mask, completion_ids, completion_mask)
    if not want_stats:
        return Sampled(batch, None, None)
    return Sampled(batch, lp[:, :T] * completion_mask, ent[:, :T] * completion_mask)  # [N, T] each
