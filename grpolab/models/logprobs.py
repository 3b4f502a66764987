"""Log-probabilities of completion tokens under a model: the training forward's scoring.

The update, the KL reference, the shared-prefix self-check and the probes all score fixed tokens
with :func:`completion_logprobs`; sampling (``grpolab.rollout.sampler``) computes its own from the logits
it already has.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from grpolab.algo.distill import token_divergence
from grpolab.common.batch import Batch
from grpolab.models.sampling_rules import NO_RULES, SamplingRules, sampling_log_offset, seen_tokens
from grpolab.models.shared_prefix import shared_prefix_hidden
from grpolab.vision.media import in_prompts, model_inputs

LOGITS_BUDGET = 2**25  # floats of logits held at once before the LM head is chunked (128 MB fp32)


def completion_logprobs(
    model,
    batch: Batch,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    shared_prefix: bool = False,
    packed: bool = False,
    entropy: bool = False,
    rules: SamplingRules = NO_RULES,
) -> torch.Tensor:
    """``[N, T]`` log pi(o_t | q, o_<t) of each completion token (0 where masked); with ``entropy``, ``[N, T, 2]``:
    each position's log-prob and the entropy of pi(. | q, o_<t) (both differentiable: the entropy bonus's). With
    ``rules`` on (top-p < 1, top-k, min-p, a repetition penalty) one more column ``[..., -1]``, no gradient: the
    offset log pi_T(o_t) - log p_sampling(o_t) from this model's logits, which puts a sampler's log-probs of the
    distribution it sampled from on this model's scale (top-p alone: the log of the mass it keeps,
    :func:`nucleus_log_mass`; otherwise :func:`grpolab.models.sampling_rules.sampling_log_offset`).

    The LM head runs at completion positions only: the prompt's logits are never formed.
    With a large vocabulary (SmolLM2: 49,152) and long completions the ``[N, T, V]`` logits would dominate
    memory, so above ``LOGITS_BUDGET`` floats the head runs over the real (unmasked) completion tokens only,
    ``chunk_tokens`` of them at a time under activation checkpointing: a chunk's ``[chunk, V]`` logits exist
    only while its log-probs are computed, forward and again in backward, whatever the rows' lengths.
    ``chunk_tokens=0`` never chunks (the score Gram matrix's hooks need the head to run once per forward).

    ``shared_prefix``: rows with the same prompt (a group) share one prompt pass
    (:mod:`grpolab.models.shared_prefix`): same log-probs and gradients, the prompt's cost paid once.
    ``packed``: the rows' real tokens run as one sequence without padding (:func:`_packed_logprobs`).
    """
    N, T = batch.completion_ids.shape
    head = model.get_output_embeddings()
    V = head.weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = 0 if N * (T + 1) * V <= LOGITS_BUDGET else max(1, LOGITS_BUDGET // V)
    target, mask = batch.completion_ids, batch.completion_mask  # [N, T]
    history = None
    if rules.penalised:  # [N, T, 3]: each token with its row and position, whose history the penalty reads
        target, history = _with_positions(target), _history(batch, V)
    score = _scorer(entropy, rules, history)  # [..., V] -> [..., k] or [...]
    m = mask[..., None] if entropy or not rules.full_support else mask
    if packed and batch.media is not None:
        raise ValueError("the packed forward takes text rows only; rows with images run padded")
    if shared_prefix and batch.media is not None and not in_prompts(batch.media, batch.prompt_mask):
        shared_prefix = False  # an environment's picture after the prompt: the padded forward merges it
    if packed:
        return _packed_logprobs(model, head, batch, temperature, chunk_tokens, score, target)
    if shared_prefix:
        first_logits, hidden = shared_prefix_hidden(model, *batch)  # [N, V], [N, T - 1, d] or None
        first = score(first_logits[:, None], target[:, :1], temperature)  # [N, 1]
        if hidden is None:
            return first * m
        rest = _head_logprobs(head, hidden, target[:, 1:], temperature, chunk_tokens, mask[:, 1:], score)  # [N, T - 1]
        return torch.cat([first, rest], dim=1) * m
    if not chunk_tokens:
        logits = model(**_model_inputs(model, batch), logits_to_keep=T + 1).logits
        return score(logits[:, :-1], target, temperature) * m
    hidden = _completion_hidden(model, batch)  # [N, T, d]
    return _head_logprobs(head, hidden, target, temperature, chunk_tokens, mask, score) * m


def _model_inputs(model, batch: Batch) -> dict[str, torch.Tensor]:
    """Prompt and completion as one left-padded sequence ``[N, P + T]``, with its attention mask and positions (and
    for rows with images their merged embeddings: :func:`grpolab.vision.media.model_inputs`), and no cache.

    ``use_cache=False``: scoring keeps nothing for later tokens. Left to its config, a model whose own module has no
    ``gradient_checkpointing`` flag (NemotronH) builds a cache in training too, and a checkpointed layer, which keeps
    the cache under grpolab's checkpointing (:func:`grpolab.models.shared_prefix.keep_cache_under_checkpointing`),
    would write its keys into it a second time when backward recomputes it."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [N, P + T]
    attn = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    return {**model_inputs(model, ids, attn, batch.media), "use_cache": False}


def _completion_hidden(model, batch: Batch) -> torch.Tensor:
    """``[N, T, d]`` the decoder's last hidden states that predict the completion tokens (position P-1+t predicts
    completion token t)."""
    T = batch.completion_ids.shape[1]
    return model.get_decoder()(**_model_inputs(model, batch)).last_hidden_state[:, -(T + 1) : -1]


def _head_logprobs(
    head, hidden: torch.Tensor, target: torch.Tensor, temperature: float, chunk_tokens: int, mask: torch.Tensor, score
) -> torch.Tensor:
    """``[N, T]`` log-probs of ``target`` from hidden states ``[N, T, d]``: all at once when ``chunk_tokens`` is 0;
    else only at the tokens ``mask`` keeps (padding costs nothing), ``chunk_tokens`` of them at a time under
    activation checkpointing, 0 elsewhere."""
    if not chunk_tokens:
        return score(head(hidden), target, temperature)
    keep = mask.bool()  # [N, T]
    logp = _tokens_logprobs(head, hidden[keep], target[keep], temperature, chunk_tokens, score)  # [M]: real tokens
    return hidden.new_zeros((*keep.shape, *logp.shape[1:]), dtype=logp.dtype).index_put((keep,), logp)  # [N, T]


def _tokens_logprobs(
    head, h: torch.Tensor, tgt: torch.Tensor, temperature: float, chunk_tokens: int, score
) -> torch.Tensor:
    """``[M]`` log-probs of tokens ``tgt`` ``[M]`` from their hidden states ``[M, d]``: all at once when
    ``chunk_tokens`` is 0 (or M fits in it), else ``chunk_tokens`` at a time under activation checkpointing, so a
    chunk's ``[chunk, V]`` logits exist only while its log-probs are computed (forward, and again in backward)."""
    if not chunk_tokens or h.shape[0] <= chunk_tokens:
        return score(head(h), tgt, temperature)

    def chunk_logp(h_c: torch.Tensor, tgt_c: torch.Tensor) -> torch.Tensor:
        return score(head(h_c), tgt_c, temperature)  # [c, V] logits -> [c]

    parts = [
        torch.utils.checkpoint.checkpoint(
            chunk_logp, h[i : i + chunk_tokens], tgt[i : i + chunk_tokens], use_reentrant=False
        )  # fmt: skip
        for i in range(0, h.shape[0], chunk_tokens)
    ]
    return torch.cat(parts)


def _packed_logprobs(
    model, head, batch: Batch, temperature: float, chunk_tokens: int, score, target: torch.Tensor
) -> torch.Tensor:
    """``[N, T]`` completion log-probs with the rows packed: padding-free.

    Each row's real tokens (prompt, then completion; where the masks are 1) are laid end to end in one sequence
    ``[1, L]``, L = the batch's real tokens, with position ids restarting at 0 for each row. Given position ids that
    restart and no attention mask, transformers attends within each row only (``find_packed_sequence_indices``: a
    block-diagonal causal mask for sdpa and eager attention, variable-length kernels for flash-attention). So each
    token sees what it sees in the padded forward, at the same position: the same log-probs to float rounding, and
    no padding token is computed. The LM head runs at the M completion tokens' predictors only. ``target``
    ``[N, T]`` (or ``[N, T, 3]`` with the tokens' places, :func:`_with_positions`): what ``score`` scores.
    """
    keep = batch.completion_mask.bool()  # [N, T]
    hidden = _packed_hidden(model, batch)[0]  # [M, d], in the order of target[keep]
    logp = _tokens_logprobs(head, hidden, target[keep], temperature, chunk_tokens, score)  # [M]
    return hidden.new_zeros((*keep.shape, *logp.shape[1:]), dtype=logp.dtype).index_put((keep,), logp)  # [N, T]


def _packed_hidden(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, d]`` the hidden states that predict the M real completion tokens and ``[M]`` those tokens, in the order of
    ``completion_ids[completion_mask]``, from one forward of the rows packed (:func:`_packed_logprobs`)."""
    attn = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).bool()  # [N, P + T]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)[attn]  # [L]: real tokens, row after row
    lengths = attn.sum(1)  # [N]
    starts = (lengths.cumsum(0) - lengths).repeat_interleave(lengths)  # [L] where each token's row begins
    position = torch.arange(ids.shape[0], device=ids.device) - starts  # [L] 0, 1, ... within each row
    # use_cache=False: transformers looks for packed rows only when there is no cache (and no attention mask)
    hidden = model.get_decoder()(input_ids=ids[None], position_ids=position[None], use_cache=False)  # [1, L, d]
    hidden = hidden.last_hidden_state[0]  # [L, d]
    keep = batch.completion_mask.bool()  # [N, T]
    at = torch.cat([torch.zeros_like(batch.prompt_mask, dtype=torch.bool), keep], dim=1)[attn].nonzero()[:, 0]  # [M]
    # Completion token k sits at packed index at[k]; the token before it (same row: a prompt has >= 1 token)
    # predicts it. Row-major order, the order of ``completion_ids[keep]``.
    return hidden[at - 1], ids[at]


def completion_hidden(model, batch: Batch, packed: bool = False) -> torch.Tensor:
    """``[M, d]`` the decoder's last hidden states that predict the batch's M real completion tokens, in the order of
    ``completion_ids[completion_mask]`` (``packed``: from the rows packed without padding)."""
    if packed:
        return _packed_hidden(model, batch)[0]
    return _completion_hidden(model, batch)[batch.completion_mask.bool()]


def completion_divergence(
    model,
    batch: Batch,
    teacher_hidden: torch.Tensor,
    teacher_head,
    beta: float,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """``[N, T, 2]``: each completion token's log-prob under ``model`` and the generalized JSD between ``model``'s and
    a teacher's whole next-token distributions there (:func:`grpolab.algo.distill.token_divergence`; ``beta`` 0:
    forward KL, 1: reverse KL), both differentiable in ``model``'s weights; 0 where masked.

    ``teacher_hidden`` ``[M, d_t]``: the teacher's hidden states at the same M real tokens (:func:`completion_hidden`
    of the teacher), which its ``teacher_head`` projects to the vocabulary. Neither ``[N, T, V]`` logits is formed:
    both heads run over the real tokens only, ``chunk_tokens`` at a time under activation checkpointing (the
    student's) once they pass ``LOGITS_BUDGET`` floats, as :func:`completion_logprobs` does.
    """
    keep = batch.completion_mask.bool()  # [N, T]
    head = model.get_output_embeddings()
    V = head.weight.shape[0]
    M = int(keep.sum())
    if chunk_tokens is None:
        chunk_tokens = M if 2 * M * V <= LOGITS_BUDGET else max(1, LOGITS_BUDGET // (2 * V))
    h, target = completion_hidden(model, batch, packed), batch.completion_ids[keep]  # [M, d], [M]

    def chunk_scores(h_c: torch.Tensor, tgt_c: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
        logits = head(h_c)  # [c, V]
        with torch.no_grad():
            t_logits = teacher_head(t_c)  # [c, V]
        logp = _token_logprobs(logits, tgt_c, temperature)  # [c]
        return torch.stack([logp, token_divergence(logits, t_logits, beta, temperature).to(logp.dtype)], dim=-1)

    parts = []
    for i in range(0, M, max(chunk_tokens, 1)):
        args = (h[i : i + chunk_tokens], target[i : i + chunk_tokens], teacher_hidden[i : i + chunk_tokens])
        run = chunk_tokens < M and torch.is_grad_enabled()
        parts.append(torch.utils.checkpoint.checkpoint(chunk_scores, *args, use_reentrant=False) if run else
                     chunk_scores(*args))  # fmt: skip
    scores = torch.cat(parts) if parts else h.new_zeros((0, 2), dtype=torch.float32)  # [M, 2]
    return scores.new_zeros((*keep.shape, 2)).index_put((keep,), scores)  # [N, T, 2]


def _scorer(entropy: bool, rules: SamplingRules, history=None):
    """What each position's logits ``[..., V]`` become: the target's log-prob ``[...]``, with ``entropy`` and the entropy
    ``[..., 2]``, and with ``rules`` on the offset of the sampling distribution as a last column (top-p alone: the log
    nucleus mass). ``history``: with the repetition penalty, the targets come as ``[..., 3]`` (token, row, position:
    :func:`_with_positions`) and ``history(rows, t)`` gives those positions' seen tokens ``[c, V]``."""
    if rules.full_support:
        return _token_scores if entropy else _token_logprobs

    def score(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
        tok = target if history is None else target[..., 0]
        out = _token_scores(logits, tok, temperature) if entropy else _token_logprobs(logits, tok, temperature)
        with torch.no_grad():
            flat = logits.reshape(-1, logits.shape[-1])  # [M, V]
            if rules.nucleus_only:
                extra = nucleus_log_mass(flat, temperature, rules.top_p)  # [M]
            else:
                places = None if history is None else target.reshape(-1, 3)  # [M, 3]
                seen = None if history is None else lambda i, j: history(places[i:j, 1], places[i:j, 2])
                extra = sampling_log_offset(flat, tok.reshape(-1), temperature, rules, seen)  # [M]
        extra = extra.view(logits.shape[:-1]).to(out.dtype)[..., None]
        return torch.cat([out if entropy else out[..., None], extra], dim=-1)

    return score


def _with_positions(target: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` tokens -> ``[N, T, 3]``: each with its row and its position in the completion, which the chunked
    paths carry along with it (they flatten and split the positions) to the repetition penalty's history."""
    N, T = target.shape
    rows = torch.arange(N, device=target.device)[:, None].expand(N, T)
    t = torch.arange(T, device=target.device)[None, :].expand(N, T)
    return torch.stack([target, rows, t], dim=-1)


def _history(batch: Batch, vocab: int):
    """``(rows [c], t [c]) -> [c, V]`` bool: the tokens seen before completion position t of each row, the prompt's
    real tokens and the completion's before t (what the repetition penalty reads, as the sampler kept it)."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [N, P + T]
    j = torch.arange(batch.completion_ids.shape[1], device=ids.device)  # [T]

    def seen(rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        valid = torch.cat([batch.prompt_mask[rows].bool(), j[None, :] < t[:, None]], dim=1)  # [c, P + T]
        return seen_tokens(ids[rows], valid, vocab)

    return seen


def _token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at ``target``: ``[..., V]``, ``[...]`` -> ``[...]`` (fp32, or fp64 for fp64
    logits)."""
    if logits.dtype != torch.float64:
        logits = logits.float()  # bf16 logits: the softmax in fp32
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _token_scores(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[..., 2]``: :func:`_token_logprobs` and the entropy of softmax(logits / temperature), from one softmax."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return torch.stack([logp, logprob_entropy(logp_all)], dim=-1)


@torch.no_grad()
def completion_entropy(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """``[N, T]`` the entropy (nats) of pi(. | q, o_<t) at each completion position, at ``temperature`` (0 where
    masked): what grpolab's sampler records as it samples, from one forward, for rollouts of an engine that gives
    none (vLLM). One row at a time, so the ``[T, V]`` logits of a single rollout are the most held at once."""
    from grpolab.models.logprobs import token_entropy

    head = model.get_output_embeddings()
    rows = []
    for i in range(batch.completion_ids.shape[0]):
        row = batch.rows(i, i + 1)  # one rollout, its padding kept
        logits = head(_completion_hidden(model, row))  # [1, T, V]
        rows.append(token_entropy(logits.float(), temperature)[0] * row.completion_mask[0])
    return torch.stack(rows) if rows else torch.zeros(batch.completion_ids.shape)


def sampling_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) over the last dimension (fp32; T = 0, greedy, scores at T = 1): ``[..., V] -> [..., V]``.

    The full distribution at the sampling temperature, before any top-p truncation: the distribution the
    trainer's log-probs (``grpolab.models.logprobs``) are computed from.
    """
    return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / T) over the last dimension: ``[..., V] -> [...]``
    (the full distribution at the sampling temperature, before any top-p truncation, as TRL logs it)."""
    return logprob_entropy(sampling_logprobs(logits, temperature))


def logprob_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the distribution whose log-probs are ``logp``, over the last dimension: ``[..., V] -> [...]``."""
    return -(logp.exp() * logp).sum(-1)


def nucleus_log_mass(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log of the probability mass that top-p sampling keeps (the smallest prefix with mass >= top_p, the sampler's
    rule: ``grpolab.rollout.sampler``) at temperature T: ``[n, V] -> [n]``; 0 with top_p = 1. A kept token's log-prob
    under the distribution that was sampled from is its log-prob at T minus this."""
    if top_p >= 1.0 or temperature == 0.0:
        return torch.zeros(
            logits.shape[0], device=logits.device, dtype=torch.promote_types(logits.dtype, torch.float32)
        )
    sorted_p = torch.softmax(logits.double() / temperature, dim=-1).sort(dim=-1, descending=True).values
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    mass = torch.log((sorted_p * keep).sum(-1))
    return mass if logits.dtype == torch.float64 else mass.float()
