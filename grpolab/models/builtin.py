"""The built-in policy: a tiny Llama and a character-level tokenizer.

Both are ordinary Hugging Face objects (``LlamaForCausalLM`` and a fast
tokenizer built with the tokenizers library), so they save and load with
``save_pretrained`` / ``from_pretrained`` like any model on disk.
"""

from __future__ import annotations

import dataclasses
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Printable ASCII and newline: enough for the arithmetic task and for GSM8K-style
# text, whose other characters map to <unk>.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ``decode`` concatenates characters back (no spaces added)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


@dataclasses.dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the built-in Llama."""

    hidden_size: int = 128
    """Model width d."""
    num_layers: int = 3
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (d / heads per head)."""
    intermediate_size: int = 256
    """Width of the SwiGLU feed-forward layer."""
    max_positions: int = 128
    """Longest prompt + completion in tokens."""


def tiny_llama_config(spec: TinyLlamaSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The built-in Llama's config for ``spec`` (any object with its fields: the built-in vision-language model's
    language model takes the same) over ``tokenizer``'s vocabulary and special tokens."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_llama(spec: TinyLlamaSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return LlamaForCausalLM(tiny_llama_config(spec, tokenizer))
