"""Grouped-query attention without copying the keys and values, under a padding mask, on the CPU.

Models with fewer key/value heads than query heads (SmolLM2: 3 for 9; Qwen2) share each key/value head among a
group of query heads. Given an attention mask, transformers' sdpa path repeats the keys and values to every query
head before calling PyTorch's ``scaled_dot_product_attention`` (its rule for CUDA, whose fast kernels take no mask
with grouped heads). While sampling, the mask is there in every step (left-padded prompts), so every layer copies
its whole cache three times over at each new token: at 1,100 tokens that copy was most of the step's time.

PyTorch's CPU kernel takes grouped heads and a mask together (``enable_gqa=True``) and gives the same output bit for
bit, 5-6x faster at decode shapes (measured in ``tests/models/test_models.py`` for equality). :func:`use_grouped_sdpa`
points a model at :func:`grouped_sdpa_forward`, which calls the kernel that way for CPU tensors with a mask and
hands every other case to transformers' own sdpa function unchanged. Why by hand: transformers has no switch for it.

Sampling a half-precision model on the CPU, the decode cache holds fp32 keys and values (:func:`upcast_dtype`) and
attention runs in fp32: PyTorch's CPU attention kernel is 6-10x slower in bf16 than in fp32 at decode shapes
(8 rows, 9 heads, 64 dimensions: 5.9 ms against 0.54 ms a call at 1,088 cached tokens, measured on this project's
AVX512-BF16 CPU), while the linear layers around it gain from bf16. :func:`grouped_sdpa_forward` casts the query to
the keys' dtype and its output back.

A copy that computes as autocast does (a sampler for a bf16-mixed trainer: fp32 norms and residual stream, bf16
products) attends as autocast's attention would: its queries, keys and values rounded to bf16 and its output too
(:func:`attention_rounding` names the dtype; the CPU's bf16 attention kernel computes in fp32 between the two
roundings as well), in fp32 for the speed above.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "grpolab_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with grouped heads passed to the kernel as they are when a mask is given on the
    CPU. query ``[B, H, q, d]``, key and value ``[B, H_kv, k, d]``, mask ``[B, 1, q, k]`` -> ``[B, q, H, d]``.
    Keys of another dtype than the query (an fp32 decode cache under a bf16 model): computed in the keys' dtype,
    returned in the query's."""
    rounding = attention_rounding(module)
    if rounding is not None:  # as autocast's attention: inputs and output in its dtype, computed in fp32 here
        query, key, value = (rounded(t, rounding) for t in (query, key, value))
        out, _ = _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        return rounded(out, rounding), None
    if key.dtype != query.dtype:
        out, _ = _attend(module, query.to(key.dtype), key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        return out.to(query.dtype), None
    return _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """:func:`grouped_sdpa_forward` on a query and keys of one dtype."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if not grouped or attention_mask is None or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    # With a mask transformers calls the kernel with is_causal=False (the mask carries causality) and repeated heads.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: torch.nn.Module, always: bool = False) -> bool:
    """Point ``model`` (a transformers model on sdpa attention with grouped heads; with ``always``, any model on
    sdpa attention) at :func:`grouped_sdpa_forward`. Returns whether it did; any other model is left as it is."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    heads, kv = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
    if not always and (not kv or kv >= heads):
        return False
    register_grouped_sdpa()
    model.set_attn_implementation(NAME)
    return True


def register_grouped_sdpa() -> None:
    """Make :func:`grouped_sdpa_forward` known to transformers under :data:`NAME` (a model whose config names it
    can then be built, as in a process of its own that did not load the policy)."""
    AttentionInterface.register(NAME, grouped_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks transformers builds for sdpa


ROUNDING = "grpolab_attention_rounding"
"""The config attribute that names the dtype a copy's attention rounds to (:func:`attention_rounding`)."""


def attention_rounding(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype ``module``'s (or its model's) attention rounds its queries, keys, values and output to, as autocast
    computes attention: set on a sampler's copy that computes as autocast does; None otherwise."""
    name = getattr(getattr(module, "config", None), ROUNDING, None)
    return getattr(torch, name) if name else None


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype``'s precision, in fp32 (the CPU's attention is fast in fp32)."""
    return t.to(dtype).to(torch.float32)


def upcast_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a decode cache should hold for ``model``: fp32 for a half-precision model on the CPU whose attention
    is :func:`grouped_sdpa_forward` (it then attends in fp32, see the module's docstring) or for a copy whose
    attention rounds as autocast's (its keys fp32, its values bf16), else None (the model's own dtype)."""
    if attention_rounding(model) is not None:
        return torch.float32
    param = next(model.parameters())
    config = getattr(model, "config", None)
    ours = getattr(config, "_attn_implementation", None) == NAME
    if ours and param.device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return None
