"""A LoRA policy's adapter served unmerged by vLLM (``--lora-sync``): whether vLLM can serve it, the base weights
pushed once, and each new version of the adapter handed over after an optimizer step.

vLLM computes an adapted layer as ``W x + s B A x`` from the base weight ``W`` and the factors ``A``, ``B`` (scale
``s``), as peft's ``lora.Linear`` does in the trainer, so the engine needs the base once and then only the factors:
for SmolLM2-135M at rank 16, 19.5 MB a step instead of 651 MB of merged weights (docs/vllm.md).

Why a directory: vLLM 0.32 loads an adapter only from a path (``LoRARequest.lora_path``, holding adapter_config.json
and adapter_model.safetensors, what peft's ``save_pretrained`` writes); none of its public calls takes the tensors.
:class:`AdapterVersions` writes each version into one scratch directory (in /dev/shm where there is one: memory,
not disk), and the engine is told of it at once (``add_lora``), so vLLM has read it before the next is written.

What vLLM cannot serve unmerged (:func:`why_not_served`; ``auto`` then merges, ``adapter`` is refused): a layer that
is not a plain linear one (embeddings, convolutions, a quantized layer), the output head, DoRA and peft's other
LoRA variants, LoRA bias, parameters that train outside the factors (``modules_to_save``, trainable tokens), a rank
above vLLM's largest (512), a vision-language model, and CUDA's sleep mode (``--vllm-sleep`` frees the weights at
every generation: the base would travel at every sync anyway). An architecture vLLM has no LoRA for (GPT-2) is
vLLM's to say (:func:`grpolab.rollout.vllm_engine.architecture_reason`). On the CPU, ``auto`` merges even an adapter
vLLM can serve: its CPU LoRA layers copy the factors for every token, which costs more than the sync saves
(:data:`grpolab.rollout.vllm_engine.CPU_LORA`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from grpolab.rollout.spec import VLLMSettings
from grpolab.rollout.weights import base_model
from grpolab.vision.families import family_of

SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``); it serves any adapter of a
rank up to the one it was started with."""


