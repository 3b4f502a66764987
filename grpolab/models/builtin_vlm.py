"""The built-in vision-language model's definition: a tiny LLaVA (a CLIP vision tower, LLaVA's two-layer projector, a
tiny Llama of the built-in text model's shape) and its processor, over grpolab's character tokenizer plus ``<image>``.
:mod:`grpolab.training.sft_vlm` trains it into the shipped ``grpolab/assets/shapes-vlm``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

from grpolab.models.builtin import build_char_tokenizer, tiny_llama_config

IMAGE_TOKEN = "<image>"

# A user or system turn is its text then a newline; an assistant turn is its text then EOS. The generation
# prompt adds nothing: the answer follows the user's newline directly, as in the built-in text model's prompts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}" + IMAGE_TOKEN + "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- else -%}{{ '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
)

WARM_START = Path(__file__).resolve().parents[1] / "assets" / "arith-sft"
"""The shipped built-in text model (character vocabulary of 100), the default start of the language model."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """grpolab's character tokenizer with the special token ``<image>`` added (id 100, after the 100 characters)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclasses.dataclass(frozen=True)
class TinyVLMSpec:
    """Shape of the built-in vision-language model. The text fields match the built-in text model
    (:class:`grpolab.models.builtin.TinyLlamaSpec`), so that it can start from that model's weights."""

    image_size: int = 32
    """Side of the (square) picture the tower reads, in pixels."""
    patch_size: int = 4
    """Side of a patch in pixels: a picture becomes (image_size / patch_size)^2 image tokens."""
    vision_hidden_size: int = 64
    """Width of the vision tower."""
    vision_layers: int = 2
    """Transformer blocks of the vision tower."""
    vision_heads: int = 4
    """Attention heads of the vision tower."""
    vision_intermediate_size: int = 128
    """Width of the vision tower's feed-forward layer."""
    hidden_size: int = 128
    """Width d of the language model."""
    num_layers: int = 3
    """Transformer blocks of the language model."""
    num_heads: int = 4
    """Attention heads of the language model."""
    intermediate_size: int = 256
    """Width of the language model's SwiGLU feed-forward layer."""
    max_positions: int = 128
    """Longest prompt (image tokens included) + completion in tokens."""

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens one ``<image>`` expands to: one per patch (the CLS feature is dropped)."""
        return (self.image_size // self.patch_size) ** 2

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size must be a multiple of patch_size, got {self.image_size}, {self.patch_size}")


def build_tiny_vlm(spec: TinyVLMSpec, tokenizer: PreTrainedTokenizerFast) -> LlavaForConditionalGeneration:
    """A randomly initialised tiny LLaVA: CLIP vision tower, GELU projector, Llama with tied embeddings."""
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
    )
    text = tiny_llama_config(spec, tokenizer)  # the built-in text model's shape: it can start from its weights
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=spec.image_tokens,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    return LlavaForConditionalGeneration(config)


def warm_start_text(model: LlavaForConditionalGeneration, source: str | Path) -> None:
    """Copy a saved built-in text model into ``model``'s language model; ``<image>``'s new row of the (tied)
    embedding keeps its random initialisation, since the projected patch features replace it anyway."""
    state = LlamaForCausalLM.from_pretrained(source).model.state_dict()
    new_rows = model.get_input_embeddings().weight.detach()[len(state["embed_tokens.weight"]) :]  # [1, d]
    state["embed_tokens.weight"] = torch.cat([state["embed_tokens.weight"], new_rows])  # [V, d]
    model.model.language_model.load_state_dict(state)  # strict: the shapes must be the built-in text model's


def build_processor(tokenizer: PreTrainedTokenizerFast, spec: TinyVLMSpec) -> LlavaProcessor:
    """The LLaVA processor: PIL images to ``pixel_values`` [B, 3, S, S], and each ``<image>`` expanded to
    ``spec.image_tokens`` placeholders. PIL-only (no torchvision)."""
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, counted by the processor and dropped by "default"
        image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
