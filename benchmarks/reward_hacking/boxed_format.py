"""Score MATH-format loophole completions and honest final answers with grpolab's format_reward.

    PYTHONPATH=CHECKOUT python benchmarks/reward_hacking/boxed_format.py

CHECKOUT is the grpolab whose format_reward is scored (a worktree of an older commit shows what paid before the
bonus asked for a final box: docs/reward-hacking.md)."""

import grpolab
from grpolab.rewards.builtin import format_reward

CASES = [
    ("loophole: bare '\\boxed{'", "\\boxed{"),
    ("loophole: '\\boxed{' + junk", "\\boxed{ asdf qwer zxcv lorem ipsum"),
    ("loophole: box mid-text, more text after", "The answer is \\boxed{7}, or maybe 8; let me check again."),
    ("loophole: closed box then unclosed one", "\\boxed{7} \\boxed{"),
    ("loophole: empty box", "\\boxed{}"),
    ("loophole: blank box", "\\boxed{  }."),
    ("loophole: stray brace after the box", "\\boxed{7}}"),
    ("honest: $\\boxed{\\frac{1}{2}}$.", "1/4 + 1/4 = 1/2, so the answer is $\\boxed{\\frac{1}{2}}$."),
    ("honest: nested braces", "Nested: \\boxed{\\sqrt{x^{2} + 1}}"),
    ("honest: **$\\boxed{7}$**", "**Answer:** **$\\boxed{7}$**"),
    ("honest: \\[\\boxed{7}\\]", "\\[\\boxed{7}\\]\n"),
    ("honest: $$\\boxed{7}$$", "$$\\boxed{7}$$  \n"),
    ("no box", "no box at all: 7"),
]

print(f"grpolab from {grpolab.__file__}")
print(f"{'case':<45} format_reward (math record)")
for name, text in CASES:
    (r,) = format_reward([text], [{"format": "math"}])
    print(f"{name:<45} {r:g}")
