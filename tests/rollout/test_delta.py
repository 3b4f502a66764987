"""Weight deltas (rollout/delta.py): a version sent as the positions whose bits changed and their values arrives bit
for bit (-0.0, NaN payloads, infinities), goes whole when that is smaller, and a receiver's new version built from
its previous one plus those positions is the new buffers' snapshot; and LoRA's merge (rollout/weights.py), the one
function the trainer and a generator merge an adapter with, is peft's."""

from __future__ import annotations

import contextlib

import pytest
import torch

from grpolab.rollout.delta import INDEX_BYTES, Span, apply, bits, encode, patched_weights, span_of, whole


def odd_values(dtype: torch.dtype) -> torch.Tensor:
    """0.0, -0.0, +-inf, two NaNs of different payloads, and ordinary numbers, in ``dtype``."""
    t = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.5, -2.25, 3e-3], dtype=dtype)
    t.view(bits(t).dtype)[4] = bits(t)[4] | 1  # a NaN with another payload than torch's
    return torch.cat([t, torch.tensor([float("nan")], dtype=dtype), torch.arange(200, dtype=dtype)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_delta_round_trips_bit_for_bit_with_signed_zeros_nans_and_infinities(dtype):
    prev = odd_values(dtype)
    new = prev.clone()
    new[0], new[1] = -0.0, 0.0  # equal as values, not as bits
    new.view(bits(new).dtype)[8] = bits(prev)[4]  # torch's NaN -> the other payload
    new[5] = float("inf")
    change = encode(prev, new)
    assert not change.full and change.indices.dtype == torch.int32
    assert change.indices.tolist() == [0, 1, 5, 8] and change.changed == 4 and change.size == len(new)
    assert change.nbytes == 4 * (INDEX_BYTES + new.element_size())
    got = prev.clone()
    apply(got, change)
    assert torch.equal(bits(got), bits(new))
    assert span_of("b", 100, change) == Span("b", 100, 109, change.indices)


def test_an_unchanged_stretch_is_an_empty_delta_and_a_mostly_changed_one_goes_whole():
    prev = torch.randn(1000)
    same = encode(prev, prev.clone())
    assert not same.full and same.changed == 0 and same.nbytes == 0 and same.values.numel() == 0
    got = prev.clone()
    apply(got, same)
    assert torch.equal(got, prev)
    new = prev.clone()
    new[:500] += 1  # fp32: a delta of 500 positions is 4000 bytes, the whole 4000: whole
    change = encode(prev, new)
    assert change.full and change.changed == 500 and change.nbytes == 4000 and change.values is new
    new[499] = prev[499]  # 499 * 8 < 4000: a delta
    assert not encode(prev, new).full
    bf = prev.bfloat16()  # bf16: a delta of C positions is 6 C bytes, the whole 2000
    moved = bf.clone()
    moved[:333] += 1
    assert not encode(bf, moved).full and encode(bf, torch.where(torch.arange(1000) < 334, bf + 1, bf)).full
    assert whole(new).changed == 1000 and whole(new, 3).changed == 3
    with pytest.raises(ValueError, match="a delta between"):
        encode(prev, new[:10])


def test_a_version_built_from_the_previous_one_and_the_changed_positions_is_the_new_snapshot():
    from grpolab.rollout.replica import SharedWeights
    from grpolab.rollout.weights import snapshot

    torch.manual_seed(0)
    embed = torch.randn(50, 8)
    weights = {"embed": embed, "head": embed, "a": torch.randn(40, 8), "b": torch.randn(8), "c": torch.randn(30, 4)}
    weights["h"] = torch.randn(6).bfloat16()
    slot = SharedWeights(weights, shared=False)
    slot.write(weights)
    prev = snapshot(slot.views())
    flat = slot.buffers["torch.float32"]
    before = {d: b.clone() for d, b in slot.buffers.items()}
    flat[3] = -flat[3]  # embed [0, 400) (and head, tied to it)
    flat[400 + 7] += 1  # a [400, 720), one position
    flat[728:848] = -0.0  # c [728, 848), all of it: 40 positions of the bucket at 640, 80 of the one at 768
    flat[800] = float("nan")
    spans = []
    for start in range(0, flat.numel(), 128):  # buckets of 128 positions, as weight_buckets cuts a buffer
        change = encode(before["torch.float32"][start : start + 128], flat[start : start + 128])
        if change.changed:
            spans.append(span_of("torch.float32", start, change))
    assert [s.start for s in spans] == [0, 384, 640, 768] and spans[3].indices is None  # 80 of 128: whole
    new = patched_weights(prev, slot.views(), slot.layout, spans)
    want = snapshot(slot.views())
    assert all(torch.equal(bits(new[n].reshape(-1)), bits(want[n].reshape(-1))) for n in want)
    assert new["embed"] is new["head"] and new["h"] is prev["h"]  # tied: one tensor; untouched: the same tensor
    assert new["a"] is not prev["a"] and torch.equal(prev["a"], weights["a"])  # the old version is left as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lora_is_peft_s_merge_and_a_generator_merges_what_it_was_sent_into_the_served_weights(dtype):
    from peft import LoraConfig, get_peft_model

    from grpolab.rollout.lora_merge import lora_layers, merge_lora, merged_served
    from grpolab.rollout.weights import sent_lora, served_weights

    torch.manual_seed(1)
    base = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 16)).to(dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"]))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))  # lora_B starts at zero: give the adapter a delta
    layers = lora_layers(model.get_base_model().named_modules())
    assert set(layers) == {"0.weight", "2.weight"} and layers["0.weight"].scaling == 2.0
    modules = dict(model.get_base_model().named_modules())
    served = dict(served_weights(model))
    for name in layers:
        lora = modules[name.removesuffix(".weight")]
        peft_merged = lora.base_layer.weight + lora.get_delta_weight("default").to(dtype)  # what peft merges
        assert torch.equal(bits(served[name]), bits(peft_merged))
        a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
        transposed = merge_lora(lora.base_layer.weight.T, a, b, 2.0, fan_in_fan_out=True)  # Conv1D's [in, out]
        assert torch.equal(bits(transposed.T), bits(served[name]))
    parts = dict(served_weights(model, unmerged=True))
    assert {"0.lora_A", "0.lora_B"} <= set(parts) and torch.equal(parts["0.weight"], modules["0"].base_layer.weight)
    sent = {n: t.clone() for n, t in parts.items()}
    received = merged_served(sent, layers)
    assert received.keys() == served.keys()
    assert all(torch.equal(bits(received[n]), bits(served[n])) for n in served)
    again = merged_served(dict(sent), layers, reuse=(sent, received))  # unchanged parts: the same merged tensors
    assert all(again[n] is received[n] for n in received)
    assert sent_lora(model, "merged") == ({}, "")
    model.base_model.model[0].use_dora["default"] = True  # a layer kind it cannot merge: sent merged
    layers, note = sent_lora(model, "auto")
    assert layers == {} and "DoRA" in note


@pytest.mark.parametrize("tied", [True, False])
def test_the_weights_read_only_in_products_go_in_the_products_dtype_beside_fp32_norms_and_embeddings(tied):
    """Under bf16-mixed a sampler keeps fp32 outside its products: the linear layers' weights travel in bf16 (what it
    casts them to), the norms and the embedding in fp32; a head tied to the embedding stays fp32 with it, and
    --fp32-head keeps an untied head fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.rollout.remote.versions import HeldVersions
    from grpolab.rollout.weights import product_weights

    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    linear = {f"{a}{p}_proj.weight" for p in "qkvo"} | {f"{m}{p}_proj.weight" for p in ("gate", "up", "down")}
    assert product_weights(model) == linear | (set() if tied else {"lm_head.weight"})
    assert product_weights(model, fp32_head=True) == linear
    held = HeldVersions(model, contextlib.nullcontext, torch.float32, 0, product_dtype=torch.bfloat16)
    dtypes = {n: t.dtype for n, t in held.slot.views(held.held[0]).items()}
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == product_weights(model)
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32
    served = held.named(0)
    assert all(torch.equal(served[n], model.get_parameter(n).detach().to(dtypes[n])) for n in product_weights(model))
