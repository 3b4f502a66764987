"""Vision-language training on the device: the built-in vision-language model (``vision``), and a random
Qwen2.5-VL of 3B's shapes through grpolab's QwenProcessor (``qwen-vl``, timed: it fills the GPU)."""

from __future__ import annotations

import time

import torch

from .common import (
    Check,
    Context,
    Recorder,
    check_learning_signal,
    finite,
    losses_text,
    padded_tokenizer,
    peak_text,
    quiet,
    train_qwen,
)


def check_vision(ctx: Context) -> dict:
    """The built-in vision-language model on the shapes task: 3 steps of bf16-mixed."""
    import grpolab
    from grpolab.commands.demo import SHAPES_PRESET
    from grpolab.data.shapes import write_task

    train, test = write_task(ctx.work / "shapes", train=64, held_out=8)
    preset = SHAPES_PRESET | dict(steps=3, eval_questions=8, eval_samples=0, prompts_per_step=4, eval_every=0,
                                  threads=1)  # fmt: skip
    rec = Recorder()
    ctx.reset_peak()
    t0 = time.perf_counter()
    grpolab.train(model="builtin-vlm", data=str(train), eval_data=str(test), device=ctx.dev, precision="bf16-mixed",
                  progress=False, doctor="off", out=str(ctx.work / "vision"), log=quiet, hooks=rec.hooks,
                  **preset)  # fmt: skip
    seconds = time.perf_counter() - t0
    losses = [m["loss/total"] for m in rec.metrics]
    if len(losses) != 3 or not all(map(finite, losses)):
        raise AssertionError(f"3 finite losses expected, got {losses}")
    return dict(steps=len(losses), loss=losses, reward_mean=[m["reward/mean"] for m in rec.metrics],
                step_s=[m["time/step_s"] for m in rec.metrics], run_s=seconds, peak_gib=ctx.peak_gib())  # fmt: skip


def vision_summary(figures: dict) -> str:
    return f"3 steps, losses {losses_text(figures['loss'])}{peak_text(figures['peak_gib'])}"


QWEN_VL_3B = dict(
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                fullatt_block_indexes=[7, 15, 23, 31]),
    mrope_section=[16, 24, 24],
    pixels=224,
)  # fmt: skip
"""Qwen2.5-VL-3B-Instruct's shapes (its config's values; the vision tower's window attention of 112 pixels)."""
QWEN_VL_CPU = dict(
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=4096, tie_word_embeddings=True),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                fullatt_block_indexes=[1]),
    mrope_section=[2, 3, 3],
    pixels=56,
)  # fmt: skip
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
)
"""A plain chat template for the random Qwen2.5-VL: each image part is Qwen's placeholder, a turn ends in a newline."""


def qwen_vl(ctx: Context):
    """``(model, processor, pixels)``: a random Qwen2.5-VL of :data:`QWEN_VL_3B`'s shapes (--cpu:
    :data:`QWEN_VL_CPU`'s) on the device, fp32, and grpolab's QwenProcessor over the padded character tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from grpolab.vision.processing import QwenProcessor

    shape = QWEN_VL_CPU if ctx.cpu else QWEN_VL_3B
    tok = padded_tokenizer(1024 if ctx.cpu else 151936, QWEN_VL_TOKENS)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(("start", "end", "image", "video"), QWEN_VL_TOKENS)}
    rope = {"rope_type": "default", "mrope_section": shape["mrope_section"], "rope_theta": 1000000.0}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), rope_parameters=rope, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape["text"]),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           **shape["vision"]),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
    )  # fmt: skip
    torch.manual_seed(0)
    with ctx.device:
        model = Qwen2_5_VLForConditionalGeneration(config)
    side = shape["pixels"]
    try:  # transformers' PIL image processor needs no torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Images
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Images
    images = Images(min_pixels=side * side, max_pixels=side * side)
    return model, QwenProcessor(images, tok, CHAT), side


def check_qwen_vl(ctx: Context) -> dict:
    """A random Qwen2.5-VL (3B's shapes; --cpu: tiny), 3 steps of bf16-mixed on pictures of one colour each."""
    from PIL import Image

    model, processor, side = qwen_vl(ctx)
    params = sum(p.numel() for p in model.parameters())
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Digits {i}:"}]}],
         "image": Image.new("RGB", (side, side), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256))}
        for i in range(32)
    ]  # fmt: skip
    rec = Recorder()
    ctx.reset_peak()
    t0 = time.perf_counter()
    train_qwen(ctx, ctx.work / "qwen-vl", model, processor, 3, rec.hooks, train_dataset=rows, chat="auto",
               precision="bf16-mixed", lr=1e-6)  # fmt: skip
    seconds = time.perf_counter() - t0
    losses = [m["loss/total"] for m in rec.metrics]
    if len(losses) != 3 or not all(map(finite, losses)):
        raise AssertionError(f"3 finite losses expected, got {losses}")
    check_learning_signal(rec.metrics)
    return dict(parameters=params, pixels=side, steps=len(losses), loss=losses, step_s=[m["time/step_s"] for m in
                rec.metrics], run_s=seconds, peak_gib=ctx.peak_gib())  # fmt: skip


def qwen_vl_summary(figures: dict) -> str:
    n = figures["parameters"]
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    return (f"{size} parameters, {figures['pixels']}-pixel pictures, 3 steps, losses "
            f"{losses_text(figures['loss'])}{peak_text(figures['peak_gib'])}")  # fmt: skip


VISION = Check(
    "vision", "in-process", check_vision, vision_summary,
    "the built-in vision-language model on the shapes task, 3 steps of bf16-mixed",
    passes="3 finite losses",
)  # fmt: skip
QWEN_VL = Check(
    "qwen-vl", "timed", check_qwen_vl, qwen_vl_summary,
    "the random Qwen2.5-VL (3.75 B parameters; --cpu: tiny), 3 steps of bf16-mixed on 224-pixel pictures (--cpu: "
    "56), grpolab's QwenProcessor; its peak memory",
    passes="3 finite losses, and every step scored without a reward error with rollouts that have an advantage",
)  # fmt: skip
