"""The decode loop's preallocated cache (grpolab.models.decode_cache) against transformers' growing one.

In float64 the two loops must give the same completions for the same keys (every token) and the same log-probs and
entropies to 1e-10, on the built-in Llama, random GPT-2 and Qwen2 layouts and SmolLM2; rows that stop at EOS at
different steps must give the tokens they give alone; a group's shared prompt prefill must give what each row's own
prefill gives.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import gpt2, qwen2

from grpolab.models.decode_cache import SlabCache
from grpolab.rollout.sampler import sample_with_stats

QUESTIONS = ["12+7", "45-(12+7)", "3*4", "161/7", "9"]


def _eos_boost(model, eos: int, boost: float):
    """Raise EOS's logit so that completions end at varied lengths."""

    def hook(module, inputs, logits):
        logits = logits.clone()
        logits[..., eos] += boost
        return logits

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def _plain_model(layout: str, tok):
    """The built-in warm start, or a random GPT-2 or Qwen2 layout."""
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if layout == "builtin":
        from grpolab.models.policy import load_policy

        return load_policy("builtin").model  # the shipped warm start: it ends its answers itself
    torch.manual_seed(5)
    if layout == "gpt2":
        return gpt2(len(tok), seed=3, **ids).eval()
    return qwen2(len(tok), **ids).eval()


def _model(layout: str, tok):
    """:func:`_plain_model`, EOS raised in the random ones."""
    model = _plain_model(layout, tok)
    return model if layout == "builtin" else _eos_boost(model, tok.eos_token_id, 2.5)


def _prompts(tok, questions, groups: int = 2):
    ps = [[tok.bos_token_id] + tok(q + "\n", add_special_tokens=False)["input_ids"] for q in questions]
    return [p for p in ps for _ in range(groups)]  # groups of rows sharing their prompt, prompts of varied lengths


