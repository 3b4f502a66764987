"""The shapes task, the tiny LLaVA built for it, and the shipped asset grpolab/assets/shapes-vlm."""

from __future__ import annotations

import re

import numpy as np
import torch
from helpers.paths import REPO
from transformers import AutoModelForImageTextToText, AutoProcessor

from grpolab.data import shapes
from grpolab.data.shapes import PALETTE, ShapesSpec, draw, question_key
from grpolab.models.builtin_vlm import IMAGE_TOKEN, TinyVLMSpec, build_processor, build_tiny_vlm, build_tokenizer
from grpolab.training.sft_vlm import answers, prompt_text, sft_batch

ASSET = REPO / "grpolab" / "assets" / "shapes-vlm"
SMALL = TinyVLMSpec(vision_hidden_size=16, vision_layers=1, hidden_size=32, num_layers=1, intermediate_size=32)


def _components(mask: np.ndarray) -> int:
    """Connected regions (4-neighbours) of a boolean picture ``[H, W]``: the independent recount."""
    seen = np.zeros_like(mask)
    count = 0
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        count += 1
        stack = [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for n in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= n[0] < mask.shape[0] and 0 <= n[1] < mask.shape[1] and mask[n] and not seen[n]:
                    seen[n] = True
                    stack.append(n)
    return count


def _same(a: list[dict], b: list[dict]) -> bool:
    """Whether two lists of questions are the same questions (text, pixels and answers) in the same order."""
    return [question_key(r) + r["answer"] for r in a] == [question_key(r) + r["answer"] for r in b]


def test_draws_are_pure_functions_of_their_seeds():
    assert _same(shapes.test_set(5), shapes.test_set(5))
    assert _same(draw(0, 3, 4), draw(0, 3, 4))
    assert not _same(draw(0, 3, 4), draw(0, 4, 4)) and not _same(draw(0, 3, 4), draw(1, 3, 4))


def test_draw_skips_excluded_questions():
    first = draw(0, 3, 4)
    again = draw(0, 3, 4, exclude=frozenset({question_key(first[0])}))
    assert _same(again[:3], first[1:])


def test_answers_are_the_count_of_regions_of_the_asked_colour():
    spec = ShapesSpec()
    for record in shapes.test_set(40, spec):
        pixels = np.asarray(record["image"])  # [H, W, 3]
        assert record["image"].mode == "RGB" and pixels.shape == (spec.image_size, spec.image_size, 3)
        colour = re.fullmatch(r"How many (\w+) shapes are there\?", record["question"]).group(1)
        count = _components((pixels == PALETTE[colour]).all(-1))
        assert record["answer"] == str(count) and 1 <= count <= spec.max_count


def test_chat_template_renders_turns():
    tokenizer = build_tokenizer()
    turn = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red shapes?"}]}
    reply = {"role": "assistant", "content": [{"type": "text", "text": "#### 2"}]}
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Count."}, turn, reply], tokenize=False)
    assert text == "Count.\n<image>How many red shapes?\n#### 2<eos>"
    assert tokenizer.apply_chat_template([turn], add_generation_prompt=True, tokenize=False).endswith("shapes?\n")


def test_processor_expands_the_image_token_and_the_model_runs():
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer, SMALL)
    record = shapes.test_set(1)[0]
    prompt = prompt_text(processor, record["question"])
    inputs = processor(text=[prompt], images=[[record["image"]]], return_tensors="pt")
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert int((inputs["input_ids"] == image_id).sum()) == (32 // 4) ** 2 == SMALL.image_tokens
    torch.manual_seed(0)
    model = build_tiny_vlm(SMALL, tokenizer)
    assert model(**inputs).logits.shape == (1, inputs["input_ids"].shape[1], len(tokenizer))


def test_sft_labels_cover_the_answer_and_eos_only():
    processor = build_processor(build_tokenizer(), SMALL)
    records = draw(0, 1, 3)
    batch = sft_batch(processor, records)
    for labels, record in zip(batch["labels"], records):
        target = labels[labels != -100].tolist()
        assert processor.tokenizer.decode(target) == f"#### {record['answer']}<eos>"


def test_asset_loads_and_answers_in_format():
    model = AutoModelForImageTextToText.from_pretrained(ASSET)
    processor = AutoProcessor.from_pretrained(ASSET)
    completions = answers(model.eval(), processor, shapes.test_set(2), sample=False, max_new_tokens=8)
    assert all(re.fullmatch(r"#### \d", c) for c in completions), completions
