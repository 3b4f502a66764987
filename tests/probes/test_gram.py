"""Tests of grpolab.probes.gram: the per-rollout score Gram matrix Psi_ij = <psi_i, psi_j>.

The one-backward ``score_gram`` (ghost / materialised per-layer contractions, hooks) is
checked against ``score_gram_reference`` (R backward passes) and against a third path
written here: each rollout run alone, unpadded, its log-probabilities computed by hand.
Models: tiny random Llamas with tied and untied embeddings (with biases), a tiny GPT-2
(Conv1D layers) and a tiny Qwen3 (per-head q/k RMSNorm). Every comparison uses
``gram_relative_error`` (each entry's error over sqrt(Ref_ii Ref_jj)) <= 1e-5, on the whole
model and parameter by parameter, so that a wrong rule for a small parameter is not
diluted by the large ones.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers.models import gpt2, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import grpolab.probes.gram as gram
from grpolab.common.batch import Batch, left_pad
from grpolab.probes.gram import gram_relative_error, score_gram, score_gram_reference, token_weights

TOL = 1e-5
PAD, BOS, EOS = 0, 1, 2


# ---------------------------------------------------------------- models and batches


def _tied_llama(tok, seed=0):
    return tiny_llama(tok, seed, num_layers=2, max_positions=64)


def _untied_llama(seed=1, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, bias=True, vocab=100):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=bias,
        mlp_bias=bias,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    return LlamaForCausalLM(cfg).eval()


def _gpt2(seed=2):
    return gpt2(50, seed=seed, n_layer=1, n_positions=64, bos_token_id=BOS, eos_token_id=EOS).eval()


def _qwen3(seed=3):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    return Qwen3ForCausalLM(cfg).eval()


def _batch(prompt_lens, completion_lens, vocab=100, seed=0, eos_rows=()) -> Batch:
    """R rollouts: BOS + random prompt tokens (left-padded), random completions (right-padded),
    rows in ``eos_rows`` ending with EOS. Token ids avoid PAD/BOS/EOS elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [[BOS] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in prompt_lens]
    prompt_ids, prompt_mask = left_pad(prompts, PAD)  # [R, P]
    R, T = len(completion_lens), max(completion_lens)
    completion_ids = torch.full((R, T), PAD, dtype=torch.long)
    completion_mask = torch.zeros((R, T), dtype=torch.long)
    for i, n in enumerate(completion_lens):
        completion_ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        if i in eos_rows:
            completion_ids[i, n - 1] = EOS
        completion_mask[i, :n] = 1
    return Batch(prompt_ids, prompt_mask, completion_ids, completion_mask)


@pytest.fixture(scope="module")
def tied(char_tokenizer):
    return _tied_llama(char_tokenizer)


@pytest.fixture(scope="module")
def untied():
    return _untied_llama()


@pytest.fixture(scope="module")
def batch4():
    # 4 rollouts, prompts of 3..7 tokens (left padding), completions of 1..6 tokens (right padding)
    return _batch([3, 7, 5, 4], [4, 1, 6, 3], eos_rows=(0, 2))


def _weights(batch):
    return token_weights(batch.completion_mask, "seq-mean-token-mean")


def _err(model, batch, weights, **kw):
    psi = score_gram(model, batch, weights, **kw)
    ref = score_gram_reference(model, batch, weights, **kw)
    return gram_relative_error(psi, ref), psi, ref


def _per_parameter_errors(model, batch, weights, names=None) -> dict[str, float]:
    names = names or [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: _err(model, batch, weights, include="^" + re.escape(n) + "$")[0] for n in names}


def _assert_varied_padding(batch):
    assert len(set(batch.prompt_mask.sum(1).tolist())) > 1 and (batch.prompt_mask == 0).any()  # left padding
    assert len(set(batch.completion_mask.sum(1).tolist())) > 1 and (batch.completion_mask == 0).any()


# ---------------------------------------------------------------- (a) tied embeddings


def test_tied_llama_matches_reference(tied, batch4):
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    _assert_varied_padding(batch4)
    err, psi, ref = _err(tied, batch4, _weights(batch4))
    assert psi.shape == (4, 4) and psi.dtype == torch.float64
    assert (ref.diagonal() > 0).all()
    assert err <= TOL, err


