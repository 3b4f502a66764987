"""The data and rewards of the examples, made in code (no download): shared by the scripts beside this file.

The prompts are chat messages (TRL's conversational format) or, with ``plain=True``, the question itself (TRL's
standard format, for a model with no chat template such as grpolab's built-in one). Rewards are in TRL's form:
the dataset's other columns arrive as keyword lists, one value per completion.
"""

import argparse
import random

from datasets import Dataset


def arguments(description: str, **defaults) -> argparse.Namespace:
    """The flags every script takes, so that a test can make a run tiny and CPU-safe."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: smollm2.py's SmolLM2)")
    parser.add_argument("--max-steps", type=int, default=defaults.get("max_steps", 20))
    parser.add_argument("--output-dir", default=defaults.get("output_dir", "SmolLM2-135M-GRPO"))
    parser.add_argument("--use-cpu", action="store_true", help="GRPOConfig(use_cpu=True): TRL's bf16 needs a GPU")
    parser.add_argument("--plain", action="store_true", help="plain-text prompts, for a model with no chat template")
    args = parser.parse_args()
    if args.model is None:
        from smollm2 import smollm2_dir

        args.model = str(smollm2_dir())
    return args


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    syllable = lambda i: rng.choice("bdfgklmnprstvz" if i % 2 == 0 else "aeiou")  # noqa: E731
    return ["".join(syllable(i) for i in range(rng.choice((3, 4, 5)))) for _ in range(n)]


def _prompt(question: str, plain: bool):
    return question if plain else [{"role": "user", "content": question}]


def last_letter_dataset(n: int = 256, seed: int = 0, plain: bool = False) -> Dataset:
    """Made-up words of 3 to 5 letters: "What is the last letter of 'kelu'? Reply with the letter only.", column
    ``target`` the word's last letter."""
    return Dataset.from_list(
        [
            {
                "prompt": _prompt(f"What is the last letter of '{w}'? Reply with the letter only.", plain),
                "target": w[-1],
            }
            for w in _words(n, seed)
        ]
    )


def multiplication_dataset(n: int = 256, seed: int = 0, plain: bool = False) -> Dataset:
    """Two- and three-digit products, "What is 347 multiplied by 58?", column ``answer``."""
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 999), rng.randint(10, 99)) for _ in range(n)]
    return Dataset.from_list(
        [{"prompt": _prompt(f"What is {a} multiplied by {b}?", plain), "answer": str(a * b)} for a, b in pairs]
    )


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def last_letter(completions, target, **kwargs) -> list[float]:
    """1.0 when the reply's last letter character is the word's last letter, case ignored."""
    letters = [[ch for ch in _text(c).lower() if ch.isalpha()] for c in completions]
    return [float(bool(ls) and ls[-1] == t) for ls, t in zip(letters, target)]


def short(completions, **kwargs) -> list[float]:
    """1.0 for a reply of at most 3 characters: the letter alone."""
    return [float(len(_text(c).strip()) <= 3) for c in completions]


def correct(completions, answer, **kwargs) -> list[float]:
    """1.0 when the final reply contains the product."""
    return [float(a in _text(c)) for c, a in zip(completions, answer)]
