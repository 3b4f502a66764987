"""Small models of each layout, random and seeded: grpolab's built-in Llama, GPT-2, Qwen2, the causal-LM layouts beyond
plain attention, a reward model; a model with a seeded batch for it; the built-in model's weights as transformers'."""

from __future__ import annotations

from pathlib import Path

import torch

from grpolab.common.batch import Batch, left_pad

from .paths import REPO


def tiny_llama(tokenizer, seed: int = 0, **spec):
    """A randomly initialised tiny Llama of grpolab's built-in layout (1 layer, hidden 32 unless ``spec`` says
    otherwise), seeded, in eval mode."""
    from grpolab.models.builtin import TinyLlamaSpec, build_tiny_llama

    torch.manual_seed(seed)
    shape = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64) | spec
    return build_tiny_llama(TinyLlamaSpec(**shape), tokenizer).eval()


def gpt2(vocab: int, seed: int | None = None, dropout: float = 0.0, **config):
    """A random GPT-2 layout model (learned absolute positions, fused QKV), 2 layers of width 32 unless ``config``
    says otherwise; ``dropout`` everywhere (0: train mode is deterministic)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    shape = dict(n_positions=128, n_embd=32, n_layer=2, n_head=2) | config
    cfg = GPT2Config(vocab_size=vocab, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **shape)
    return GPT2LMHeadModel(cfg)


def qwen2(vocab: int, **config):
    """A random Qwen2 layout model (grouped-query attention, QKV bias, rotary positions)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **(shape | config)))


CAUSAL_LM_FAMILIES = ("nemotron_h", "mamba", "qwen3_moe", "gpt_oss", "glm4_moe", "cohere2", "gemma2")
"""Causal-LM layouts beyond plain attention, each built tiny and random by :func:`tiny_causal_lm`: a hybrid of Mamba
and attention layers, Mamba alone, three mixtures of experts (GPT-OSS's with sliding-window layers and attention
sinks), and two with sliding-window layers beside full attention."""


def tiny_causal_lm(family: str, tokenizer, seed: int = 0):
    """A random ``family`` model (one of :data:`CAUSAL_LM_FAMILIES`) of 2 layers, hidden 32, over ``tokenizer``'s
    vocabulary, seeded. Every expert of a mixture is routed to on every token (``num_experts_per_tok`` = the number
    of experts), so that every expert's weights get a gradient; sliding windows of 8 tokens, shorter than a prompt and
    its completion, so that the window matters."""
    import transformers as tf

    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    attn = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                max_position_embeddings=256, **ids)  # fmt: skip
    layers, experts, window = dict(num_hidden_layers=2, **attn), dict(num_experts_per_tok=4), dict(sliding_window=8)
    alternating = dict(layer_types=["sliding_attention", "full_attention"], **window, **layers)
    mamba = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=16)
    rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # not GPT-OSS's YaRN at 256 tokens
    configs = {
        "nemotron_h": lambda: tf.NemotronHConfig(layers_block_type=["mamba", "attention"], **mamba, **attn),
        "mamba": lambda: tf.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, **ids),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, **experts, **layers),
        "gpt_oss": lambda: tf.GptOssConfig(num_local_experts=4, **rope, **experts, **window, **layers),
        "glm4_moe": lambda: tf.Glm4MoeConfig(
            n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, **experts, **layers
        ),
        "cohere2": lambda: tf.Cohere2Config(**alternating),
        "gemma2": lambda: tf.Gemma2Config(**alternating),
    }
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(configs[family]())


def model_and_batch():
    """A tiny Llama (seed 7, train mode) on the built-in character tokenizer, and a seeded batch of 6 rows for it:
    left-padded prompts [6, 6] (lengths 3, 5, 4, 6, 2, 5) and right-padded completions [6, 6] (lengths 4, 1, 6, 3,
    5, 2; the even rows end in EOS, the odd ones are cut off)."""
    from grpolab.models.builtin import build_char_tokenizer

    tok = build_char_tokenizer()
    model = tiny_llama(tok, seed=7).train()
    g = torch.Generator().manual_seed(8)
    prompt_lens, comp_lens = [3, 5, 4, 6, 2, 5], [4, 1, 6, 3, 5, 2]
    prompts = [[tok.bos_token_id] + torch.randint(4, len(tok), (n - 1,), generator=g).tolist() for n in prompt_lens]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)  # [N, 6]
    T = max(comp_lens)
    comp_ids = torch.full((len(comp_lens), T), tok.pad_token_id, dtype=torch.long)
    comp_mask = torch.zeros((len(comp_lens), T), dtype=torch.long)
    for i, n in enumerate(comp_lens):
        comp_ids[i, :n] = torch.randint(4, len(tok), (n,), generator=g)
        comp_ids[i, n - 1] = tok.eos_token_id if i % 2 == 0 else comp_ids[i, n - 1]
        comp_mask[i, :n] = 1
    return model, Batch(prompt_ids, prompt_mask, comp_ids, comp_mask)


def tiny_reward_model(
    directory: Path | None = None, num_labels: int = 1, seed: int = 0, template: str | None = None, **config
):
    """A random tiny LlamaForSequenceClassification (2 layers, hidden 32, rotary positions) on the built-in
    character tokenizer, ``num_labels`` logits, seeded, in eval mode, and its tokenizer (its chat template
    ``template``, default :data:`SIMPLE_TEMPLATE`; "" for none); saved with it to ``directory`` when one is given."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpolab.models.builtin import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = SIMPLE_TEMPLATE if template is None else template or None
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    cfg = LlamaConfig(vocab_size=len(tok), num_labels=num_labels, pad_token_id=tok.pad_token_id, **(shape | config))
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg).eval()
    if directory is not None:
        model.save_pretrained(directory)
        tok.save_pretrained(directory)
    return model, tok


# A chat template of the simplest shape: every message, then the assistant's turn.
SIMPLE_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def builtin_causal_lm():
    """The built-in model's weights (a tiny Llama) as a transformers causal LM and its tokenizer, given
    :data:`SIMPLE_TEMPLATE` as chat template: what grpolab.trl's tests hand TRL's own trainer and the drop-in alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = REPO / "grpolab" / "assets" / "arith-sft"
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = SIMPLE_TEMPLATE
    return AutoModelForCausalLM.from_pretrained(path), tokenizer


def builtin_teacher(out: Path, scale: float = 0.05, seed: int = 5, extra_token: str = "") -> Path:
    """The built-in model with every weight moved by ``scale`` x N(0, 1) (seeded), saved with its tokenizer to
    ``out``: a teacher that disagrees with the built-in policy. ``extra_token``: the tokenizer gets one more token (and
    the model one more row): a teacher of another vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = REPO / "grpolab" / "assets" / "arith-sft"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if extra_token:
        tokenizer.add_tokens([extra_token])
        model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
