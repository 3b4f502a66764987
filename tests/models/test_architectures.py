"""Causal-LM layouts beyond plain attention, through grpolab's sampler and trainer: a hybrid of Mamba and attention
(NemotronH), Mamba alone, mixtures of experts (Qwen3-MoE, GPT-OSS, GLM-4-MoE) and sliding windows beside full
attention (Cohere2, Gemma2, GPT-OSS), each tiny and random (``helpers.models.tiny_causal_lm``).

The sampler keeps grpolab's slab cache (and the fused decoder) for models whose own cache is plain full attention,
and decodes with the model's own cache, said once, for the others (``grpolab.models.decode_cache.slab_reason``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import CAUSAL_LM_FAMILIES, tiny_causal_lm, tiny_llama

from grpolab.models.decode_cache import slab_reason
from grpolab.models.logprobs import completion_logprobs
from grpolab.rollout.sampler import sample_with_stats

SLAB = {"qwen3_moe", "glm4_moe"}
"""The families whose own cache is full attention in every layer: the slab holds it as it is."""


def test_the_slab_serves_plain_attention_and_only_it(char_tokenizer):
    """The built-in model and SmolLM2's layout (Llama) keep the slab cache (and so the fused decoder); a sliding
    window or a recurrent layer falls back."""
    from transformers import LlamaConfig, LlamaForCausalLM

    smollm2 = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, tie_word_embeddings=True, vocab_size=len(char_tokenizer))  # fmt: skip
    assert slab_reason(tiny_llama(char_tokenizer)) is None and slab_reason(LlamaForCausalLM(smollm2)) is None
    reasons = {f: slab_reason(tiny_causal_lm(f, char_tokenizer)) for f in CAUSAL_LM_FAMILIES}
    assert {f for f, r in reasons.items() if r is None} == SLAB
    assert reasons["mamba"] == reasons["nemotron_h"] == "its cache has LinearAttentionLayer layers"
    assert reasons["gemma2"] == "its cache has DynamicSlidingWindowLayer layers"


@pytest.mark.parametrize("family", CAUSAL_LM_FAMILIES)
def test_the_sampler_s_log_probs_are_the_forward_s(family, char_tokenizer):
    """Each sampled token's log-prob is the one a plain forward over the whole sequence gives it, with rows that
    stop early (their cache rows dropped). Before the sampler took the model's own cache, NemotronH's prefill failed
    (IndexError in transformers' cache) and Mamba's decode steps silently ignored the prompt (0.8 nats off)."""
    model = tiny_causal_lm(family, char_tokenizer).eval()
    prompts = [[5, 6, 7, 8, 9, 20, 21]] * 2 + [[10, 11, 12]] * 2  # two groups, the second left-padded
    keys = [(0, i) for i in range(4)]

    def draw(eos_id: int):
        return sample_with_stats(model, prompts, keys, max_new_tokens=12, temperature=1.0, top_p=1.0,
                                 eos_id=eos_id, pad_id=char_tokenizer.pad_token_id)  # fmt: skip

    eos = int(draw(-1).batch.completion_ids[0, 3])  # the same draws end row 0 (at least) after 4 tokens
    got = draw(eos)
    lengths = got.batch.completion_mask.sum(1)
    assert lengths[0] == 4 and lengths.max() == 12
    with torch.no_grad():
        want = completion_logprobs(model, got.batch)
    assert torch.allclose(got.logprobs, want, atol=1e-5, rtol=0)


def text_sum(completions, **kwargs):
    """A reward that differs between two random completions of a group almost surely: the sum of their characters'
    codes, modulo 7."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _unmoved(before: dict[str, torch.Tensor], model) -> list[str]:
    """The parameters equal to ``before``'s, and each expert of a stacked ``[E, ...]`` experts' tensor on its own."""
    still = []
    for name, p in model.named_parameters():
        if ".experts." in name:  # one tensor holds every expert: each expert must move
            still += [f"{name}[{e}]" for e in range(p.shape[0]) if torch.equal(p[e], before[name][e])]
        elif torch.equal(p, before[name]):
            still.append(name)
    return still


@pytest.mark.parametrize("family", CAUSAL_LM_FAMILIES)
def test_two_grpo_steps_move_every_parameter(family, char_tokenizer, tmp_path, machine_kind):
    """grpolab.trl's GRPOTrainer on a model object: two steps move every parameter (every expert's too), and a
    model the slab cache cannot hold is said once to decode with its own."""
    from datasets import Dataset

    from grpolab.trl import GRPOConfig, GRPOTrainer

    machine_kind(bf16=False)
    model = tiny_causal_lm(family, char_tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=8, learning_rate=1e-2, bf16=False, report_to="none", disable_tqdm=True,
                      save_strategy="no", logging_steps=1)  # fmt: skip
    rows = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(2) for b in range(2)])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(model, [text_sum], args, train_dataset=rows, processing_class=char_tokenizer)
        out = trainer.train()
    assert out.global_step == 2
    assert [m["reward/frac_zero_std"] for m in trainer.run.metrics if "reward/mean" in m] == [0.0, 0.0]  # a signal
    assert _unmoved(before, model) == []
    notices = [str(w.message) for w in said if "slab cache" in str(w.message)]
    assert len(notices) == (family not in SLAB), notices


@pytest.mark.parametrize("family", CAUSAL_LM_FAMILIES)
def test_trl_s_own_trainer_moves_every_parameter_too(family, char_tokenizer, tmp_path):
    """The reference: TRL 1.16's own GRPOTrainer on the same tiny model, rows and settings moves every parameter (every
    expert's) in two steps, as the drop-in does above."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = tiny_causal_lm(family, char_tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=8, learning_rate=1e-2, bf16=False, report_to="none", disable_tqdm=True,
                      save_strategy="no", logging_steps=1, use_cpu=True)  # fmt: skip
    rows = Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(2) for b in range(2)])
    GRPOTrainer(model, [text_sum], args, train_dataset=rows, processing_class=char_tokenizer).train()
    assert _unmoved(before, model) == []
