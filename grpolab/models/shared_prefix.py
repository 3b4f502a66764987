"""Shared prompt prefix: each distinct prompt of a batch is encoded once, and its rows attend to that one copy.

The G rollouts of a group share their prompt. The plain forward runs the prompt once per
row; here it runs once per distinct prompt (the *prompt pass*, with gradient), its per-layer
keys and values are indexed out to the rows, and the rows' completions run on top of them
(the *completion pass*).

Why it is exact. Attention is causal: no prompt position attends to a completion token, so a
prompt's hidden states, keys and values are the same in every row that holds it. A
completion token attends to [prompt keys, earlier completion keys], whichever pass computed
the prompt's part. In backward, the index that expands the shared keys and values sums the
gradients of the rows that read them: the sum that the G copies of the prompt would receive
in the plain forward. Log-probs and gradients therefore equal the plain path's up to float
rounding (the sums run in another order). The first completion token is predicted by the
prompt's last position, so its logits come from the prompt pass.

Why by hand: transformers caches prefixes for generation only. Its ``DynamicLayer`` appends
on every call, so a layer recomputed under activation checkpointing would append twice,
which is why checkpointed layers drop the cache. The two layers below never append: the
prompt layer *sets* what it holds and the prefix layer only reads, so a recomputed layer
sees the same states, and they may stay in place under checkpointing
(:func:`keep_cache_under_checkpointing`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from grpolab.vision.media import decode_positions, model_inputs


class _PromptLayer(DynamicLayer):
    """Prompt pass: holds the keys and values the layer computed (with their graph)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states  # set, never append: a recomputation stores the same
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """Completion pass: the prompt's keys and values ``[n, heads, P, d]``, read before each row's own."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.reads = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.reads += 1
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class PrefixNotUsed(RuntimeError):
    """The model ran without reading the shared prompt cache (it cannot take a precomputed cache)."""


def distinct_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, media=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the distinct prompts ``[U]`` and, for each of the N rows, its prompt's place among them ``[N]``.
    ``media``: the rows' images (:class:`grpolab.common.batch.Batch`); rows alike in tokens but with other images are
    other prompts."""
    key = torch.cat([prompt_ids, prompt_mask], dim=1)  # [N, 2P]: the mask too, in case a prompt begins with the pad id
    if media is not None:
        bundles = {id(m): k for k, m in enumerate(media)}  # a group's rows hold the same bundle
        which = torch.tensor([bundles[id(m)] for m in media], device=key.device)[:, None]  # [N, 1]
        key = torch.cat([key, which], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [N] in 0..U-1
    U = int(inverse.max()) + 1
    first = torch.full((U,), key.shape[0], dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(key.shape[0], device=inverse.device), reduce="amin")
    return first, inverse


def distinct_prompt_inputs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, media=None):
    """``(first, inverse, inputs)``: :func:`distinct_prompts`, and the forward's inputs of the distinct prompts
    ``[U, P]``: ids (with images: the merged embeddings), mask, and positions that count real tokens only, so left
    padding shifts nothing (:func:`grpolab.vision.media.model_inputs`)."""
    first, inverse = distinct_prompts(prompt_ids, prompt_mask, media)  # [U], [N]
    rows = None if media is None else [media[i] for i in first.tolist()]
    return first, inverse, model_inputs(model, prompt_ids[first], prompt_mask[first], rows)


