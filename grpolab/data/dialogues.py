"""The records of the multi-turn arithmetic dialogue (``--task arith-multiturn``): each dialogue's operands and running truths, the held-out set, and the per-step training sampler. The environment that plays them is :class:`grpolab.env.arith.ArithDialogue`."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

EVAL_DIALOGUE_SEED = 20_240_003  # the held-out dialogues


N_EVAL_DIALOGUES = 100


@dataclasses.dataclass(frozen=True)
class DialogueSpec:
    stages: int = 3
    max_operand: int = 50
    context: str = "question"

    def __post_init__(self):
        if self.stages < 1:
            raise ValueError(f"--stages must be >= 1, got {self.stages}")
        if self.context not in ("question", "dialogue"):
            raise ValueError(f"--context must be 'question' or 'dialogue', got {self.context!r}")


def make_dialogues(n: int, seed: int, spec: DialogueSpec) -> list[dict]:
    """n dialogues: the operands of every turn and the true running values (``question``: the first turn's, for
    logs)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        steps, truths = [], []
        value = None
        for h in range(spec.stages):
            ops = rng.choice(["+", "-"], size=2).tolist()
            nums = rng.integers(1, spec.max_operand + 1, size=3 if h == 0 else 2).tolist()
            if h == 0:
                value = nums[0]
                nums_after = nums[1:]
            else:
                nums_after = nums
            for op, x in zip(ops, nums_after):
                value = value + x if op == "+" else value - x
            steps.append({"first": nums[0] if h == 0 else None, "ops": ops, "nums": nums_after})
            truths.append(value)
        dialogue = {"steps": steps, "truths": truths, "category": "dialogue"}
        out.append({**dialogue, "question": question(dialogue, 0, None)})
    return out


def question(dialogue: dict, h: int, prev: str | None) -> str:
    """Turn h's question (h counts from 0 here); ``prev`` is the policy's answer at turn h-1."""
    st = dialogue["steps"][h]
    first = str(st["first"]) if h == 0 else (prev if prev is not None else "?")
    return first + "".join(f"{op}{x}" for op, x in zip(st["ops"], st["nums"]))


class DialogueSampler:
    """Training dialogues of a step, keyed by (seed, step) (so a resumed run draws the same), none of them held
    out."""

    def __init__(self, spec: DialogueSpec, seed: int, held_out: list[dict]):
        self.spec, self.seed = spec, seed
        self.held = {str(d["steps"]) for d in held_out}

    def draw(self, step: int, n: int, round: int = 0) -> list[dict]:
        key = f"dialogues/{self.seed}/{step}" + (f"/{round}" if round else "")
        drawn = make_dialogues(n * 2, zlib.crc32(key.encode()), self.spec)
        return [d for d in drawn if str(d["steps"]) not in self.held][:n]


def dialogue_task(stages: int, max_operand: int, context: str, eval_questions: int, seed: int):
    """``(held_out, sampler, spec)`` of ``--task arith-multiturn``. Operands stay at most 50 (the single-turn default
    of 99 makes later turns' numbers too large for the built-in model); a smaller --max-operand makes them smaller."""
    spec = DialogueSpec(stages, max_operand=min(max_operand, 50), context=context)
    held_out = make_dialogues(min(eval_questions, N_EVAL_DIALOGUES), EVAL_DIALOGUE_SEED, spec)
    return held_out, DialogueSampler(spec, seed, held_out), spec
