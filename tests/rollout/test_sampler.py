"""Tests of grpolab.rollout.sampler and the built-in character tokenizer.

Unit: EOS handling, batch-independence of keyed sampling, greedy decoding and
log-probs against naive per-sequence computations on a tiny random Llama.
Statistical: token frequencies of the inverse-CDF sampler against softmax.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import tiny_llama

from grpolab.common.batch import left_pad
from grpolab.models.logprobs import completion_logprobs
from grpolab.rollout.sampler import _pick, rollout_uniforms, sample

# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text", ["12+7-3\n", "12+7=19\n19-3=16\n#### 16", "Tom has 3 apples, then 4 more!  (7)", "~`{}|\\ \"'"]
)
def test_char_tokenizer_round_trips_text(char_tokenizer, text):
    ids = char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert char_tokenizer.unk_token_id not in ids
    assert char_tokenizer.decode(ids) == text


def test_char_tokenizer_specials(char_tokenizer):
    tok = char_tokenizer
    assert tok.pad_token_id == 0 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    ids = [tok.bos_token_id] + tok("7*6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "7*6"
    assert tok("\u00e9", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]


# ---------------------------------------------------------------- models and prompts

EOS_BOOST = 1.7  # logit added to EOS: with ~100 near-uniform logits, P(EOS) ~ e^1.7 / (e^1.7 + 99) ~ 5%


def _tiny(tok, seed: int):
    return tiny_llama(tok, seed)


@pytest.fixture(scope="module")
def eos_model(char_tokenizer):
    """A tiny random Llama whose EOS logit is raised, so that completions end at varied lengths."""
    model = _tiny(char_tokenizer, seed=21)
    eos = char_tokenizer.eos_token_id

    def boost(module, inputs, logits):
        logits = logits.clone()
        logits[..., eos] += EOS_BOOST
        return logits

    model.lm_head.register_forward_hook(boost)
    return model


def _prompts(tok, questions):
    return [[tok.bos_token_id] + tok(q + "\n", add_special_tokens=False)["input_ids"] for q in questions]


QUESTIONS = ["12+7", "45-(12+7)", "3*4", "161/7", "12+7-3+40", "9", "88-1-2", "70*3"]


def _kw(tok, **over):
    return {
        **dict(max_new_tokens=20, temperature=1.0, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id),
        **over,
    }


# ---------------------------------------------------------------- sample


def test_completions_stop_at_eos(eos_model, char_tokenizer):
    tok = char_tokenizer
    prompts = _prompts(tok, QUESTIONS) * 3  # 24 rollouts
    keys = [(0, i) for i in range(len(prompts))]
    batch = sample(eos_model, prompts, keys, **_kw(tok))
    N, T = batch.completion_ids.shape
    assert N == 24 and T <= 20
    assert batch.completion_mask.sum(1).max().item() == T  # trimmed to the longest completion
    ended, truncated = 0, 0
    for ids, m in zip(batch.completion_ids.tolist(), batch.completion_mask.tolist()):
        L = sum(m)
        assert L >= 1
        assert m == [1] * L + [0] * (T - L)  # mask 1 up to and including EOS, 0 after
        assert ids[L:] == [tok.pad_token_id] * (T - L)  # pad after
        if tok.eos_token_id in ids[:L]:
            assert ids.index(tok.eos_token_id) == L - 1  # nothing generated after the first EOS
            ended += 1
        else:
            assert L == 20  # no EOS: ran to max_new_tokens
            truncated += 1
    assert ended >= 3 and truncated >= 3  # both cases are exercised


def test_ignore_eos_runs_every_completion_to_the_end_and_keeps_the_tokens_before_eos(eos_model, char_tokenizer):
    """--ignore-eos: every row has max_new_tokens tokens, an EOS sampled on the way stays in it, and up to the
    first EOS the tokens are those of the run that stops there (the same uniforms draw them)."""
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings

    tok = char_tokenizer
    prompts = _prompts(tok, QUESTIONS) * 2
    keys = [(0, i) for i in range(len(prompts))]
    engine = HFEngine(eos_model, EngineSpec(tok.eos_token_id, tok.pad_token_id))
    stop = engine.generate(prompts, keys, SamplingSettings(20, 1.0)).batch
    full = engine.generate(prompts, keys, SamplingSettings(20, 1.0, ignore_eos=True)).batch
    assert full.completion_ids.shape == (16, 20) and bool(full.completion_mask.all())
    inside = 0
    for i in range(16):
        L = int(stop.completion_mask[i].sum())
        assert full.completion_ids[i, :L].tolist() == stop.completion_ids[i, :L].tolist()
        inside += int(tok.eos_token_id in full.completion_ids[i, :-1].tolist())
    assert inside >= 3  # EOS sampled mid-completion and generation went on


def test_same_key_same_completion_regardless_of_batch(eos_model, char_tokenizer):
    tok = char_tokenizer
    p = _prompts(tok, ["12+7", "45-(12+7)", "3*4"])
    k = [(1, 0, 5, 0, 0), (1, 0, 5, 1, 3), (1, 0, 5, 2, 1)]

    def row(batch, i):
        L = int(batch.completion_mask[i].sum())
        return batch.completion_ids[i, :L].tolist()

    alone = row(sample(eos_model, [p[1]], [k[1]], **_kw(tok)), 0)
    pair = sample(eos_model, [p[0], p[1]], [k[0], k[1]], **_kw(tok))
    swapped = sample(eos_model, [p[1], p[0]], [k[1], k[0]], **_kw(tok))
    triple = sample(eos_model, [p[2], p[0], p[1]], [k[2], k[0], k[1]], **_kw(tok))
    assert row(pair, 1) == alone
    assert row(swapped, 0) == alone
    assert row(triple, 2) == alone
    assert row(pair, 0) == row(swapped, 1) == row(triple, 1)
    # and a different key gives a different completion (the key matters)
    other = row(sample(eos_model, [p[1]], [(1, 0, 5, 1, 4)], **_kw(tok)), 0)
    assert other != alone


def test_temperature_zero_is_naive_greedy_decoding(tiny_model, char_tokenizer):
    tok = char_tokenizer
    prompts = _prompts(tok, QUESTIONS[:5])
    batch = sample(tiny_model, prompts, [(0, i) for i in range(5)], **_kw(tok, max_new_tokens=12, temperature=0.0))
    for i, prompt in enumerate(prompts):
        ids, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(12):  # no cache, no padding: the whole sequence every time
                nxt = int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax())
                expected.append(nxt)
                ids.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        L = int(batch.completion_mask[i].sum())
        assert batch.completion_ids[i, :L].tolist() == expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_equal_naive_per_sequence_computation(eos_model, char_tokenizer, temperature):
    tok = char_tokenizer
    prompts = _prompts(tok, QUESTIONS)
    batch = sample(eos_model, prompts, [(2, i) for i in range(len(prompts))], **_kw(tok, max_new_tokens=16))
    assert len(set(batch.completion_mask.sum(1).tolist())) > 1  # completions of different lengths
    with torch.no_grad():
        logp = completion_logprobs(eos_model, batch, temperature=temperature)  # [N, T]
        assert logp.shape == batch.completion_ids.shape
        for i, prompt in enumerate(prompts):
            L = int(batch.completion_mask[i].sum())
            comp = batch.completion_ids[i, :L].tolist()
            full = torch.tensor([prompt + comp])  # unpadded
            lsm = torch.log_softmax(eos_model(full).logits[0].float() / temperature, dim=-1)  # [P + L, V]
            P = len(prompt)
            naive = torch.tensor([lsm[P - 1 + t, comp[t]].item() for t in range(L)])
            torch.testing.assert_close(logp[i, :L], naive, rtol=0, atol=1e-5)
            assert (logp[i, L:] == 0).all()


# ---------------------------------------------------------------- uniforms and _pick


def test_rollout_uniforms_are_keyed_per_row():
    a = rollout_uniforms([(1, 2), (3, 4)], 10)
    b = rollout_uniforms([(3, 4)], 10)
    assert a.shape == (2, 10) and a.dtype == torch.float64  # float64: see rollout_uniforms
    torch.testing.assert_close(a[1], b[0], rtol=0, atol=0)
    assert not torch.equal(a[0], a[1])
    assert ((a >= 0) & (a < 1)).all()


def test_rollout_uniforms_never_equal_one():
    # Training rollout (stream 1, seed 0, step 7499, prompt 0, rollout 3) draws, at token 10, the
    # float64 uniform 0.99999997708 > 1 - 2^-25, which rounds to exactly 1.0 in float32.
    # The docstring promises [0, 1); a u of 1.0 makes the inverse-CDF sampler pick the *last*
    # vocabulary entry whatever its probability (see the next test).
    key = (1, 0, 7499, 0, 3)
    assert np.random.default_rng(list(key)).random(48)[10] > 1 - 2.0**-25  # the input is what we say it is
    u = rollout_uniforms([key], 48)
    assert (u < 1.0).all(), f"u = {u.max().item()!r} at {int(u.argmax())}"


def test_sample_never_emits_a_zero_probability_token(char_tokenizer):
    # The last vocabulary entry (and EOS) get logit -inf, so probability exactly 0; the key above
    # feeds u = 1.0 at position 10 if uniforms are not kept below 1.
    tok = char_tokenizer
    model = _tiny(tok, seed=22)
    last = len(tok) - 1

    def forbid(module, inputs, logits):
        logits = logits.clone()
        logits[..., last] = -float("inf")
        logits[..., tok.eos_token_id] = -float("inf")
        return logits

    model.lm_head.register_forward_hook(forbid)
    for top_p in (1.0, 0.9):
        batch = sample(model, _prompts(tok, ["12+7"]), [(1, 0, 7499, 0, 3)], **_kw(tok, max_new_tokens=12, top_p=top_p))
        assert batch.completion_mask.sum().item() == 12
        assert last not in batch.completion_ids[0].tolist(), f"top_p={top_p}: sampled a token of probability 0"


PROBS = np.array([0.05, 0.25, 0.12, 0.40, 0.15, 0.03])  # distinct values: no ties in the sort


def _frequencies(temperature: float, top_p: float, n: int = 40_000, seed: int = 0) -> np.ndarray:
    logits = torch.log(torch.tensor(PROBS, dtype=torch.float32)).expand(n, -1)  # [n, V]
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    tokens = _pick(logits, u, temperature, top_p)
    assert tokens.shape == (n,)
    return np.bincount(tokens.numpy(), minlength=len(PROBS)) / n


def test_pick_frequencies_match_softmax():
    # 40000 draws: each frequency has std <= sqrt(0.25 / 40000) = 0.0025; tolerance 0.01 is 4 sigma.
    freq = _frequencies(1.0, 1.0)
    np.testing.assert_allclose(freq, PROBS, atol=0.01)


def test_pick_frequencies_match_tempered_softmax():
    # softmax(log p / 0.5) = p^2 / sum p^2
    freq = _frequencies(0.5, 1.0, seed=1)
    expected = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(freq, expected, atol=0.01)


@pytest.mark.parametrize(
    "top_p, nucleus",
    [
        # sorted: 0.40 (tok 3), 0.25 (1), 0.15 (4), 0.12 (2), 0.05 (0), 0.03 (5); mass before: 0, .40, .65, .80, .92, .97
        (0.7, [3, 1, 4]),  # keep while the mass before < 0.7: 0.40 + 0.25 + 0.15 = 0.80
        (0.5, [3, 1]),  # 0.40 + 0.25 = 0.65
        (0.3, [3]),
    ],
)
def test_pick_top_p_samples_the_renormalised_nucleus_only(top_p, nucleus):
    freq = _frequencies(1.0, top_p, seed=2)
    expected = np.zeros_like(PROBS)
    expected[nucleus] = PROBS[nucleus] / PROBS[nucleus].sum()  # e.g. 0.4/0.8, 0.25/0.8, 0.15/0.8
    outside = [i for i in range(len(PROBS)) if i not in nucleus]
    assert (freq[outside] == 0).all(), freq
    np.testing.assert_allclose(freq, expected, atol=0.01)


def test_pick_temperature_zero_is_argmax_and_extreme_uniforms_stay_in_support():
    logits = torch.log(torch.tensor(PROBS, dtype=torch.float32))[None].expand(3, -1)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-24])  # smallest and largest float32 in [0, 1)
    assert _pick(logits, u, 0.0, 1.0).tolist() == [3, 3, 3]
    # u = 0 picks the first token of positive probability, the largest u the last one
    assert _pick(logits, u, 1.0, 1.0).tolist()[0] == 0
    assert _pick(logits, u, 1.0, 1.0).tolist()[2] == 5
    # with top_p 0.7 the largest u picks the last token of the nucleus (token 4), never outside it
    assert _pick(logits, u, 1.0, 0.7).tolist()[2] == 4
