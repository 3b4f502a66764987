"""The multi-turn arithmetic dialogue on a language-model policy.

A dialogue has H turns. Turn 1 asks a two-step question ``a+b-c`` (the built-in task's
``add_sub_2`` shape); turn h > 1 asks ``<previous answer>+d-e``: the first operand is the
answer the *policy* gave at turn h-1. Each turn's reward is 1 if its answer equals the
true running value of the chain, else 0. So a wrong turn changes the states that follow:
the next question starts from a wrong number and its true answer is out of reach, the
value of every later state drops (the ``chain`` environment with q0 near 0).

What the policy sees at turn h (``context``): ``"question"`` (default) shows the turn's
question alone, which carries the previous result, so it is the Markov state of the task;
``"dialogue"`` shows the earlier turns' questions and answers too. The built-in 0.5 M model
was trained on single questions with a 128-token window: with earlier turns in its context
it solved 0 of 100 second turns that it solved 42 of 100 times alone (measured while
building this), so ``"question"`` is the default; a real LLM can take ``"dialogue"``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from grpolab import streams
from grpolab.answers import extract_final_number, numbers_equal
from grpolab.policy import Policy
from grpolab.rollout import Batch, left_pad, sample

EVAL_DIALOGUE_SEED = 20_240_003  # the held-out dialogues


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
    """n dialogues: the operands of every turn and the true running values."""
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
        out.append({"steps": steps, "truths": truths})
    return out


def question(dialogue: dict, h: int, prev: str | None) -> str:
    """Turn h's question (h counts from 0 here); ``prev`` is the policy's answer at turn h-1."""
    st = dialogue["steps"][h]
    first = str(st["first"]) if h == 0 else (prev if prev is not None else "?")
    return first + "".join(f"{op}{x}" for op, x in zip(st["ops"], st["nums"]))


@dataclasses.dataclass
class Turns:
    """Rollouts of M trajectories over turns h0 .. H-1 (0-based)."""

    rewards: torch.Tensor  # [M, H - h0]
    answers: list[list[str | None]]  # [H - h0][M] parsed answers
    batches: list[Batch]  # one per turn: the M rows as sampled (prompt = what the policy saw)
    questions: list[list[str]]  # [H - h0][M]


def play(
    policy: Policy,
    dialogues: list[dict],
    prev: list[str | None],
    h0: int,
    keys: list[tuple],
    spec: DialogueSpec,
    *,
    max_new_tokens: int,
    temperature: float,
    history: list[str] | None = None,
) -> Turns:
    """Play turns h0 .. H-1 of each dialogue, from ``prev`` (the answer before turn h0).

    ``keys[m]`` seeds trajectory m; turn h draws from stream (*keys[m], h).
    ``history``: the dialogue text so far, for ``context = "dialogue"``.
    """
    M = len(dialogues)
    prev = list(prev)
    hist = list(history) if history is not None else [""] * M
    rewards, answers, batches, questions = [], [], [], []
    for h in range(h0, spec.stages):
        qs = [question(d, h, p) for d, p in zip(dialogues, prev)]
        texts_in = [hi + q for hi, q in zip(hist, qs)] if spec.context == "dialogue" else qs
        prompts = [policy.prompt_ids({"question": t}) for t in texts_in]
        batch = sample(
            policy.model,
            prompts,
            [(*k, h) for k in keys],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=1.0,
            eos_id=policy.eos_id,
            pad_id=policy.pad_id,
        )
        texts = policy.decode(batch.completion_ids, batch.completion_mask)
        ans = [extract_final_number(t) for t in texts]
        r = [1.0 if numbers_equal(a, str(d["truths"][h])) else 0.0 for a, d in zip(ans, dialogues)]
        rewards.append(torch.tensor(r, dtype=torch.float64))
        answers.append(ans)
        batches.append(batch)
        questions.append(qs)
        hist = [hi + q + "\n" + t + "\n" for hi, q, t in zip(hist, qs, texts)]
        prev = ans
    return Turns(
        torch.stack(rewards, dim=1) if rewards else torch.zeros(M, 0, dtype=torch.float64), answers, batches, questions
    )


def branch_values(
    policy: Policy,
    dialogues: list[dict],
    prev: list[str | None],
    h: int,
    branches: int,
    key: tuple,
    spec: DialogueSpec,
    *,
    max_new_tokens: int,
    temperature: float,
    chunk: int = 512,
    first_index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo value of each state (dialogue, turn h, previous answer): mean and variance of the
    reward-to-go over ``branches`` fresh continuations. Returns ``[M]`` means and ``[M]`` variances of the mean.

    State m's branches draw from streams keyed by its index ``first_index + m`` in the whole batch
    (a rank holding states from ``first_index`` on draws what one process would)."""
    M = len(dialogues)
    rep_d = [d for d in dialogues for _ in range(branches)]
    rep_p = [p for p in prev for _ in range(branches)]
    keys = [(streams.BRANCH, *key, first_index + m, b) for m in range(M) for b in range(branches)]
    rtg = []
    for i in range(0, len(rep_d), chunk):  # bounded batches: branching multiplies the rows
        t = play(
            policy,
            rep_d[i : i + chunk],
            rep_p[i : i + chunk],
            h,
            keys[i : i + chunk],
            spec,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
        )
        rtg.append(t.rewards.sum(dim=1))
    g = torch.cat(rtg).view(M, branches)
    var = g.var(dim=1, unbiased=True) / branches if branches > 1 else torch.zeros(M, dtype=torch.float64)
    return g.mean(dim=1), var


