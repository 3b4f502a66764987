"""Environments and tools written for the tests, importable as ``env_fixtures:NAME`` (conftest.py puts tests/ on
sys.path), and a scripted rollout engine that answers by rollout and turn.

They are real environments and tools, run by grpolab as a user's would be; only the policy's replies are scripted
(:class:`TurnEngine`), so that what the trainer makes of them can be computed by hand.
"""

from __future__ import annotations

import time

import torch

from grpolab.common import streams
from grpolab.common.batch import Batch, left_pad
from grpolab.rollout.sampler import Sampled


class Echo:
    """Two turns: the user says 'go'; after the first reply the environment says 'again'; the episode ends after the
    second reply. A reply of 'yes' earns 1 at its turn, anything else 0."""

    max_return = 2.0

    def reset(self, record: dict) -> list[dict]:
        self.turn = 0
        return [{"role": "user", "content": record.get("prompt", "go")}]

    def step(self, text: str):
        self.turn += 1
        reward = 1.0 if text.strip() == "yes" else 0.0
        if self.turn == 2:
            return [], reward, True
        return [{"role": "user", "content": "again"}], reward, False


class EchoLast(Echo):
    """:class:`Echo` whose policy sees only the latest message at each turn (each turn its own token sequence)."""

    history = False


class Forever(Echo):
    """Never ends: every reply gets 'more' back (the limits must cut it)."""

    def step(self, text: str):
        return [{"role": "user", "content": "more"}], 0.0, False


class NoReset:
    """Not an environment of either shape: no reset."""

    def step(self, text: str):
        return [], 0.0, True


class NeedsArgs(Echo):
    def __init__(self, level: int):
        self.level = level


class BadStep(Echo):
    """step returns two values instead of three."""

    def step(self, text: str):
        return [], 1.0


class BadRole(Echo):
    def step(self, text: str):
        return [{"role": "assistant", "content": "I answer myself"}], 0.0, False


class StepRaises(Echo):
    """step raises on the second turn (the run must go on, the episode cut and counted)."""

    def step(self, text: str):
        if getattr(self, "turn", 0) >= 1:
            raise RuntimeError("the game server went away")
        return super().step(text)


# ---------------------------------------------------------------------- tools
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the numerator
        b: the denominator
    """
    return a / b


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def huge(megabytes: int) -> str:
    """A result of this many megabytes.

    Args:
        megabytes: the size
    """
    return "x" * (megabytes << 20)


def shout(text: str) -> str:
    """Print to stdout (the worker's replies must not see it) and return the text in capitals.

    Args:
        text: what to shout
    """
    print("this goes to the tool's stdout")
    return text.upper()


async def add_later(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: the first
        b: the second
    """
    import asyncio

    await asyncio.sleep(0)
    return a + b


def no_docstring(a: int) -> int:
    return a


# ---------------------------------------------------------------------- a scripted policy
def turn_of(key: tuple) -> tuple[int, int]:
    """(rollout g, turn h) of a reply's key: (ROLLOUT, seed, step, b, g) at turn 0, (TURN, ROLLOUT, ..., g, h)."""
    if key[0] == streams.TURN:
        return key[-2], key[-1]
    return key[-1], 0


class TurnEngine:
    """A rollout engine whose reply to rollout g at turn h is ``script(g, h)`` then EOS (log-prob -0.5 and entropy
    1.5 per token); it records the prompts it was given."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.calls: list[tuple[list, list, object]] = []

    def generate(self, prompts, keys, settings, media=None) -> Sampled:
        self.calls.append((prompts, keys, settings))
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        replies = [
            (self.tokenizer(self.script(*turn_of(k)), add_special_tokens=False)["input_ids"] + [eos])[
                : settings.max_new_tokens
            ]
            for k in keys
        ]
        prompt_ids, prompt_mask = left_pad(prompts, pad)
        T = max(len(c) for c in replies)
        ids = torch.full((len(keys), T), pad, dtype=torch.long)
        mask = torch.zeros((len(keys), T), dtype=torch.long)
        for i, c in enumerate(replies):
            ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
        return Sampled(Batch(prompt_ids, prompt_mask, ids, mask), -0.5 * mask.float(), 1.5 * mask.float())

    def weights_changed(self) -> None:
        pass


class ShowsAPicture:
    """An episode whose answer needs the picture it returns: the opening asks the policy to ask for it; the
    environment's answer to the first reply is the picture (an image part, TRL's form for a tool that returns one) of
    the row's colour and the question; the second reply earns 1 when it holds the colour's first letter."""

    COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}

    def reset(self, record: dict) -> list[dict]:
        self.colour, self.shown = record["answer"], False
        return [{"role": "user", "content": "Say show to see the picture."}]

    def step(self, text: str):
        from PIL import Image

        if not self.shown:
            self.shown = True
            picture = Image.new("RGB", (32, 28), self.COLOURS[self.colour])
            shown = [{"type": "image", "image": picture}, {"type": "text", "text": "Which colour?"}]
            return [{"role": "user", "content": shown}], 0.0, False
        return [], float(self.colour[0] in text), True
