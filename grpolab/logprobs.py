"""Log-probabilities of completion tokens under a model: the training forward's scoring.

The update, the KL reference, the shared-prefix self-check and the probes all score fixed tokens
with :func:`completion_logprobs`; sampling (``grpolab.rollout``) computes its own from the logits
it already has.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from grpolab.rollout import Batch
from grpolab.shared_prefix import shared_prefix_hidden

LOGITS_BUDGET = 2**25  # floats of logits held at once before the LM head is chunked (128 MB fp32)


def completion_logprobs(
    model, batch: Batch, temperature: float = 1.0, chunk_tokens: int | None = None, shared_prefix: bool = False
) -> torch.Tensor:
    """``[N, T]`` log pi(o_t | q, o_<t) of each completion token (0 where masked).

    The LM head runs at completion positions only: the prompt's logits are never formed.
    With a large vocabulary (SmolLM2: 49,152) and long completions the ``[N, T, V]`` logits would dominate
    memory, so above ``LOGITS_BUDGET`` floats the head runs over the real (unmasked) completion tokens only,
    ``chunk_tokens`` of them at a time under activation checkpointing: a chunk's ``[chunk, V]`` logits exist
    only while its log-probs are computed, forward and again in backward, whatever the rows' lengths.
    ``chunk_tokens=0`` never chunks (the score Gram matrix's hooks need the head to run once per forward).

    ``shared_prefix``: rows with the same prompt (a group) share one prompt pass
    (:mod:`grpolab.shared_prefix`): same log-probs and gradients, the prompt's cost paid once.
    """
    N, T = batch.completion_ids.shape
    head = model.get_output_embeddings()
    V = head.weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = 0 if N * (T + 1) * V <= LOGITS_BUDGET else max(1, LOGITS_BUDGET // V)
    target, mask = batch.completion_ids, batch.completion_mask  # [N, T]
    if shared_prefix:
        first_logits, hidden = shared_prefix_hidden(model, *batch)  # [N, V], [N, T - 1, d] or None
        first = _token_logprobs(first_logits[:, None], target[:, :1], temperature)  # [N, 1]
        if hidden is None:
            return first * mask
        rest = _head_logprobs(head, hidden, target[:, 1:], temperature, chunk_tokens, mask[:, 1:])  # [N, T - 1]
        return torch.cat([first, rest], dim=1) * mask
    if not chunk_tokens:
        logits = model(**_model_inputs(batch), logits_to_keep=T + 1).logits
        return _token_logprobs(logits[:, :-1], target, temperature) * mask
    hidden = _completion_hidden(model, batch)  # [N, T, d]
    return _head_logprobs(head, hidden, target, temperature, chunk_tokens, mask) * mask


def _model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Prompt and completion as one left-padded sequence ``[N, P + T]``, with its attention mask and positions."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [N, P + T]
    attn = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}


def _completion_hidden(model, batch: Batch) -> torch.Tensor:
    """``[N, T, d]`` the decoder's last hidden states that predict the completion tokens (position P-1+t predicts
    completion token t)."""
    T = batch.completion_ids.shape[1]
    return model.get_decoder()(**_model_inputs(batch)).last_hidden_state[:, -(T + 1) : -1]


def _head_logprobs(
    head, hidden: torch.Tensor, target: torch.Tensor, temperature: float, chunk_tokens: int, mask: torch.Tensor
) -> torch.Tensor:
    """``[N, T]`` log-probs of ``target`` from hidden states ``[N, T, d]``: all at once when ``chunk_tokens`` is 0;
    else only at the tokens ``mask`` keeps (padding costs nothing), ``chunk_tokens`` of them at a time under
    activation checkpointing, 0 elsewhere."""
    if not chunk_tokens:
        return _token_logprobs(head(hidden), target, temperature)
    keep = mask.bool()  # [N, T]
    h, tgt = hidden[keep], target[keep]  # [M, d], [M]: the real tokens, row after row

    def chunk_logp(h_c: torch.Tensor, tgt_c: torch.Tensor) -> torch.Tensor:
        return _token_logprobs(head(h_c), tgt_c, temperature)  # [c, V] logits -> [c]

    parts = [
        torch.utils.checkpoint.checkpoint(
            chunk_logp, h[i : i + chunk_tokens], tgt[i : i + chunk_tokens], use_reentrant=False
        )  # fmt: skip
        for i in range(0, h.shape[0], chunk_tokens)
    ]
    out = hidden.new_zeros(target.shape, dtype=parts[0].dtype if parts else torch.float32)  # [N, T]
    return out.index_put((keep,), torch.cat(parts)) if parts else out


def _token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at ``target``: ``[..., V]``, ``[...]`` -> ``[...]`` (fp32, or fp64 for fp64
    logits)."""
    if logits.dtype != torch.float64:
        logits = logits.float()  # bf16 logits: the softmax in fp32
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def completion_entropy(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """``[N, T]`` the entropy (nats) of pi(. | q, o_<t) at each completion position, at ``temperature`` (0 where
    masked): what grpolab's sampler records as it samples, from one forward, for rollouts of an engine that gives
    none (vLLM). One row at a time, so the ``[T, V]`` logits of a single rollout are the most held at once."""
    from grpolab.rollout import token_entropy

    head = model.get_output_embeddings()
    rows = []
    for i in range(batch.completion_ids.shape[0]):
        row = Batch(*(t[i : i + 1] for t in batch))  # one rollout, its padding kept
        logits = head(_completion_hidden(model, row))  # [1, T, V]
        rows.append(token_entropy(logits.float(), temperature)[0] * row.completion_mask[0])
    return torch.stack(rows) if rows else torch.zeros(batch.completion_ids.shape)
