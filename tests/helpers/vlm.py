"""Tiny random vision-language models of each family grpolab has an adapter for, with their processors, and pictures."""

from __future__ import annotations

from pathlib import Path

import torch

VLM_FAMILIES = ("llava", "idefics3", "qwen2-vl")
"""The vision-language families grpolab has an adapter for, each built tiny and random by :func:`tiny_vlm`."""

_VLM_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
)


def _vlm_tokenizer(specials: list[str]):
    from grpolab.models.builtin import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _vlm_text(tok, **extra) -> dict:
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    return dict(vocab_size=len(tok), max_position_embeddings=512, **shape, **ids, **extra)


def tiny_vlm(family: str, seed: int = 0):
    """``(model, processor)``: a random vision-language model of ``family`` (one of :data:`VLM_FAMILIES`; width 32, 2
    layers in the tower and the language model, 28-pixel images of 14-pixel patches) in eval mode, and its processor
    over the built-in character tokenizer with the image placeholder tokens added and a plain chat template (an
    image part is the family's placeholder, a turn ends with a newline). Processors that need torchvision are not
    used: transformers' PIL image processors, and grpolab's :class:`grpolab.vision.processing.QwenProcessor`."""
    from transformers import (
        CLIPVisionConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14)
    if family == "llava":
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        tok = _vlm_tokenizer(["<image>"])
        torch.manual_seed(seed)
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(image_size=28, projection_dim=32, **vision),
            text_config=LlamaConfig(**_vlm_text(tok)),
            image_token_id=tok.convert_tokens_to_ids("<image>"),
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
        )
        images = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        template = _VLM_TEMPLATE.replace("IMAGE", "<image>")
        processor = LlavaProcessor(
            image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
            image_token="<image>", num_additional_image_tokens=1, chat_template=template,
        )  # fmt: skip
        return LlavaForConditionalGeneration(config).eval(), processor
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        tok = _vlm_tokenizer(["<image>", "<fake_token_around_image>", "<global-img>"])
        torch.manual_seed(seed)
        config = Idefics3Config(
            vision_config=dict(image_size=28, **vision),
            text_config=_vlm_text(tok, model_type="llama"),
            image_token_id=tok.convert_tokens_to_ids("<image>"),
            scale_factor=2,  # 2 x 2 patches -> 1 token per image (tile)
        )
        images = Idefics3ImageProcessorPil(
            size={"longest_edge": 28}, max_image_size={"longest_edge": 28}, do_image_splitting=False
        )
        template = _VLM_TEMPLATE.replace("IMAGE", "<image>")
        processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=1, chat_template=template)
        return Idefics3ForConditionalGeneration(config).eval(), processor
    if family == "qwen2-vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from grpolab.vision.processing import QwenProcessor

        tok = _vlm_tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
        torch.manual_seed(seed)
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        config = Qwen2VLConfig(
            text_config=_vlm_text(tok, rope_parameters=rope),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14),
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        )
        images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
        template = _VLM_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
        return Qwen2VLForConditionalGeneration(config).eval(), QwenProcessor(images, tok, template)
    raise ValueError(f"no tiny {family!r}; choose from {VLM_FAMILIES}")


def save_tiny_vlm(family: str, path: Path, seed: int = 0) -> Path:
    """:func:`tiny_vlm` saved as a model directory (weights, config, processor) that ``--model`` loads."""
    model, processor = tiny_vlm(family, seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def picture(colour=(255, 0, 0), size=(40, 30)):
    """A plain RGB picture of ``colour`` and ``size`` (width, height)."""
    from PIL import Image

    return Image.new("RGB", size, colour)
