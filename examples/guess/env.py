"""A stateful game for ``grpolab train --env examples/guess/env.py:Guess``: find a number from 1 to 20 in four
guesses, told "higher" or "lower" after each one.

What the environment says back depends on the guess, so each turn's question is the policy's own doing. Rewards
come at every turn: 1 for the number (the game ends), 0.1 for a wrong guess still consistent with everything said
so far (inside the range the answers leave), 0 otherwise (a guess the answers already ruled out, or no number).
The return is at most 1.3 (three consistent misses, then the number).
"""

from __future__ import annotations

import re

LOW, HIGH, GUESSES = 1, 20, 4
_NUMBER = re.compile(r"-?\d+")


class Guess:
    history = True  # the policy sees the whole game
    max_return = 1.0 + 0.1 * (GUESSES - 1)

    def reset(self, record: dict) -> list[dict]:
        self.secret, self.lo, self.hi, self.left = int(record["secret"]), LOW, HIGH, GUESSES
        return [
            {
                "role": "user",
                "content": f"I am thinking of a number from {LOW} to {HIGH}. You have {GUESSES} guesses; after each "
                "one I say higher or lower. Reply with your guess only, one number.",
            }
        ]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        numbers = _NUMBER.findall(text)
        self.left -= 1
        if not numbers:
            return [{"role": "user", "content": f"Reply with one number from {self.lo} to {self.hi}."}], 0.0, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return [{"role": "user", "content": "Correct!"}], 1.0, True
        reward = 0.1 if self.lo <= guess <= self.hi else 0.0
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            hint = "Higher."
        else:
            self.hi = min(self.hi, guess - 1)
            hint = "Lower."
        if self.left == 0:
            return [{"role": "user", "content": f"{hint} No guesses left: it was {self.secret}."}], reward, True
        return (
            [{"role": "user", "content": f"{hint} {self.left} guess{'es' if self.left > 1 else ''} left."}],
            reward,
            False,
        )