def test_tied_llama_matches_reference_parameter_by_parameter(tied, batch4):
    # the shared embedding needs both uses summed before contracting (cross terms included)
    errs = _per_parameter_errors(tied, batch4, _weights(batch4))
    assert (
        "model.embed_tokens.weight" in errs and len(errs) == 2 * 9 + 2
    )  # 9 tensors per layer + embedding + final norm
    bad = {n: e for n, e in errs.items() if e > TOL}
    assert not bad, bad


def test_tied_embedding_psi_includes_cross_terms(tied, batch4):
    # An untied copy separates the two uses of the shared matrix: g = g_in (embedding) + g_out (LM head).
    # The tied Psi must be <g_in,i + g_out,i, g_in,j + g_out,j>; contracting each use on its own
    # (no cross terms) is far from it, so the tolerance tells the two apart.
    import copy

    w = _weights(batch4)
    untied_copy = copy.deepcopy(tied)
    untied_copy.lm_head.weight = torch.nn.Parameter(tied.lm_head.weight.detach().clone())
    assert untied_copy.lm_head.weight is not untied_copy.model.embed_tokens.weight
    g_in, g_out = [], []
    for i in range(4):
        sub = batch4.rows(i, i + 1)
        logp = gram._weighted_score_sum(untied_copy, sub, w[i : i + 1], 1.0)
        a, b = torch.autograd.grad(logp, [untied_copy.model.embed_tokens.weight, untied_copy.lm_head.weight])
        g_in.append(a.reshape(-1).double())
        g_out.append(b.reshape(-1).double())
    G_in, G_out = torch.stack(g_in), torch.stack(g_out)  # [R, V d] each
    with_cross = (G_in + G_out) @ (G_in + G_out).T
    without_cross = G_in @ G_in.T + G_out @ G_out.T
    psi = score_gram(tied, batch4, w, include=r"^model\.embed_tokens\.weight$")
    assert gram_relative_error(psi, with_cross) <= TOL
    assert gram_relative_error(without_cross, with_cross) > 100 * TOL


# ---------------------------------------------------------------- (b) untied embeddings, biases


def test_untied_llama_with_biases_matches_reference(untied, batch4):
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert (
        untied.model.layers[0].self_attn.q_proj.bias is not None and untied.model.layers[0].mlp.up_proj.bias is not None
    )
    err, _, _ = _err(untied, batch4, _weights(batch4))
    assert err <= TOL, err


@pytest.mark.slow
def test_untied_llama_matches_reference_parameter_by_parameter(untied, batch4):
    errs = _per_parameter_errors(untied, batch4, _weights(batch4))
    assert "lm_head.weight" in errs and "model.layers.1.self_attn.k_proj.bias" in errs
    bad = {n: e for n, e in errs.items() if e > TOL}
    assert not bad, bad


def test_pad_id_inside_a_sequence(untied):
    # Models whose pad token is also a real token (pad_token_id = EOS, as in many chat models) feed the
    # pad id at attended positions. nn.Embedding(padding_idx=PAD) gives that row no gradient from the
    # input side; the LM head still does.
    assert untied.model.embed_tokens.padding_idx == PAD
    b = _batch([3, 5, 4], [6, 4, 5], seed=12)
    ids = b.completion_ids.clone()
    ids[0, 2], ids[1, 0], ids[2, 3] = PAD, PAD, PAD  # masked-in pad tokens, attended by later positions
    b = b._replace(completion_ids=ids)
    prompt_ids = b.prompt_ids.clone()
    prompt_ids[1, -2] = PAD  # and one inside a prompt, with its mask 1
    b = b._replace(prompt_ids=prompt_ids)
    assert b.prompt_mask[1, -2] == 1 and b.completion_mask[0, 2] == 1
    w = _weights(b)
    errs = _per_parameter_errors(untied, b, w, ["model.embed_tokens.weight", "lm_head.weight"])
    assert max(errs.values()) <= TOL, errs
    assert _err(untied, b, w)[0] <= TOL


# ---------------------------------------------------------------- a third path: unpadded, by hand


