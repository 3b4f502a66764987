"""The multi-turn arithmetic dialogue (``--task arith-multiturn``), an environment like any user's.

A dialogue has H turns. Turn 1 asks a two-step question ``a+b-c`` (the built-in task's ``add_sub_2`` shape); turn
h > 1 asks ``<previous answer>+d-e``: the first operand is the answer the *policy* gave at turn h-1. Each turn's
reward is 1 if its answer equals the true running value of the chain, else 0. So a wrong turn changes the states
that follow: the next question starts from a wrong number and its true answer is out of reach, the value of every
later state drops (the ``chain`` environment of ``grpolab.analysis.multiturn_chain`` with q0 near 0).

What the policy sees at a turn (``context``): ``"question"`` (default) shows the turn's question alone, which
carries the previous result, so it is the Markov state of the task (the environment's ``history`` is False: each
turn is its own token sequence); ``"dialogue"`` shows the whole conversation. The built-in 0.5 M model was trained
on single questions with a 128-token window: with earlier turns in its context it solved 0 of 100 second turns that
it solved 42 of 100 times alone (measured while building the dialogue), so ``"question"`` is the default; a real
LLM can take ``"dialogue"``.
"""

from __future__ import annotations

from grpolab.data.answers import extract_final_number, numbers_equal
from grpolab.data.dialogues import DialogueSpec, question


class ArithDialogue:
    """One dialogue (a record of :func:`grpolab.data.dialogues.make_dialogues`) played turn by turn; reward 1 per right answer."""

    def __init__(self, spec: DialogueSpec | None = None):
        self.spec = spec = spec or DialogueSpec()
        self.history = spec.context == "dialogue"
        self.max_return = float(spec.stages)  # accuracy: the share of turns answered right

    def reset(self, record: dict) -> list[dict]:
        self.dialogue, self.h = record, 0
        return [{"role": "user", "content": question(record, 0, None)}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        answer = extract_final_number(text)
        reward = 1.0 if numbers_equal(answer, str(self.dialogue["truths"][self.h])) else 0.0
        self.h += 1
        if self.h >= self.spec.stages:
            return [], reward, True
        return [{"role": "user", "content": question(self.dialogue, self.h, answer)}], reward, False