def shared_prefix_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, media=None):
    """Run a batch with each distinct prompt encoded once (with its images: ``media``, the rows' bundles of
    :class:`grpolab.common.batch.Batch`; the completion is text).

    Args (N rows, P prompt and T completion tokens, as in :class:`grpolab.rollout.sampler.Batch`):
        prompt_ids, prompt_mask ``[N, P]`` (left-padded); completion_ids, completion_mask ``[N, T]``.
    Returns:
        first_logits ``[N, V]``: logits at each row's last prompt position (they predict completion token 0);
        hidden ``[N, T - 1, d]``: the decoder's output at completion positions 0..T-2 (they predict tokens 1..T-1),
        or None when T == 1.
    Raises :class:`PrefixNotUsed` when some layer did not read the shared keys and values.
    """
    first, inverse, inputs = distinct_prompt_inputs(model, prompt_ids, prompt_mask, media)
    cache = Cache(layer_class_to_replicate=_PromptLayer)
    out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
    first_logits = out.logits[:, -1][inverse]  # [N, V]
    if not cache.layers or any(layer.keys is None for layer in cache.layers):
        raise PrefixNotUsed("the prompt pass wrote no keys and values")
    T = completion_ids.shape[1]
    if T == 1:
        return first_logits, None
    prefix = Cache(
        layers=[_PrefixLayer(layer.keys[inverse], layer.values[inverse]) for layer in cache.layers]
    )  # [N, h, P, d] each
    attn = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)  # [N, P + T - 1]
    # the completion continues from the prompt's last position (the real tokens' count; M-RoPE: where its text is)
    start = decode_positions(inputs["position_ids"])[inverse][:, -1:] + 1  # [N, 1]
    position = start + torch.arange(T - 1, device=prompt_mask.device)  # [N, T - 1]
    hidden = model.get_decoder()(
        input_ids=completion_ids[:, :-1],
        attention_mask=attn,
        position_ids=position,
        past_key_values=prefix,
        use_cache=True,
    ).last_hidden_state  # [N, T - 1, d]
    if any(layer.reads == 0 for layer in prefix.layers):
        raise PrefixNotUsed("the completion pass did not read the prompt's keys and values")
    return first_logits, hidden


def keep_cache_under_checkpointing(model) -> None:
    """Let activation-checkpointed decoder layers keep the shared-prefix cache (transformers drops caches there,
    because its own cache layers would be written twice when a layer is recomputed; ours are not)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = True


def unsupported_reason(model, logprobs_fn) -> str | None:
    """None if ``model`` runs the shared-prefix path and matches the plain one, else the reason it does not.

    ``logprobs_fn(model, (prompt_ids, prompt_mask, completion_ids, completion_mask), shared_prefix)`` computes
    completion log-probs (:func:`grpolab.models.logprobs.completion_logprobs`).
    A tiny batch of two prompts of different lengths, two rows each, one completion shorter than
    the other; dropout off for the comparison, everything else (training mode, checkpointing) as set.
    """
    param = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = lambda *xs: torch.tensor(xs, dtype=torch.long, device=param.device) % vocab  # noqa: E731
    one = lambda *xs: torch.tensor(xs, dtype=torch.long, device=param.device)  # noqa: E731
    batch = (
        torch.stack([ids(0, 5, 6, 7)] * 2 + [ids(5, 8, 9, 10)] * 2),  # prompt ids [4, 4]: two prompts, two rows each
        torch.stack([one(0, 1, 1, 1)] * 2 + [one(1, 1, 1, 1)] * 2),  # the first one left-padded
        torch.stack([ids(11, 12, 13), ids(14, 15, 0), ids(12, 11, 16), ids(17, 18, 19)]),  # completions [4, 3]
        torch.stack([one(1, 1, 1), one(1, 1, 0), one(1, 1, 1), one(1, 1, 1)]),  # one of them shorter
    )
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.training]
    for m in dropouts:
        m.eval()
    try:
        with torch.no_grad():
            plain = logprobs_fn(model, batch, False)
            shared = logprobs_fn(model, batch, True)
    except Exception as e:  # noqa: BLE001 - any failure means: use the plain path
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    finally:
        for m in dropouts:
            m.train()
    tol = 5e-2 if param.dtype in (torch.bfloat16, torch.float16) else 1e-4  # half precision rounds at ~1e-2
    err = float((plain - shared).abs().max()) / max(1.0, float(plain.abs().max()))
    if not err <= tol:
        return f"its log-probs differ from the plain path's by {err:.2g} (relative)"
    return None
