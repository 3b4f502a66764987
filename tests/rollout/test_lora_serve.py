"""grpolab/rollout/lora_serve.py: which LoRA adapters vLLM serves unmerged and what it is started with, the base
weights pushed once (unmerged), the adapter directory a version is written to; and the vllm engine's choice under
--lora-sync auto / adapter / merged, made before vLLM is imported. The engine serving it is tests/e2e/test_vllm_engine.py's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.models import qwen2
from safetensors.torch import load_file

from grpolab.common.errors import ConfigError
from grpolab.rollout.lora_serve import (
    AdapterShape,
    AdapterVersions,
    adapter_shape,
    base_weights,
    tensor_bytes,
    why_not_served,
)
from grpolab.rollout.spec import EngineSpec, VLLMSettings
from grpolab.rollout.vllm_engine import CPU_LORA, lora_serving

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _lora(rank: int = 4, targets="all-linear", nonzero: bool = True, **options):
    """A random Qwen2 layout (2 layers of width 32) with a peft LoRA adapter; ``nonzero``: B drawn, not zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(qwen2(64), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, **options))
    if nonzero:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def test_the_shape_vllm_starts_with_is_the_next_rank_it_takes_and_the_adapted_layers():
    shape = adapter_shape(_lora(rank=4))
    assert shape == AdapterShape(8, ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"))
    assert shape.start_options() == dict(
        enable_lora=True, max_lora_rank=8, max_loras=1, lora_target_modules=list(shape.targets)
    )
    assert adapter_shape(_lora(rank=16, targets=["q_proj", "v_proj"])) == AdapterShape(16, ("q_proj", "v_proj"))
    assert adapter_shape(_lora(rank=20)).max_rank == 32
    assert adapter_shape(qwen2(64)) is None  # no LoRA


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # peft: the layer has no bias of its own
def test_a_plain_lora_adapter_is_served_and_each_kind_vllm_cannot_serve_says_why():
    assert why_not_served(_lora(), VLLMSettings(), CPU) is None
    assert why_not_served(_lora(), VLLMSettings(sleep=True), CPU) is None  # sleep mode is CUDA's
    reasons = {
        "dora": why_not_served(_lora(use_dora=True), VLLMSettings(), CPU),
        "bias": why_not_served(_lora(lora_bias=True), VLLMSettings(), CPU),
        "saved": why_not_served(_lora(modules_to_save=["lm_head"]), VLLMSettings(), CPU),
        "embedding": why_not_served(_lora(targets=["embed_tokens", "q_proj"]), VLLMSettings(), CPU),
        "head": why_not_served(_lora(targets=["lm_head", "q_proj"]), VLLMSettings(), CPU),
        "rank": why_not_served(_lora(rank=600, targets=["q_proj"]), VLLMSettings(), CPU),
        "sleep": why_not_served(_lora(), VLLMSettings(sleep=True), CUDA),
    }
    assert "LoRA variant" in reasons["dora"] and "DoraLinearVariant" in reasons["dora"]
    assert "LoRA bias" in reasons["bias"]
    assert "parameters outside the LoRA factors train" in reasons["saved"] and "lm_head" in reasons["saved"]
    assert "Embedding" in reasons["embedding"]
    assert "output head (lm_head)" in reasons["head"]
    assert "rank 600 is above vLLM's largest, 512" == reasons["rank"]
    assert "--vllm-sleep" in reasons["sleep"]
    assert all("\n" not in r for r in reasons.values())


def test_the_base_weights_are_the_layers_own_under_transformers_names_not_merged():
    """Every weight of the plain model under its name (the tied head's too), each adapted layer's base weight as it
    is, though B is not zero (merged, it would differ)."""
    model = _lora()
    base = dict(base_weights(model))
    plain = dict(model.get_base_model().named_parameters(remove_duplicate=False))
    assert sorted(base) == sorted(n.replace(".base_layer.", ".") for n in plain if ".lora_" not in n)
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight)
    assert not torch.equal(q.base_layer.weight + q.get_delta_weight("default"), q.base_layer.weight)
    assert tensor_bytes(base.values()) == sum(t.numel() * 4 for t in base.values())


def test_a_version_is_written_as_a_peft_adapter_directory_vllm_reads(tmp_path):
    model = _lora(rank=4, targets=["q_proj", "v_proj"])
    versions = AdapterVersions(model)
    sent = versions.write(model)
    tensors = load_file(os.path.join(versions.path, "adapter_model.safetensors"))
    config = json.loads(open(os.path.join(versions.path, "adapter_config.json")).read())
    assert config == dict(peft_type="LORA", r=4, lora_alpha=8, use_rslora=False, rank_pattern={}, alpha_pattern={},
                          target_modules=["q_proj", "v_proj"], bias="none")  # fmt: skip
    a = model.get_base_model().model.layers[1].self_attn.v_proj.lora_A["default"].weight
    assert torch.equal(tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"], a)
    assert len(tensors) == 2 * 2 * 2 and sent == tensor_bytes(tensors.values())  # 2 layers x 2 projections x A, B
    with torch.no_grad():
        a.add_(1.0)
    versions.write(model)  # the next version in its place
    assert torch.equal(load_file(os.path.join(versions.path, "adapter_model.safetensors"))[
        "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"], a)  # fmt: skip
    path = versions.path
    del versions
    assert not os.path.exists(path)  # removed with its object


def test_lora_sync_adapter_where_vllm_cannot_serve_is_a_one_line_config_error_and_auto_says_why_it_merges():
    said = []
    spec = EngineSpec(eos_id=0, pad_id=0, vllm=VLLMSettings(), lora_sync="adapter")
    with pytest.raises(
        ConfigError, match=r"^--lora-sync: adapter: vLLM cannot serve this LoRA adapter unmerged: "
    ) as e:
        lora_serving(_lora(use_dora=True), spec, CPU, said.append)
    assert "\n" not in str(e.value) and "DoRA" in str(e.value)
    auto = EngineSpec(eos_id=0, pad_id=0, vllm=VLLMSettings(), lora_sync="auto")
    assert lora_serving(_lora(use_dora=True), auto, CPU, said.append) is None
    assert len(said) == 1 and said[0].startswith("--lora-sync auto: the LoRA adapter is merged") and "DoRA" in said[0]
    merged = EngineSpec(eos_id=0, pad_id=0, vllm=VLLMSettings(), lora_sync="merged")
    assert lora_serving(_lora(), merged, CPU, said.append) is None and len(said) == 1  # merged: asked for, nothing said
    assert lora_serving(qwen2(64), spec, CPU, said.append) is None  # no LoRA: every weight, whatever it says
    # auto on the CPU: vLLM could serve it, but slower than it syncs (CPU_LORA); adapter asked for serves it there
    assert lora_serving(_lora(), auto, CPU, said.append) is None and said[-1].endswith(CPU_LORA) and len(said) == 2
