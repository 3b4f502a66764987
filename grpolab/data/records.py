"""What every record is, whatever file it came from: a prompt, and the fields the rewards read.

Two shapes reach the trainer:

- **prompt records** (any data set with a prompt column): ``prompt`` is a string or a chat (a list of
  ``{"role", "content"}`` messages), and every other column of the row is kept as it is, for the
  reward functions;
- **task records** (the built-in arithmetic task and the GSM8K / MATH presets): ``question``, ``answer``,
  ``ground_truth`` and ``category``.

The two helpers below are the one place that tells them apart.
"""

from __future__ import annotations

import json
from typing import Any


def prompt_of(record: dict) -> str | list[dict]:
    """The prompt as the data gives it: a string, or a list of chat messages."""
    return record["prompt"] if "prompt" in record else record["question"]


def question_of(record: dict) -> str:
    """The prompt as one text, for logs, samples and the train/held-out overlap check: the string itself, or a
    chat's messages as ``role: content`` lines; a row with neither (an environment's record) as its JSON."""
    if "prompt" not in record and "question" not in record:
        return json.dumps(record, sort_keys=True, default=str)
    prompt = prompt_of(record)
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {content_text(m['content'])}" for m in prompt)


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of ``{"role": str, "content": ...}`` messages, each content a string or a list of
    typed parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``: TRL's form for prompts with images)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and is_content(m.get("content")) for m in prompt)
    )


def is_content(content: Any) -> bool:
    """Whether ``content`` is a message's content: a string, or a list of typed parts (``{"type": ...}``)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)


def content_text(content: str | list[dict]) -> str:
    """A message's content as text: the string, or its parts with each image shown as ``<image>``."""
    if isinstance(content, str):
        return content
    return "".join("<image>" if p["type"] == "image" else str(p.get("text", "")) for p in content)


def identity_of(record: dict, fmt: str = "") -> str:
    """What makes two records the same task, for the train/held-out split and overlap check: the prompt
    (:func:`question_of`), or for an environment's rows (format ``rows``) the whole row."""
    if fmt == "rows":
        return json.dumps(record, sort_keys=True, default=str)
    from grpolab.data.images import images_identity

    return question_of(record) + images_identity(record)  # the same question about another picture is another task