def _both(model, prompts, keys, tok, **kw):
    args = dict(max_new_tokens=24, temperature=1.0, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    args |= kw
    return (sample_with_stats(model, prompts, keys, cache=c, **args) for c in ("slab", "dynamic"))


def _assert_same(a, b, tol: float = 1e-10) -> None:
    assert torch.equal(a.batch.completion_ids, b.batch.completion_ids)
    assert torch.equal(a.batch.completion_mask, b.batch.completion_mask)
    assert float((a.logprobs - b.logprobs).abs().max()) <= tol
    assert float((a.entropy - b.entropy).abs().max()) <= tol


@pytest.mark.parametrize("layout", ["builtin", "gpt2", "qwen2"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_slab_decode_equals_the_growing_cache_in_float64(layout, top_p, char_tokenizer):
    tok = char_tokenizer
    model = _model(layout, tok).double()
    prompts = _prompts(tok, QUESTIONS)
    keys = [(7, i) for i in range(len(prompts))]
    slab, dynamic = _both(model, prompts, keys, tok, top_p=top_p)
    _assert_same(slab, dynamic)
    lengths = slab.batch.completion_mask.sum(1)
    assert len(set(lengths.tolist())) >= 3  # rows stopped at different steps: the slab dropped rows mid-way


RULES = dict(top_k=10, min_p=0.02, repetition_penalty=1.3)  # top-k, min-p and the penalty, whose history is per row


@pytest.mark.parametrize("layout, rules", [("builtin", {}), ("qwen2", {}), ("qwen2", RULES)])
def test_rows_that_stop_early_give_what_they_give_alone(layout, rules, char_tokenizer):
    """Rows leave the slab at different steps (their slots refilled by moving other rows); each row's tokens and
    log-probs are those of the row sampled on its own (with a repetition penalty too: each row keeps its own
    history of seen tokens through the moves)."""
    tok = char_tokenizer
    model = _model(layout, tok).double()
    prompts = _prompts(tok, QUESTIONS, groups=1)
    keys = [(11, i) for i in range(len(prompts))]
    together, _ = _both(model, prompts, keys, tok, **rules)
    lengths = together.batch.completion_mask.sum(1).tolist()
    assert len(set(lengths)) >= 3
    for i in range(len(prompts)):
        alone, _ = _both(model, [prompts[i]], [keys[i]], tok, **rules)
        L = lengths[i]
        assert int(alone.batch.completion_mask.sum()) == L
        assert torch.equal(alone.batch.completion_ids[0, :L], together.batch.completion_ids[i, :L])
        assert float((alone.logprobs[0, :L] - together.logprobs[i, :L]).abs().max()) <= 1e-10


def test_shared_prompt_prefill_gives_each_rows_own_prefill(char_tokenizer):
    """A group's rows share one prefill of their prompt (its cache copied to each row's slab); each row sampled on
    its own, with its own prefill, gives the same tokens and log-probs."""
    tok = char_tokenizer
    model = _model("qwen2", tok).double()
    prompts = _prompts(tok, QUESTIONS[:2], groups=3)
    keys = [(2, i) for i in range(len(prompts))]
    shared, _ = _both(model, prompts, keys, tok)
    for i in range(len(prompts)):
        alone, _ = _both(model, [prompts[i]], [keys[i]], tok)
        L = int(alone.batch.completion_mask.sum())
        assert torch.equal(alone.batch.completion_ids[0, :L], shared.batch.completion_ids[i, :L])
        assert float((alone.logprobs[0, :L] - shared.logprobs[i, :L]).abs().max()) <= 1e-10


def test_dropping_rows_moves_only_the_last_live_rows_into_the_holes():
    """SlabCache.drop: kept slots below the new end stay, the last kept rows fill the holes, and the live
    columns of every moved row are its own."""
    N, H, L, d = 6, 2, 5, 3
    keys = torch.arange(N * H * L * d, dtype=torch.float64).view(N, H, L, d)

    class Prefill:
        layers = [type("L", (), {"keys": keys, "values": -keys})()]

    cache = SlabCache.from_prefill(Prefill(), torch.arange(N), capacity=L + 2)
    done = torch.tensor([False, True, False, True, False, False])
    order = cache.drop(done)
    assert order.tolist() == [0, 4, 2, 5]  # slots 1 and 3 finished: rows 4 and 5 move in, in order
    layer = cache.layers[0]
    assert cache.n == 4 and layer.keys.shape == (4, H, L, d)
    assert torch.equal(layer.keys, keys[order]) and torch.equal(layer.values, -keys[order])
    k, v = layer.update(torch.ones(4, H, 1, d, dtype=torch.float64), torch.zeros(4, H, 1, d, dtype=torch.float64))
    assert k.shape == (4, H, L + 1, d) and bool((k[:, :, L] == 1).all()) and bool((v[:, :, L] == 0).all())
    assert k.data_ptr() == layer.buffer_k.data_ptr()  # a view of the buffer, not a copy
    with pytest.raises(RuntimeError, match="decode cache full"):
        layer.update(torch.ones(4, H, 2, d, dtype=torch.float64), torch.ones(4, H, 2, d, dtype=torch.float64))


@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_slab_decode_equals_the_growing_cache_in_float64():
    from grpolab.models.policy import load_policy

    policy = load_policy("smollm2-135m-instruct", torch.float64)
    tok = policy.tokenizer
    records = [{"prompt": q} for q in ("What is 12+7?", "Name a colour.", "Say hi")]
    prompts = [policy.prompt_ids(r) for r in records for _ in range(2)]
    assert len({len(p) for p in prompts}) == 3  # left padding in the batch
    keys = [(3, i) for i in range(len(prompts))]
    args = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, eos_id=policy.eos_id, pad_id=policy.pad_id)
    slab, dynamic = (sample_with_stats(policy.model, prompts, keys, cache=c, **args) for c in ("slab", "dynamic"))
    assert tok.decode(slab.batch.completion_ids[0]).strip()
    _assert_same(slab, dynamic)


# ---------------------------------------------------------------- the sampler's own copy of the weights


def _llama_gqa(tok, **config):
    """A random Llama with grouped-query attention (SmolLM2's layout in small)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(9)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, **config,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _boosted_copy(model, tok, **kw):
    """The sampler's copy of ``model`` (built before EOS is raised, so that its check compares like with like), then
    EOS raised in both, so that completions end at varied lengths."""
    from grpolab.rollout.weights import SamplerWeights

    weights = SamplerWeights(model, **kw)
    assert weights.decoder is not None, weights.note
    for m in (model, weights.model):
        _eos_boost(m, tok.eos_token_id, 2.5)
    return weights


@pytest.mark.parametrize("layout, rules", [("llama-gqa", {}), ("qwen2", {}), ("builtin", {}), ("builtin", RULES)])
def test_fused_decoder_samples_what_the_models_forward_samples_in_float64(layout, rules, char_tokenizer):
    """The fused decode step (one product for query, key and value, one for gate and up) over a float64 copy gives
    the tokens and log-probs of the model's own forward: Llama with grouped heads, Qwen2 (query/key/value biases),
    the built-in Llama (and with top-k, min-p and a repetition penalty, which the loop applies to its logits)."""
    tok = char_tokenizer
    model = (_llama_gqa(tok) if layout == "llama-gqa" else _plain_model(layout, tok)).double()
    weights = _boosted_copy(model, tok, dtype=torch.float64, pack=False, always_copy=True)
    prompts = _prompts(tok, QUESTIONS)
    keys = [(4, i) for i in range(len(prompts))]
    args = dict(max_new_tokens=20, temperature=0.8, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    args |= rules
    fused = sample_with_stats(weights.model, prompts, keys, decoder=weights.decoder, **args)
    plain = sample_with_stats(model, prompts, keys, cache="dynamic", **args)
    _assert_same(fused, plain)
    assert len(set(fused.batch.completion_mask.sum(1).tolist())) >= 2  # rows left the slab mid-way


def test_the_copy_follows_the_policys_weights_at_each_sync_and_not_before(char_tokenizer):
    tok = char_tokenizer
    model = _llama_gqa(tok).double()
    weights = _boosted_copy(model, tok, dtype=torch.float64, pack=False, always_copy=True)
    prompts, keys = _prompts(tok, QUESTIONS[:2]), [(5, i) for i in range(4)]
    args = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)

    def draw(m, decoder=None):
        return sample_with_stats(m, prompts, keys, decoder=decoder, **args)

    before = draw(weights.model, weights.decoder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale = draw(weights.model, weights.decoder)
    _assert_same(stale, before)  # the copy does not move until it is synced
    weights.sync()
    _assert_same(draw(weights.model, weights.decoder), draw(model))


@pytest.mark.hardware  # packed for oneDNN where the CPU has bf16 units, F.linear where it has none
def test_a_bf16_copy_samples_close_to_the_float32_policy_and_keeps_fp32_rotary_tables(char_tokenizer):
    tok = char_tokenizer
    model = _llama_gqa(tok)
    weights = _boosted_copy(model, tok, dtype=torch.bfloat16)
    assert weights.copied
    assert next(weights.model.parameters()).dtype == torch.bfloat16
    assert weights.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32  # the policy keeps its own
    prompts, keys = _prompts(tok, QUESTIONS), [(6, i) for i in range(10)]
    args = dict(max_new_tokens=16, temperature=1.0, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    low = sample_with_stats(weights.model, prompts, keys, decoder=weights.decoder, **args)
    from grpolab.models.logprobs import completion_logprobs

    with torch.no_grad():
        exact = completion_logprobs(model, low.batch)  # the fp32 policy's log-probs of the bf16 sampler's tokens
    m = low.batch.completion_mask.bool()
    diff = (exact - low.logprobs)[m].abs()
    assert 0 < float(diff.mean()) < 0.05  # bf16 rounding: a mismatch, and a small one


def test_the_copys_prefill_computes_each_fused_product_once_and_forgets_it(char_tokenizer):
    """The prompt's prefill runs the copy's own forward, whose query/key/value and gate/up projections are slices of
    the fused products: each product runs once per layer (not once per slice), and the sampler drops the
    remembered activations once the prefill is done."""
    from grpolab.models.fused_decode import _Shared

    tok = char_tokenizer
    model = _llama_gqa(tok)
    weights = _boosted_copy(model, tok, dtype=torch.float32, pack=False, always_copy=True)
    calls = []
    for layer in weights.decoder.layers:
        for product in (layer.qkv, layer.gate_up):
            product.register_forward_hook(lambda m, i, o: calls.append(m))
    ids = torch.tensor([_prompts(tok, QUESTIONS[:1], groups=1)[0]])
    with torch.no_grad():
        weights.model(input_ids=ids)
    assert len(calls) == 2 * len(weights.decoder.layers)  # one qkv and one gate_up product per layer
    shared = [m for m in weights.model.modules() if isinstance(m, _Shared)]
    assert shared and all(m._last is not None for m in shared)
    args = dict(max_new_tokens=3, temperature=1.0, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    sample_with_stats(weights.model, [ids[0].tolist()], [(0,)], decoder=weights.decoder, **args)
    assert all(m._last is None for m in shared)
