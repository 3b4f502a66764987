"""A record's prompt and images as a vision-language model's ids and :class:`grpolab.vision.media.Media`.

The data forms are TRL's: an ``image`` or ``images`` column beside a conversational prompt (the images are put at
the start of the first user message, as TRL's ``prepare_multimodal_messages`` does), or ``{"type": "image"}`` parts
already in the prompt's content, which the column's images fill in order.

The processor is the model's own (``AutoProcessor``) for LLaVA and Idefics3. For Qwen2-VL and Qwen2.5-VL it is
:class:`QwenProcessor`, grpolab's: transformers' Qwen processors build a video processor that needs torchvision,
which cannot be installed beside every torch build (not beside this project's CPU one). Images need only the image
processor and the tokenizer, with each ``<|image_pad|>`` expanded to ``t * h * w / merge^2`` copies, the family's rule
(transformers' ``Qwen2VLProcessor.replace_image_token``); a test holds the two to the same ids where both load.
"""

from __future__ import annotations

from pathlib import Path

from grpolab.vision.families import Family
from grpolab.vision.media import Media

QWEN_IMAGE = "<|image_pad|>"
_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def with_image_parts(messages: list[dict], n_images: int) -> list[dict]:
    """``messages`` with every content a list of parts (``{"type": "text", "text": ...}``), and, when no message has
    an image part, ``n_images`` image parts put first in the first user message (TRL's form)."""
    parts = [{**m, "content": _parts(m["content"])} for m in messages]
    if n_images and not image_parts(parts):
        first = next((i for i, m in enumerate(parts) if m["role"] == "user"), None)
        if first is None:
            raise ValueError("a row with images needs a user message to put them in")
        parts[first] = {**parts[first], "content": [{"type": "image"}] * n_images + parts[first]["content"]}
    return parts


def _parts(content) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _image_parts(messages: list[dict]):
    """``(message, part)`` for each image part of the messages, in order."""
    for m in messages:
        if isinstance(m["content"], list):
            yield from ((m, p) for p in m["content"] if p.get("type") == "image")


def image_parts(messages: list[dict]) -> int:
    """How many image parts the messages hold."""
    return sum(1 for _ in _image_parts(messages))


def part_images(messages: list[dict]) -> list:
    """The images that messages' image parts carry (``{"type": "image", "image": ...}``: a PIL image, a path or
    ``{"bytes", "path"}``, read by :func:`grpolab.data.images.load_image`), in order; a part without its image is an
    error (an environment's message must carry its picture)."""
    from grpolab.data.images import load_image

    out = []
    for m, p in _image_parts(messages):
        if p.get("image") is None:
            raise ValueError(f"a {m['role']} message has an image part without its image ('image': ...)")
        out.append(load_image(p["image"], f"a {m['role']} message's image"))
    return out


def encode(processor, family: Family, messages: list[dict], images: list) -> tuple[list[int], Media | None]:
    """A prompt's ids (the chat template with the generation prompt, image placeholders expanded) and its images'
    :class:`Media` (None for a prompt without images)."""
    messages = with_image_parts(messages, len(images))
    if (parts := image_parts(messages)) != len(images):
        raise ValueError(f"the prompt has {parts} image parts for {len(images)} images")
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode_text(processor, family, text, images)


def encode_text(processor, family: Family, text: str, images: list) -> tuple[list[int], Media | None]:
    """The ids of a text that holds one unexpanded placeholder per image (the chat template's), each expanded to the
    image's tokens, and the images' :class:`Media` (None without images)."""
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"]), None
    out = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0]  # [P]
    inputs = {k: out[k] for k in family.image_inputs if out.get(k) is not None}
    tokens = int((ids == _image_token(processor)).sum())
    return ids.tolist(), Media.of(family, inputs, len(ids), tokens, len(images))


def _image_token(processor) -> int:
    """The id of the processor's image placeholder (the model's config is not at hand here)."""
    token = getattr(processor, "image_token_id", None)
    if token is None:
        token = processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", "<image>"))
    return token


class QwenProcessor:
    """Qwen2-VL's and Qwen2.5-VL's processor for images and text, without the video half (module docstring)."""

    image_token = QWEN_IMAGE

    def __init__(self, image_processor, tokenizer, chat_template: str | None = None):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token_id = tokenizer.convert_tokens_to_ids(QWEN_IMAGE)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def __call__(self, text: list[str], images: list[list] | None = None, return_tensors="pt", **kwargs):
        from transformers import BatchFeature

        flat = [im for row in images or [] for im in row]
        pixels = dict(self.image_processor(images=flat, return_tensors="pt")) if flat else {}
        merge = self.image_processor.merge_size**2
        counts = iter((pixels["image_grid_thw"].prod(-1) // merge).tolist() if flat else [])
        expanded = []
        for t in text:
            pieces = t.split(QWEN_IMAGE)
            expanded.append(pieces[0] + "".join(QWEN_IMAGE * next(counts) + p for p in pieces[1:]))
        ids = self.tokenizer(expanded, return_tensors=return_tensors, **kwargs)
        return BatchFeature({**ids, **pixels})

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def save_pretrained(self, path) -> None:
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.chat_template:
            (Path(path) / _CHAT_TEMPLATE_FILE).write_text(self.chat_template)

    @classmethod
    def from_pretrained(cls, path) -> QwenProcessor:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        path = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        template = path / _CHAT_TEMPLATE_FILE
        return cls(image_processor, tokenizer, template.read_text() if template.is_file() else None)


def load_processor(path, family: Family):
    """The processor of a model directory, the one its family names (:attr:`Family.processor`)."""
    if family.processor == "qwen":
        return QwenProcessor.from_pretrained(path)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)