@dataclasses.dataclass(frozen=True)
class AdapterShape:
    """What vLLM is started with to serve an adapter unmerged."""

    max_rank: int
    """vLLM's ``max_lora_rank``: the smallest of :data:`SERVED_RANKS` at or above the adapter's largest rank."""
    targets: tuple[str, ...]
    """The adapted layers' own names (``q_proj``, ...): vLLM's ``lora_target_modules``, so that it wraps only those
    (its LoRA logits processor, for the head, is left out: on the CPU it fails with prompt log-probs)."""

    def start_options(self) -> dict:
        """``vllm.LLM``'s keywords for it: one adapter at a time, in the engine's dtype."""
        return dict(enable_lora=True, max_lora_rank=self.max_rank, max_loras=1, lora_target_modules=list(self.targets))


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA layers of ``model`` (linear, embedding, ...) by their name in the transformers model; empty without
    an adapter."""
    if not hasattr(model, "peft_config"):
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base_model(model).named_modules() if isinstance(m, LoraLayer) and m.r}


def active_adapter(model: nn.Module) -> str | None:
    """The name of the adapter the policy trains (peft's active one), or None without LoRA."""
    if not adapted_layers(model):
        return None
    active = model.active_adapters if hasattr(model, "active_adapters") else ["default"]
    return active[0] if len(active) == 1 else None


def adapter_shape(model: nn.Module) -> AdapterShape | None:
    """The adapter's :class:`AdapterShape` (its largest rank served by the next rank vLLM takes); None without LoRA."""
    layers, name = adapted_layers(model), active_adapter(model)
    if not layers:
        return None
    rank = max((m.r[name] for m in layers.values() if name in m.r), default=0)
    max_rank = next((r for r in SERVED_RANKS if r >= rank), rank)  # above 512: why_not_served refuses it
    return AdapterShape(max_rank, tuple(sorted({n.rpartition(".")[2] for n in layers})))


def why_not_served(model: nn.Module, settings: VLLMSettings, device: torch.device) -> str | None:
    """Why vLLM cannot serve ``model``'s LoRA adapter unmerged, in a few words; None when it can.

    Args:
        model (nn.Module): the policy, a peft model with a LoRA adapter.
        settings (VLLMSettings): how the engine starts (its sleep mode).
        device (torch.device): where it runs (sleep mode is CUDA's).

    Returns:
        str | None: the first reason found (the layer or option named), or None.
    """
    name = active_adapter(model)
    if name is None:
        return f"{len(model.active_adapters)} adapters are active (vLLM serves one)"
    if family_of(model) is not None:
        return "a vision-language model (vLLM's LoRA would adapt its language model under other layer names)"
    reason = _layer_reason(model, name)
    if reason is not None:
        return reason
    extra = [n for n, p in model.named_parameters() if p.requires_grad and not _is_factor(n)]
    if extra:
        return f"parameters outside the LoRA factors train ({extra[0]}{' ...' if len(extra) > 1 else ''})"
    shape = adapter_shape(model)
    if shape.max_rank > SERVED_RANKS[-1]:
        return f"rank {shape.max_rank} is above vLLM's largest, {SERVED_RANKS[-1]}"
    if settings.sleep and device.type == "cuda":
        return "--vllm-sleep frees the engine's weights at every generation, so the base would be pushed every step"
    return None


def _is_factor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _layer_reason(model: nn.Module, adapter: str) -> str | None:
    """Why one of the adapted layers is not what vLLM computes (``W x + s B A x`` on a linear layer), or None."""
    from peft.tuners.lora.layer import Linear

    head = base_model(model).get_output_embeddings()
    for layer_name, m in adapted_layers(model).items():
        if type(m) is not Linear:
            return f"{layer_name} is a LoRA {type(m).__name__} (vLLM adapts linear layers only)"
        if m is head:
            return f"the output head ({layer_name}) is adapted"
        if adapter in getattr(m, "lora_variant", {}):
            return f"{layer_name} is a LoRA variant ({type(m.lora_variant[adapter]).__name__}: DoRA or another)"
        if m.lora_bias.get(adapter, False):
            return f"{layer_name} has a LoRA bias"
        if m.fan_in_fan_out:
            return f"{layer_name} stores its weight transposed (fan_in_fan_out)"
    return None


def base_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights under transformers' names, the adapter's factors left out: each adapted layer's own
    weight (``name.base_layer.weight`` as ``name.weight``), unmerged. A tied weight is given under each of its names,
    as :func:`grpolab.rollout.weights.served_weights` gives it (vLLM's loader needs ``lm_head.weight``)."""
    for name, tensor in base_model(model).named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            yield name.replace(".base_layer.", "."), tensor.detach()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors`` in their own dtypes (a tensor given twice counts twice)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def scratch_root() -> str:
    """Where adapter versions are written: /dev/shm (memory) where there is one, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class AdapterVersions:
    """The policy's adapter as a peft adapter directory, rewritten at each :meth:`write`: adapter_config.json (what
    vLLM reads of it: rank, alpha, rsLoRA, per-layer patterns, the layers) and adapter_model.safetensors (the factors,
    under peft's names, in the trainer's dtype). The directory is removed with this object."""

    def __init__(self, model: nn.Module):
        self.adapter = active_adapter(model)
        self.path = tempfile.mkdtemp(prefix="grpolab-lora-", dir=scratch_root())
        weakref.finalize(self, shutil.rmtree, self.path, True)
        cfg = model.peft_config[self.adapter]
        config = {
            "peft_type": "LORA", "r": cfg.r, "lora_alpha": cfg.lora_alpha, "use_rslora": cfg.use_rslora,
            "rank_pattern": dict(cfg.rank_pattern or {}), "alpha_pattern": dict(cfg.alpha_pattern or {}),
            "target_modules": list(adapter_shape(model).targets), "bias": "none",
        }  # fmt: skip
        with open(os.path.join(self.path, "adapter_config.json"), "w") as f:
            json.dump(config, f)

    def write(self, model: nn.Module) -> int:
        """Write the adapter's current factors; returns their bytes."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        factors = get_peft_model_state_dict(model, adapter_name=self.adapter)
        tensors = {k: t.detach().contiguous() for k, t in factors.items()}
        save_file(tensors, os.path.join(self.path, "adapter_model.safetensors"))
        return tensor_bytes(tensors.values())
