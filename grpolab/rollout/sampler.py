"""Rollouts: sample completions from the policy (the ``hf`` rollout engine's sampler).

Sampling is a hand-written loop over the model's KV cache rather than
``model.generate`` for reasons no library option covers: (1) each rollout
draws its randomness from its own counter-based stream, keyed by
``(seed, step, prompt, rollout)``, so a rollout does not depend on which batch
or process produced it (resume and multi-process runs reproduce it exactly);
(2) rows that have emitted EOS are dropped from the batch and the cache, so
finished sequences cost nothing; (3) the cache is allocated once and written
in place (``grpolab.models.decode_cache``), where transformers' own cache copies
itself at every new token; (4) each distinct prompt is prefilled once.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from grpolab.common.batch import Batch, left_pad
from grpolab.config.rollout import GenerationSection
from grpolab.models.attention import attention_rounding, upcast_dtype
from grpolab.models.decode_cache import SlabCache, cache_keyword, model_cache, slab_supported
from grpolab.models.logprobs import logprob_entropy, nucleus_log_mass, sampling_logprobs
from grpolab.models.sampling_rules import SamplingRules, sample_processed, seen_tokens
from grpolab.models.shared_prefix import distinct_prompt_inputs
from grpolab.vision.media import decode_positions


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a rollout is sampled: the same for every row of a call."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    ignore_eos: bool = False  # every row runs to max_new_tokens; an end-of-sequence token sampled on the way is kept
    prompt_width: int = 0
    """Left-pad the prompts to at least this many tokens (0: the call's longest). A row's arithmetic depends on where
    its tokens sit in the padded batch (the CPU's vector reductions group them by position), so a draw split
    among generator workers pads every part to the width of the whole call, and each row is computed as in it."""
    top_k: int = 0  # the rules beside top-p (grpolab.models.sampling_rules), each off at its default
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, generation: GenerationSection, ignore_eos: bool | None = None) -> SamplingSettings:
        """A run's ``generation`` options (``ignore_eos``: in place of theirs)."""
        g = generation
        eos = g.ignore_eos if ignore_eos is None else ignore_eos
        return cls(g.max_new_tokens, g.temperature, g.top_p, eos, top_k=g.top_k, min_p=g.min_p,
                   repetition_penalty=g.repetition_penalty)  # fmt: skip

    @property
    def rules(self) -> SamplingRules:
        """Top-p, top-k, min-p and the repetition penalty, as the sampling distribution's definition takes them."""
        return SamplingRules(self.top_k, self.top_p, self.min_p, self.repetition_penalty)


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


class Sampled(NamedTuple):
    """Sampled rollouts with what the sampler saw at each completion token (0 on padding)."""

    batch: Batch
    logprobs: torch.Tensor  # [N, T] log pi_sampler(o_t | q, o_<t): the distribution sampled from (top-p etc. applied)
    entropy: torch.Tensor  # [N, T] the sampling policy's entropy, nats


CACHES = ("slab", "dynamic")
"""How the decode loop keeps its keys and values: ``slab``, a buffer allocated once and written in place
(:mod:`grpolab.models.decode_cache`); ``dynamic``, the model's own cache as transformers' ``generate`` builds it
(``DynamicCache(config=...)``: full-attention layers copy themselves at every token), the loop's earlier form, kept
for models the slab does not hold (sliding windows, recurrent layers) and as the reference the tests compare with."""


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
    cache: str = "slab",
    decoder=None,
    media=None,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> Batch:
    """Sample one completion per prompt (repeat a prompt G times for a group).

    ``keys[n]`` seeds rollout n's random stream. Completions stop at EOS (kept,
    and masked in) or after ``max_new_tokens``. Each distinct prompt is prefilled
    once and its cache copied to its rows: the same tokens as a prefill per row.

    Args:
        model (nn.Module): the policy's transformers causal LM (a vision-language one for rows with images); the
            batch is made on its device, without gradients, in the mode it is in (callers put it in eval mode).
        prompts (list[list[int]]): N prompts' token ids, unpadded: B prompts, each repeated G times, N = B*G.
        keys (list[tuple[int, ...]]): [N] rollout keys; ``keys[n]`` seeds row n's uniforms (the collector's
            ``(stream, seed, step, prompt, rollout)``), so a row's tokens do not depend on the other rows.
        max_new_tokens (int): the most tokens a completion gets.
        temperature (float): the softmax temperature; 0 is greedy.
        top_p (float): nucleus sampling's mass (1.0: off).
        eos_id (int): the token that ends a completion (kept, and masked in); -1: none, every row runs to
            ``max_new_tokens``.
        pad_id (int): the id written on padding, the prompts' (left) and the completions' (right).
        cache (str): how the decode loop keeps its keys and values, one of :data:`CACHES` (the same tokens either
            way, to float rounding).
        decoder (FusedDecoder | None): a :class:`grpolab.models.fused_decode.FusedDecoder` of ``model`` for the
            decode steps (with the slab cache); None: the model's own forward.
        media (Sequence[Media | None] | None): [N] each prompt's images (a :class:`grpolab.vision.media.Media` or
            None), or None for text.
        top_k (int): keep the k most likely tokens (0: off); ``min_p`` (float): drop those below min_p x the most
            likely (0: off); ``repetition_penalty`` (float): the penalty of the tokens seen before (1: off). With
            top_p, the distribution of :mod:`grpolab.models.sampling_rules`, in its (vLLM's) order.

    Returns:
        Batch: on the model's device: ``prompt_ids`` [N, P] left-padded (P: the longest prompt), ``prompt_mask``
            [N, P], ``completion_ids`` [N, T] right-padded with ``pad_id`` after EOS (T: the longest completion,
            at most ``max_new_tokens``), ``completion_mask`` [N, T] 1 on generated tokens, EOS included, and
            ``media`` (the rows' bundles on that device, or None for text rows).

    Raises:
        ValueError: ``cache`` is not one of :data:`CACHES`, or the rows' image features and placeholders disagree
            (:func:`grpolab.vision.media.model_inputs`).
    """
    settings = SamplingSettings(
        max_new_tokens, temperature, top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty
    )
    return _sample(model, prompts, keys, settings, eos_id, pad_id, False, cache, decoder, media).batch


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
    cache: str = "slab",
    decoder=None,
    prompt_width: int = 0,
    media=None,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> Sampled:
    """:func:`sample`, the same tokens, with the sampler's log-prob of each sampled token (under the distribution it
    sampled from) and the entropy of the model's distribution at the temperature (before top-p, top-k, min-p and the
    penalty) at every completion token ``[N, T]``, from the logits it already has: no extra forward."""
    settings = SamplingSettings(
        max_new_tokens, temperature, top_p, prompt_width=prompt_width, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty,
    )  # fmt: skip
    return _sample(model, prompts, keys, settings, eos_id, pad_id, True, cache, decoder, media)


def _prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, media=None):
    """The KV cache of each *distinct* prompt ``[U, ...]``, the logits of every row's first completion token
    ``[N, V]``, the prompts' position ids ``[N, P]`` and each row's distinct prompt ``[N]`` (a group's G rows share
    theirs: each distinct prompt is prefilled once). ``media``: the rows' images (:class:`grpolab.common.batch.Batch`),
    which the prefill runs through the whole model; the decode steps after it are text. The cache is the model's own
    kind (:func:`grpolab.models.decode_cache.model_cache`), so a hybrid model's recurrent layers have their place."""
    _, inverse, inputs = distinct_prompt_inputs(model, prompt_ids, prompt_mask, media)  # [N], the U prompts' inputs
    cache = model_cache(model)
    out = model(**inputs, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
    # Position ids count real tokens only, so left padding does not shift them (M-RoPE: where the text continues).
    position = decode_positions(inputs["position_ids"])[inverse]  # [N, P]
    return cache, out.logits[:, -1][inverse], position, inverse


class _SlabDecode:
    """Decode steps over a :class:`SlabCache`: the attention mask and the positions are preallocated too and read
    as views, so a step allocates nothing that grows with the completion. Slot j holds row ``rows[j]``. With a
    ``fused`` decoder (:class:`grpolab.models.fused_decode.FusedDecoder`) the steps run through it instead of the
    model's forward."""

    def __init__(
        self, prefill, inverse, prompt_mask, position, max_new_tokens: int, cache_dtype, fused=None, rounding=None
    ):
        N, P = prompt_mask.shape
        capacity = P + max_new_tokens - 1  # the last token is sampled, never fed back
        self.cache = SlabCache.from_prefill(prefill, inverse, capacity, cache_dtype, rounding)
        self.attn = prompt_mask.new_ones(N, capacity)  # [N, P + T - 1]: prompt padding, then every new token
        self.attn[:, :P] = prompt_mask
        self.pos = position[:, -1] + 1  # [N] the next token's position id
        self.rows = torch.arange(N, device=prompt_mask.device)
        self.fused = fused
        if fused is not None:
            fused.forget()  # the prefill's activations, which its projections remembered

    def drop(self, done: torch.Tensor) -> torch.Tensor:
        """Drops the slots where ``done`` ``[n]``; returns the kept slots' order (index the step's tokens with it)."""
        order = self.cache.drop(done)  # [n']
        n = order.numel()
        moved = order != torch.arange(n, device=order.device)
        if moved.any():  # the rows moved into holes bring their mask rows along
            self.attn[:n][moved] = self.attn[order[moved]]
        self.pos, self.rows = self.pos[order], self.rows[order]
        return order

    def step(self, model, tok: torch.Tensor) -> torch.Tensor:
        """Feeds the live rows' tokens ``[n]``; returns the next logits ``[n, V]``."""
        n, L = self.rows.numel(), self.cache.get_seq_length()
        if self.fused is not None:
            logits = self.fused.step(tok, self.pos, self.attn[:n, : L + 1], self.cache)
            self.pos = self.pos + 1
            return logits
        out = model(
            input_ids=tok[:, None],
            attention_mask=self.attn[:n, : L + 1],  # a view: no concatenation
            position_ids=self.pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.pos = self.pos + 1
        return out.logits[:, -1]


class _DynamicDecode:
    """Decode steps over the model's own cache (:func:`grpolab.models.decode_cache.model_cache`): the loop's earlier
    form. The cache and the attention mask grow by concatenation at every token; finished rows are dropped by copying
    the whole cache.

    Rows are selected with the cache's ``reorder_cache`` (beam search's), which every kind of layer implements for all
    it holds: ``batch_select_indices`` of a layer with both a recurrent state and keys selects only the keys. A model
    that takes ``cache_params`` (Mamba's family) reads an attention mask as the padding of the tokens it is given, so
    its decode steps get none, as in its own ``generate``: a new token is never padding."""

    def __init__(self, model, prefill, inverse, prompt_mask, position):
        prefill.reorder_cache(inverse)  # [U, ...] -> [N, ...]
        self.cache, self.attn = prefill, prompt_mask
        self.pos = position[:, -1] + 1  # [n]
        self.rows = torch.arange(prompt_mask.shape[0], device=prompt_mask.device)
        self.keyword = cache_keyword(model)

    def drop(self, done: torch.Tensor) -> torch.Tensor:
        keep = (~done).nonzero().squeeze(1)
        self.attn, self.pos, self.rows = self.attn[keep], self.pos[keep], self.rows[keep]
        self.cache.reorder_cache(keep)
        return keep

    def step(self, model, tok: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.shape[0], 1)], dim=1)  # [n, P + t + 1]
        out = model(
            input_ids=tok[:, None],
            attention_mask=None if self.keyword == "cache_params" else self.attn,
            position_ids=self.pos[:, None],
            **{self.keyword: self.cache},
            use_cache=True,
        )
        self.pos = self.pos + 1
        return out.logits[:, -1]


def _decoder(cache: str, model, prefill, inverse, prompt_mask, position, max_new_tokens: int, fused):
    """The decode steps ``cache`` names; ``slab`` falls back to ``dynamic`` for a model whose prefill wrote another
    kind of cache layer (a sliding window, a recurrent state: ``grpolab.models.decode_cache.slab_reason``, which the
    engine says once). A half-precision model on the CPU whose attention takes keys of another dtype
    (``grpolab.models.attention``) caches them in fp32. ``fused``: a fused decoder, for the slab only."""
    if cache not in CACHES:
        raise ValueError(f"unknown decode cache {cache!r}; choose from {CACHES}")
    if cache == "dynamic" or not slab_supported(prefill):
        return _DynamicDecode(model, prefill, inverse, prompt_mask, position)
    cache_dtype, rounding = upcast_dtype(model), attention_rounding(model)
    return _SlabDecode(prefill, inverse, prompt_mask, position, max_new_tokens, cache_dtype, fused, rounding)


def _draw(logits: torch.Tensor, u: torch.Tensor, s: SamplingSettings, seen, want_stats: bool):
    """One decode step's tokens ``[n]`` from the live rows' logits ``[n, V]`` and uniforms ``[n]``, with (``want_stats``)
    each token's log-prob under the distribution sampled from and the entropy of the model's at the temperature
    ``[n]`` each (else None). ``seen``: the rows' penalty histories ``[n, V]``, or None."""
    logp = sampling_logprobs(logits, s.temperature) if want_stats else None  # [n, V]
    entropy = logprob_entropy(logp) if want_stats else None
    rules = s.rules
    if not rules.nucleus_only:  # top-k, min-p or the penalty: the rules' distribution (grpolab.models.sampling_rules)
        tok, tok_lp = sample_processed(logits, u, s.temperature, rules, seen)
        return tok, tok_lp.float() if want_stats else None, entropy
    tok = _pick(logits, u, s.temperature, s.top_p)  # [n]
    if not want_stats:
        return tok, None, None
    nucleus = nucleus_log_mass(logits, s.temperature, s.top_p).float()  # [n] the kept mass's log
    return tok, logp.gather(1, tok[:, None]).squeeze(1) - nucleus, entropy


@torch.no_grad()
def _sample(
    model, prompts, keys, s: SamplingSettings, eos_id, pad_id, want_stats: bool, cache: str, fused, media=None
) -> Sampled:
    N, T = len(prompts), s.max_new_tokens
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id, s.prompt_width))  # [N, P]
    u = rollout_uniforms(keys, T).to(device)  # [N, T]
    out_ids = torch.full((N, T), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((N,), T, dtype=torch.long, device=device)
    ent = torch.zeros((N, T), device=device) if want_stats else None
    lp = torch.zeros((N, T), device=device) if want_stats else None

    media = None if media is None or all(m is None for m in media) else tuple(m and m.to(device) for m in media)
    prefill, logits, position, inverse = _prefill(model, prompt_ids, prompt_mask, media)  # logits [N, V]
    decode = _decoder(cache, model, prefill, inverse, prompt_mask, position, T, fused)
    # [N, V] the repetition penalty's history by row: the prompt's real tokens, then each token sampled
    seen = seen_tokens(prompt_ids, prompt_mask.bool(), logits.shape[-1]) if s.rules.penalised else None
    for t in range(T):
        rows = decode.rows  # [n] the rows still generating, in the decoder's slot order
        tok, tok_lp, tok_ent = _draw(logits, u[rows, t], s, None if seen is None else seen[rows], want_stats)  # [n]
        if want_stats:
            lp[rows, t], ent[rows, t] = tok_lp, tok_ent
        if seen is not None:
            seen[rows, tok] = True
        out_ids[rows, t] = tok
        done = tok == eos_id
        lengths[rows[done]] = t + 1
        if t == T - 1:
            break
        if done.any():
            if bool(done.all()):
                break
            tok = tok[decode.drop(done)]
        logits = decode.step(model, tok)

    L = int(lengths.max())
    completion_mask = (torch.arange(L, device=device)[None, :] < lengths[:, None]).long()  # [N, L]
    completion_ids = out_ids[:, :L].masked_fill(completion_mask == 0, pad_id)
    batch = Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, media)
    if not want_stats:
        return Sampled(batch, None, None)
    return Sampled(batch, lp[:, :L] * completion_mask, ent[:, :L] * completion_mask)  # [N, L] each
