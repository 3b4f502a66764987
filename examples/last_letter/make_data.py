"""Make the last-letter task: "What is the last letter of 'kelu'?" -> "u".

A task grpolab does not ship, made by code so that nothing is downloaded: pronounceable made-up
words of 3 to 5 letters (consonant-vowel patterns, so the tokenizer splits them into a few familiar
pieces), each asked once. Written as Parquet files with a conversational ``prompt`` column (a list of
chat messages) and the columns the reward reads:

    prompt    [{"role": "user", "content": "What is the last letter of 'kelu'? Reply with the letter only."}]
    word      kelu
    target    u
    category  4 letters

    python examples/last_letter/make_data.py --out data/last_letter   # train.parquet, test.parquet

Train on it with the reward in reward.py (TRL's form): see README.md beside this file.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
INSTRUCTION = "What is the last letter of '{word}'? Reply with the letter only."


def made_up_word(rng: random.Random, length: int) -> str:
    """Consonant, vowel, consonant, ... of ``length`` letters."""
    return "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(length))


def rows(n: int, seed: int) -> list[dict]:
    """``n`` distinct words (3 to 5 letters, lengths equally likely) as task rows."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        word = made_up_word(rng, rng.choice((3, 4, 5)))
        if word in seen:
            continue
        seen.add(word)
        out.append(
            {
                "prompt": [{"role": "user", "content": INSTRUCTION.format(word=word)}],
                "word": word,
                "target": word[-1],
                "category": f"{len(word)} letters",
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/last_letter", help="output directory")
    parser.add_argument("--train", type=int, default=2000, help="training rows")
    parser.add_argument("--test", type=int, default=300, help="held-out rows (words never in training)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import datasets

    datasets.disable_progress_bars()

    every = rows(args.train + args.test, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(every[: args.train]).to_parquet(str(out / "train.parquet"))
    datasets.Dataset.from_list(every[args.train :]).to_parquet(str(out / "test.parquet"))
    print(f"wrote {args.train} training and {args.test} held-out rows to {out}/train.parquet, test.parquet")


if __name__ == "__main__":
    main()