def _independent_psi(model, batch, weights, temperature=1.0):
    """Psi from each rollout alone: no padding, default positions, log-softmax written here."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(batch.prompt_ids.shape[0]):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        L = int(batch.completion_mask[i].sum())
        completion = batch.completion_ids[i, :L]
        ids = torch.cat([prompt, completion])[None]  # [1, P_i + L]
        logits = model(input_ids=ids).logits[0].float() / temperature  # [P_i + L, V]
        P = prompt.shape[0]
        logp = torch.log_softmax(logits[P - 1 : P - 1 + L], dim=-1).gather(1, completion[:, None]).squeeze(1)  # [L]
        score = (logp * weights[i, :L].float()).sum()
        grads = torch.autograd.grad(score, params)
        rows.append(torch.cat([g.reshape(-1).double() for g in grads]))
    G = torch.stack(rows)  # [R, D]
    return G @ G.T


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_psi_equals_unpadded_per_rollout_gradients(which, tied, untied, batch4):
    model = tied if which == "tied" else untied
    w = _weights(batch4)
    psi = score_gram(model, batch4, w)
    indep = _independent_psi(model, batch4, w)
    # (g) the diagonal is each rollout's squared gradient norm
    torch.testing.assert_close(psi.diagonal(), indep.diagonal(), rtol=TOL, atol=0)
    assert gram_relative_error(psi, indep) <= TOL


def test_psi_is_symmetric_psd(tied, untied, batch4):
    for model in (tied, untied):
        psi = score_gram(model, batch4, _weights(batch4))
        scale = float(psi.diagonal().max())
        assert (psi - psi.T).abs().max() <= 1e-7 * scale
        eig = torch.linalg.eigvalsh(0.5 * (psi + psi.T))
        assert eig.min() >= -1e-7 * scale, eig
        # Cauchy-Schwarz, entry by entry
        d = psi.diagonal().sqrt()
        assert (psi.abs() <= d[:, None] * d[None, :] * (1 + 1e-6)).all()


# ---------------------------------------------------------------- temperature


def test_temperature_matches_reference_and_matters(tied, batch4):
    w = _weights(batch4)
    err, psi07, _ = _err(tied, batch4, w, temperature=0.7)
    assert err <= TOL, err
    indep = _independent_psi(tied, batch4, w, temperature=0.7)
    assert gram_relative_error(psi07, indep) <= TOL
    assert gram_relative_error(psi07, score_gram(tied, batch4, w)) > 1e-2  # the temperature is applied


# ---------------------------------------------------------------- (c) GPT-2: Conv1D layers


def test_gpt2_uncovered_conv1d_raises_clearly_and_leaves_the_model_clean():
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    b = _batch([3, 6, 4], [5, 2, 3], vocab=50, seed=5)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError) as info:
        score_gram(model, b, _weights(b))
    msg = str(info.value)
    assert "c_attn" in msg and "include=" in msg and "score_gram_reference" in msg
    # the failed call restored everything
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())


def test_gpt2_covered_parameters_match_reference():
    model = _gpt2()
    b = _batch([3, 6, 4], [5, 2, 3], vocab=50, seed=5)
    w = _weights(b)
    # LayerNorm gains and biases, token embeddings (tied with the nn.Linear lm_head), position embeddings
    err, _, _ = _err(model, b, w, include=r"ln_|wte|wpe")
    assert err <= TOL, err
    names = [n for n, _ in model.named_parameters() if re.search(r"ln_|wte|wpe", n)]
    assert len(names) == 2 * 3 + 2  # ln_1, ln_2, ln_f (weight, bias), wte, wpe
    bad = {n: e for n, e in _per_parameter_errors(model, b, w, names).items() if e > TOL}
    assert not bad, bad


# ---------------------------------------------------------------- per-head RMSNorm (Qwen3 q_norm / k_norm)


def test_qwen3_matches_reference_parameter_by_parameter():
    # Qwen3 normalises each attention head: q_norm / k_norm see a 4-D input [R, L, heads, head_dim]
    # and their gain's gradient sums over tokens *and* heads.
    model = _qwen3()
    b = _batch([3, 6, 4], [5, 2, 3], seed=6)
    w = _weights(b)
    errs = _per_parameter_errors(model, b, w)
    assert "model.layers.0.self_attn.q_norm.weight" in errs
    bad = {n: e for n, e in errs.items() if e > TOL}
    assert not bad, bad


# ---------------------------------------------------------------- (d) include= subsets


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_include_subset_matches_reference_and_adds_up(which, tied, untied, batch4):
    model = tied if which == "tied" else untied
    w = _weights(batch4)
    err, sub, _ = _err(model, batch4, w, include=r"layers\.0\.")
    assert err <= TOL, err
    rest = score_gram(model, batch4, w, include=r"^(?!.*layers\.0\.)")  # every other parameter
    full = score_gram(model, batch4, w)
    # Psi is a sum over parameters: the two disjoint subsets add up to the whole
    assert gram_relative_error(sub + rest, full) <= TOL
    assert (sub.diagonal() < full.diagonal()).all() and (sub.diagonal() > 0).all()


def test_include_matching_nothing_raises(tied, batch4):
    with pytest.raises(ValueError, match="no trainable parameter"):
        score_gram(tied, batch4, _weights(batch4), include="no_such_parameter")


# ---------------------------------------------------------------- (e) ghost and materialised paths


def _spy(monkeypatch):
    """Record which weights took the ghost contraction (add_gram) and which were materialised per rollout."""
    seen = {"ghost": set(), "per_rollout": set()}
    orig_gram, orig_rows = gram._GramAccumulator.add_gram, gram._GramAccumulator._add_rows

    def add_gram(self, param, g):
        seen["ghost"].add(self.chosen[id(param)])
        return orig_gram(self, param, g)

    def add_per_rollout(self, param, g):
        seen["per_rollout"].add(self.chosen[id(param)])
        return orig_rows(self, param, g)

    monkeypatch.setattr(gram._GramAccumulator, "add_gram", add_gram)
    monkeypatch.setattr(gram._GramAccumulator, "_add_rows", add_per_rollout)
    return seen


@pytest.fixture(scope="module")
def wide():
    # hidden 64, intermediate 256, vocab 100: attention 64x64, MLP 64x256 / 256x64, lm_head 100x64
    return _untied_llama(seed=4, hidden=64, inter=256, layers=1, heads=4, kv_heads=4, bias=False)


def _expected_ghost(model, batch) -> set[str]:
    """The weights whose ghost contraction costs fewer multiply-adds than forming the R per-rollout
    gradients, with N = R L rows (L is P + T, and T + 1 for the LM head: logits_to_keep):
    Linear (q x p): N^2 (p + q) < N p q + R q p; Embedding (V x d, one-hot rows): N^2 (d + 1) < N d + R V d."""
    R, P = batch.prompt_ids.shape
    T = batch.completion_ids.shape[1]
    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            q, p = mod.weight.shape
            N = R * (T + 1 if name == "lm_head" else P + T)
            if N * N * (p + q) < N * p * q + R * q * p:
                out.add(name + ".weight")
        elif isinstance(mod, torch.nn.Embedding):
            V, d = mod.weight.shape
            N = R * (P + T)
            if N * N * (d + 1) < N * d + R * V * d:
                out.add(name + ".weight")
    return out


def test_ghost_and_materialised_paths_mixed_in_one_pass(wide, monkeypatch):
    # R = 2, P = 8, T = 12: R L = 40. Attention 64x64: 40 * 128 = 5120 >= 4096, materialised;
    # MLP: 40 * 320 = 12800 < 16384, ghost; lm_head: 2 * 13 * 164 = 4264 < 6400, ghost.
    b = _batch([8, 5], [12, 7], seed=7, eos_rows=(1,))
    assert b.prompt_ids.shape == (2, 8) and b.completion_ids.shape == (2, 12)
    seen = _spy(monkeypatch)
    err, _, _ = _err(wide, b, _weights(b))
    assert err <= TOL, err
    expected = _expected_ghost(wide, b)
    assert expected == {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",
    }
    assert seen["ghost"] == expected
    assert "model.layers.0.self_attn.q_proj.weight" in seen["per_rollout"]
    bad = {n: e for n, e in _per_parameter_errors(wide, b, _weights(b)).items() if e > TOL}
    assert not bad, bad


def test_all_ghost_with_tiny_r_t(wide, monkeypatch):
    # R = 2, P = 4, T = 3: R L = 14, every Linear is ghost (14 * 128 < 4096, 14 * 320 < 16384, 2 * 4 * 164 < 6400),
    # and the embedding too (14^2 * 65 = 12740 < 14 * 64 + 2 * 100 * 64 = 13696)
    b = _batch([4, 2], [3, 1], seed=8)
    seen = _spy(monkeypatch)
    err, _, _ = _err(wide, b, _weights(b))
    assert err <= TOL, err
    linear = {n + ".weight" for n, m in wide.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert seen["ghost"] == linear == _expected_ghost(wide, b)


def test_all_materialised_with_large_r_t(wide, monkeypatch):
    # R = 6, P = 8, T = 12: R L = 120, no Linear is ghost (6 * 13 * 164 = 12792 >= 6400 for lm_head)
    b = _batch([8, 3, 5, 6, 2, 7], [12, 3, 9, 1, 6, 10], seed=9, eos_rows=(1, 3))
    seen = _spy(monkeypatch)
    err, _, _ = _err(wide, b, _weights(b))
    assert err <= TOL, err
    assert seen["ghost"] == set() == _expected_ghost(wide, b)
    assert "lm_head.weight" in seen["per_rollout"]


# ---------------------------------------------------------------- (f) token weights


def test_token_weights_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    third = 1 / 3
    expected_mean = torch.tensor([[third, third, third, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(token_weights(mask, "seq-mean-token-mean"), expected_mean, rtol=0, atol=1e-15)
    torch.testing.assert_close(token_weights(mask), expected_mean, rtol=0, atol=1e-15)  # the default
    for agg in ("token-mean", "sum"):
        torch.testing.assert_close(token_weights(mask, agg), mask.double(), rtol=0, atol=0)
    torch.testing.assert_close(
        token_weights(mask, "seq-mean-token-sum-norm", max_len=8), mask.double() / 8, rtol=0, atol=0
    )
    torch.testing.assert_close(token_weights(mask, "seq-mean-token-sum-norm"), mask.double() / 4, rtol=0, atol=0)
    assert not token_weights(mask).isnan().any()
    with pytest.raises(ValueError, match="unknown aggregation"):
        token_weights(mask, "mean")


def test_length_normalised_psi_is_rescaled_token_psi(tied, batch4):
    # psi_i is linear in rollout i's weights: with w_i = mask_i / L_i, Psi_ij = Psi^tok_ij / (L_i L_j)
    lengths = batch4.completion_mask.sum(1).double()  # [R] = (4, 1, 6, 3)
    psi_mean = score_gram(tied, batch4, token_weights(batch4.completion_mask, "seq-mean-token-mean"))
    psi_tok = score_gram(tied, batch4, token_weights(batch4.completion_mask, "token-mean"))
    assert gram_relative_error(psi_mean, psi_tok / (lengths[:, None] * lengths[None, :])) <= TOL
    err, _, _ = _err(tied, batch4, token_weights(batch4.completion_mask, "token-mean"))
    assert err <= TOL


# ---------------------------------------------------------------- (h) no side effects


def test_no_grad_left_and_requires_grad_restored(char_tokenizer, batch4):
    model = _tied_llama(char_tokenizer, seed=11)
    model.model.layers[1].mlp.requires_grad_(False)  # a frozen block: excluded, and still frozen after
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    w = _weights(batch4)
    psi = score_gram(model, batch4, w)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert not flags["model.layers.1.mlp.up_proj.weight"] and flags["model.layers.0.mlp.up_proj.weight"]
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())
    # only trainable parameters count: the same as the reference over trainable parameters,
    # and the sum of the trainable subsets
    ref = score_gram_reference(model, batch4, w)
    assert gram_relative_error(psi, ref) <= TOL
    model.model.layers[1].mlp.requires_grad_(True)
    full = score_gram(model, batch4, w)
    mlp1 = score_gram(model, batch4, w, include=r"layers\.1\.mlp\.")
    assert gram_relative_error(psi + mlp1, full) <= TOL
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- sketch (statistical)


def test_count_sketch_is_unbiased_within_its_error(tied, batch4):
    # One sketch entry has std <= sqrt(2/k) on the cosine scale; the mean of 16 independent
    # sketches, sqrt(2/k/16). k = 4096: 0.022 and 0.0055.
    w = _weights(batch4)
    exact = score_gram(tied, batch4, w)
    k, n = 4096, 16
    sketches = [score_gram(tied, batch4, w, sketch_dim=k, sketch_seed=s) for s in range(n)]
    assert torch.equal(sketches[0], score_gram(tied, batch4, w, sketch_dim=k, sketch_seed=0))  # seeded
    assert not torch.equal(sketches[0], sketches[1])
    assert all(gram_relative_error(s, exact) <= 6 * math.sqrt(2 / k) for s in sketches)
    mean = torch.stack(sketches).mean(0)
    assert gram_relative_error(mean, exact) <= 5 * math.sqrt(2 / k / n)


# ---------------------------------------------------------------- gram_relative_error


def test_gram_relative_error_by_hand():
    ref = torch.tensor([[4.0, 1.0], [1.0, 9.0]], dtype=torch.float64)
    assert gram_relative_error(ref.clone(), ref) == 0.0
    # off-diagonal error 0.6 on the scale sqrt(4 * 9) = 6: 0.1; diagonal error 0.2 on the scale 4: 0.05
    psi = ref + torch.tensor([[0.2, 0.6], [0.6, 0.0]], dtype=torch.float64)
    assert gram_relative_error(psi, ref) == pytest.approx(0.1, rel=1e-12)
    # a zero score (all-masked rollout) divides by a tiny floor, not by zero
    ref0 = torch.zeros(2, 2, dtype=torch.float64)
    assert gram_relative_error(ref0, ref0) == 0.0


def test_count_sketch_hashes_are_kept_and_equal_a_fresh_draw(monkeypatch):
    from grpolab.probes import gram

    g = torch.randn(3, 1000, dtype=torch.float64)
    monkeypatch.setattr(gram, "_sketch_hashes", {})
    first = gram.count_sketch(g, "layer.weight", 64, seed=2)
    assert list(gram._sketch_hashes) == [("layer.weight", 1000, 64, 2)]
    assert torch.equal(gram.count_sketch(g, "layer.weight", 64, seed=2), first)  # from the cache
    # the projection itself: each coordinate to one bucket with a sign +-1, so norms add up bucket-wise
    bucket, sign = gram._sketch_hashes[("layer.weight", 1000, 64, 2)]
    expected = torch.zeros(3, 64, dtype=torch.float64).index_add_(1, bucket.long(), g * sign.double())
    assert torch.allclose(first.double(), expected, atol=1e-5)
    monkeypatch.setattr(gram, "_SKETCH_HASH_BUDGET", 0)  # over budget: drawn again, not kept, the same projection
    monkeypatch.setattr(gram, "_sketch_hashes", {})
    assert torch.equal(gram.count_sketch(g, "layer.weight", 64, seed=2), first)
    assert gram._sketch_hashes == {}
    assert not torch.equal(gram.count_sketch(g, "other.weight", 64, seed=2), first)


@pytest.mark.parametrize("path", ["ghost", "per_rollout"])
def test_tied_embedding_by_both_paths_matches_reference(tied, batch4, monkeypatch, path):
    """The tied input/output embedding: its per-rollout gradient is the sum of the LM head's and the
    lookup's, so the ghost form needs the cross terms <head_i, lookup_j> (a gather of the head's
    output gradient at the looked-up token ids); the materialised path sums the two [R, V, d]."""
    (name,) = [n for n, p in tied.named_parameters() if "embed" in n]
    if path == "per_rollout":
        monkeypatch.setattr(gram, "_costs", lambda *a: (1.0, 0.0))  # materialising is always cheaper
    else:
        monkeypatch.setattr(gram, "_costs", lambda *a: (0.0, 1.0))
    seen = _spy(monkeypatch)
    err, _, _ = _err(tied, batch4, _weights(batch4))
    assert err <= TOL, err
    assert name in seen[path] and name not in seen["ghost" if path == "per_rollout" else "per_rollout"]
    one = _per_parameter_errors(tied, batch4, _weights(batch4), names=[name])
    assert one[name] <= TOL, one
