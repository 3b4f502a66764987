"""A scripted rollout engine: completions chosen by each row's rollout key, no model."""

from __future__ import annotations

import torch

from grpolab.common.batch import Batch, left_pad
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.sampler import Sampled

RIGHT, WRONG = "#### 7", "#### 0"


class ScriptedEngine:
    """A real rollout engine (the :class:`grpolab.rollout.engine.RolloutEngine` contract), not a model: rollout g
    of any prompt is ``answers[g % len(answers)]`` then EOS; log-prob -0.5 and entropy 1.5 per token."""

    def __init__(self, tokenizer, answers=(RIGHT, WRONG)):
        self.tokenizer, self.answers = tokenizer, answers
        self.calls: list[tuple[list, list, SamplingSettings]] = []
        self.weight_updates = 0

    def generate(self, prompts, keys, settings, media=None) -> Sampled:
        self.calls.append((prompts, keys, settings))
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        completions = [
            self.tokenizer(self.answers[key[-1] % len(self.answers)], add_special_tokens=False)["input_ids"] + [eos]
            for key in keys
        ]
        prompt_ids, prompt_mask = left_pad(prompts, pad)  # [N, P]
        T = max(len(c) for c in completions)
        ids = torch.full((len(keys), T), pad, dtype=torch.long)
        mask = torch.zeros((len(keys), T), dtype=torch.long)
        for i, c in enumerate(completions):
            ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
        batch = Batch(prompt_ids, prompt_mask, ids, mask)
        return Sampled(batch, -0.5 * mask.float(), 1.5 * mask.float())

    def weights_changed(self) -> None:
        self.weight_updates += 1
