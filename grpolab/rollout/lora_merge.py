"""LoRA's merge: the one function a LoRA-adapted layer's served weight is computed with, by the trainer
(:func:`grpolab.rollout.weights.served_weights`) and by a generator process or worker that was sent the base weights
and the adapter's factors apart (``--lora-sync adapter``: the base travels once, then the factors alone), so that
both hold the same weights bit for bit; and which layers can travel so.

Written here rather than called from peft: peft merges a layer in place, on the module (``merge()``); a generator
holds tensors, not peft's modules, and the trainer must not touch its training weights. :func:`merge_lora` is peft
0.21's ``lora.Linear.get_delta_weight`` step for step (a test holds the two equal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn


def merge_lora(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool = False
) -> torch.Tensor:
    """``weight + B @ A * scaling`` as a new tensor: the served weight of a LoRA-adapted linear layer, the one
    function the trainer (:func:`grpolab.rollout.weights.served_weights`) and a generator that merges what it was
    sent (:func:`merged_served`) both compute it with, so that the two agree bit for bit on the same kind of device.

    The delta is peft 0.21's ``lora.Linear.get_delta_weight``, in its order of operations: on a CPU, factors in
    bf16 or fp16 are multiplied in fp32 and the delta rounded back to their dtype; ``(B @ A)``, transposed under
    ``fan_in_fan_out``, times ``scaling``; then cast to the weight's dtype and added to a copy of it.

    Args:
        weight (torch.Tensor): the base layer's weight, ``[out, in]`` (``[in, out]`` under ``fan_in_fan_out``).
        a (torch.Tensor): lora_A's weight, ``[r, in]``.
        b (torch.Tensor): lora_B's weight, ``[out, r]``.
        scaling (float): peft's ``scaling[adapter]`` (``lora_alpha / r``).
        fan_in_fan_out (bool): the layer stores its weight transposed (GPT-2's Conv1D).

    Returns:
        torch.Tensor: the merged weight, ``weight``'s shape and dtype.
    """
    dtype = b.dtype
    cast = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        a, b = a.float(), b.float()
    delta = b @ a  # [out, r] @ [r, in]
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    if cast:
        delta = delta.to(dtype)
    merged = weight.detach().clone()
    merged += delta.to(merged.dtype)
    return merged


def unplain(lora, adapter: str) -> str | None:
    """Why ``lora``'s ``adapter`` is not a plain LoRA linear layer :func:`merge_lora` merges (None when it is)."""
    from peft.tuners.lora.layer import Linear

    if type(lora) is not Linear or not isinstance(lora.lora_A[adapter], nn.Linear):
        return f"{type(lora).__name__} layers"
    if lora.use_dora.get(adapter) or adapter in getattr(lora, "lora_variant", {}):
        return "DoRA or another LoRA variant"
    if getattr(lora, "lora_bias", {}).get(adapter):
        return "LoRA biases"
    return None


@dataclasses.dataclass(frozen=True)
class LoraFactors:
    """An adapted layer as it travels unmerged (``--lora-sync adapter``): the names of its factors among the sent
    weights (lora_A ``[r, in]``, lora_B ``[out, r]``, in the trainer's dtypes), peft's ``scaling`` and
    ``fan_in_fan_out``, and the dtype its merged weight is served in."""

    a: str
    b: str
    scaling: float
    fan_in_fan_out: bool
    dtype: torch.dtype


def lora_layers(
    modules: Iterable[tuple[str, nn.Module]], dtype: torch.dtype | None = None
) -> dict[str, LoraFactors] | str:
    """The adapted layers among a peft LoRA policy's transformers ``modules`` (``named_modules()`` of the model under
    the peft wrapper) as they travel unmerged, by the served weight's name (``{}`` without LoRA), their merged
    weights served in ``dtype`` (None: the base weight's); or why they cannot travel so (layers other than plain
    LoRA linear ones, several active adapters): they are then sent merged."""
    out = {}
    for name, module in modules:
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        embedding = getattr(module, "lora_embedding_A", {})
        adapters = [a for a in module.active_adapters if a in module.lora_A or a in embedding]
        if len(adapters) != 1:
            return f"{len(adapters)} active adapters on {name}"
        why = unplain(module, adapters[0])
        if why is not None:
            return f"{why} ({name})"
        scaling, served = module.scaling[adapters[0]], dtype or module.base_layer.weight.dtype
        out[f"{name}.weight"] = LoraFactors(f"{name}.lora_A", f"{name}.lora_B", scaling, module.fan_in_fan_out, served)
    return out


def merged_served(
    parts: dict[str, torch.Tensor],
    layers: dict[str, LoraFactors],
    device: str = "cpu",
    merged: bool = False,
    reuse: tuple[dict, dict] | None = None,
) -> dict[str, torch.Tensor]:
    """The served weights from their parts as they were sent (``served_weights(..., unmerged=True)``): each
    adapted layer's weight merged with its factors by :func:`merge_lora` on ``device`` and cast to its served dtype;
    the factors left out. ``merged``: the parts' weights are merged already (the factors are only left out).
    ``reuse`` (parts, served) of the version before: a layer whose parts are the same tensors keeps its merged
    weight."""
    factors = {n for f in layers.values() for n in (f.a, f.b)}
    out = {}
    for name, t in parts.items():
        f = None if merged else layers.get(name)
        if name in factors:
            continue
        if f is None:
            out[name] = t
        elif reuse is not None and all(parts[n] is reuse[0].get(n) for n in (name, f.a, f.b)):
            out[name] = reuse[1][name]
        else:
            merge = merge_lora(t.to(device), parts[f.a].to(device), parts[f.b].to(device), f.scaling, f.fan_in_fan_out)
            out[name] = merge.to("cpu", f.dtype)
    return out
