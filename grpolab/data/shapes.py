"""The built-in visual task: count the shapes of one colour in a small picture.

A question shows a plain background with a few filled squares and circles and asks
for the shapes of one colour::

    {"question": "How many red shapes are there?", "image": <PIL RGB 32x32>, "answer": "3"}

Between 1 and ``max_count`` shapes have the asked colour; up to ``max_distractors``
more have other colours. Shapes never overlap or touch (a gap of at least one pixel),
and are drawn without anti-aliasing, so each is one connected region of exactly its
colour and a test can recount them from the pixels alone.

As in :mod:`grpolab.data.arithmetic`, the held-out *test* set comes from a fixed seed
and training draws are a pure function of ``(seed, step)`` that reject any question
(text and pixels) of the test set.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from grpolab.common import streams

TEST_SEED = 20_240_101  # fixed forever: changing it changes every reported accuracy
TEST_SIZE = 200
"""Questions of the standard held-out set, all of which training draws exclude."""

PALETTE = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (40, 60, 220),
    "yellow": (230, 200, 20),
}
BACKGROUND = (255, 255, 255)
KINDS = ("square", "circle")


@dataclasses.dataclass(frozen=True)
class ShapesSpec:
    """Difficulty of the generated pictures."""

    image_size: int = 32
    """Side of the square picture in pixels."""
    min_side: int = 5
    """Smallest side of a shape's bounding box in pixels."""
    max_side: int = 8
    """Largest side of a shape's bounding box in pixels."""
    max_count: int = 4
    """Most shapes of the asked colour (at least 1): the answers are 1..max_count."""
    max_distractors: int = 3
    """Most shapes of other colours (at least 0)."""
    colours: tuple[str, ...] = tuple(PALETTE)
    """Colours to draw and ask about, names from ``PALETTE``."""

    def __post_init__(self) -> None:
        """Refuse specs whose shapes could not fit or whose questions would be malformed."""
        if not 1 <= self.min_side <= self.max_side <= self.image_size // 2:
            raise ValueError(f"need 1 <= min_side <= max_side <= image_size/2, got {self}")
        if self.max_count < 1 or self.max_distractors < 0:
            raise ValueError(f"max_count must be >= 1 and max_distractors >= 0, got {self}")
        unknown = set(self.colours) - set(PALETTE)
        if unknown or len(self.colours) < 2:
            raise ValueError(f"colours must be at least two of {tuple(PALETTE)}, got {self.colours}")


class Shape(NamedTuple):
    """One filled shape: its bounding box is ``[x, x + side) x [y, y + side)`` in pixels."""

    kind: str
    colour: str
    x: int
    y: int
    side: int


def _place(rng: np.random.Generator, spec: ShapesSpec, placed: list[Shape], kind: str, colour: str) -> Shape:
    """A shape at a random spot whose box, grown by one pixel, misses every placed box (rejection sampling)."""
    for _ in range(1000):
        side = int(rng.integers(spec.min_side, spec.max_side + 1))
        x, y = rng.integers(0, spec.image_size - side + 1, size=2).tolist()
        if all(x + side < p.x or p.x + p.side < x or y + side < p.y or p.y + p.side < y for p in placed):
            return Shape(kind, colour, x, y, side)
    raise RuntimeError(f"no room for {len(placed) + 1} shapes in {spec}: enlarge image_size or shrink the shapes")


def _scene(rng: np.random.Generator, spec: ShapesSpec) -> tuple[str, list[Shape]]:
    """The asked colour and the shapes of a picture: 1..max_count of that colour, 0..max_distractors of others."""
    asked = spec.colours[int(rng.integers(len(spec.colours)))]
    others = [c for c in spec.colours if c != asked]
    colours = [asked] * int(rng.integers(1, spec.max_count + 1))
    colours += [others[int(i)] for i in rng.integers(len(others), size=int(rng.integers(spec.max_distractors + 1)))]
    shapes: list[Shape] = []
    for i in rng.permutation(len(colours)).tolist():  # the asked colour is not always placed first
        shapes.append(_place(rng, spec, shapes, KINDS[int(rng.integers(len(KINDS)))], colours[i]))
    return asked, shapes


def render(shapes: list[Shape], spec: ShapesSpec) -> Image.Image:
    """The RGB picture of ``shapes`` on the plain background (no anti-aliasing: every pixel is one exact colour)."""
    image = Image.new("RGB", (spec.image_size, spec.image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for s in shapes:
        box = (s.x, s.y, s.x + s.side - 1, s.y + s.side - 1)  # PIL boxes include their last pixel
        if s.kind == "square":
            draw.rectangle(box, fill=PALETTE[s.colour])
        else:
            draw.ellipse(box, fill=PALETTE[s.colour])
    return image


def make_question(rng: np.random.Generator, spec: ShapesSpec = ShapesSpec()) -> dict:
    """Draw one question: ``{"question": str, "image": PIL RGB image, "answer": "<count>"}``."""
    asked, shapes = _scene(rng, spec)
    count = sum(s.colour == asked for s in shapes)
    return {"question": f"How many {asked} shapes are there?", "image": render(shapes, spec), "answer": str(count)}


def question_key(record: dict) -> str:
    """A digest of a question's text and pixels: two questions with the same key are the same question."""
    return hashlib.sha1(record["question"].encode() + record["image"].tobytes()).hexdigest()


def test_set(n: int = TEST_SIZE, spec: ShapesSpec = ShapesSpec()) -> list[dict]:
    """The fixed held-out evaluation set: the first ``n`` questions drawn from ``TEST_SEED``."""
    rng = np.random.default_rng(TEST_SEED)
    return [make_question(rng, spec) for _ in range(n)]


def draw(
    seed: int, step: int, n: int, spec: ShapesSpec = ShapesSpec(), exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """``n`` training questions of ``step``, a pure function of ``(seed, step)``, none whose key is in ``exclude``.

    Keying the draw on the step (not on a running generator) makes a resumed run draw what an
    uninterrupted one would, with no sampler state to checkpoint. Pass ``exclude`` =
    ``{question_key(r) for r in test_set()}`` to never train on a test question.
    """
    rng = np.random.default_rng([streams.TRAIN_DRAW, seed, step])
    out: list[dict] = []
    while len(out) < n:
        record = make_question(rng, spec)
        if question_key(record) not in exclude:
            out.append(record)
    return out


def write_task(out, train: int = 4000, held_out: int = TEST_SIZE, seed: int = 0, spec: ShapesSpec = ShapesSpec()):
    """The task as files any ``--data`` reader takes: ``out/train.jsonl`` (``train`` questions drawn from ``seed``,
    none of the held-out set) and ``out/test.jsonl`` (the first ``held_out`` of the fixed held-out set), each line
    ``{"prompt", "image", "ground_truth"}`` with its picture a PNG under ``out/images/``. Returns the two paths."""
    import json
    from pathlib import Path

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    tests = test_set(held_out, spec)
    exclude = frozenset(question_key(r) for r in test_set(TEST_SIZE, spec))
    paths = []
    for name, records in (("test", tests), ("train", draw(seed, 0, train, spec, exclude))):
        lines = []
        for i, r in enumerate(records):
            image = f"images/{name}-{i}.png"
            r["image"].save(out / image)
            lines.append(json.dumps({"prompt": r["question"], "image": image, "ground_truth": r["answer"]}))
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        paths.append(out / f"{name}.jsonl")
    return paths[1], paths[0]