def rows_batch(batches: list[Batch], pad_id: int) -> Batch:
    """Stack per-turn batches (different prompts and lengths) into one batch of turn-rows."""
    prompts = [row[m.bool()].tolist() for b in batches for row, m in zip(b.prompt_ids, b.prompt_mask)]
    comps = [row[m.bool()].tolist() for b in batches for row, m in zip(b.completion_ids, b.completion_mask)]
    p_ids, p_mask = left_pad(prompts, pad_id)
    T = max(1, max(len(c) for c in comps))
    c_ids = torch.full((len(comps), T), pad_id, dtype=torch.long)
    c_mask = torch.zeros(len(comps), T, dtype=torch.long)
    for i, c in enumerate(comps):
        c_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, : len(c)] = 1
    device = batches[0].prompt_ids.device  # the model's, where the turns were sampled
    return Batch(*(t.to(device) for t in (p_ids, p_mask, c_ids, c_mask)))


def stage_advantages(rewards: torch.Tensor, advantage: str, v_mc: torch.Tensor | None = None) -> torch.Tensor:
    """Per-stage advantages ``[B, G, H]`` from per-stage rewards ``[B, G, H]``.

    ``grpo``: total return - group mean of totals [Foundations, Eq. 22], the same at every stage;
    ``rtg-group``: reward-to-go - group mean of totals;
    ``rtg-mc``: reward-to-go - ``v_mc`` ``[B, G, H]``, a Monte Carlo value of each stage's state.
    """
    total = rewards.sum(dim=2, keepdim=True)  # [B, G, 1]
    base = total.mean(dim=1, keepdim=True)  # [B, 1, 1] group baseline of the initial state
    rtg = rewards.flip(2).cumsum(2).flip(2)  # [B, G, H]
    if advantage == "grpo":
        return (total - base).expand_as(rewards).clone()
    if advantage == "rtg-group":
        return rtg - base
    if advantage == "rtg-mc":
        if v_mc is None:
            raise ValueError("rtg-mc needs Monte Carlo values of the stages' states")
        return rtg - v_mc
    raise ValueError(f"unknown --advantage {advantage!r}; choose grpo, rtg-group or rtg-mc")
