"""Make a GSM8K-format file of short arithmetic word problems, by code (nothing is downloaded).

Each line is a GSM8K record: a ``question``, an ``answer`` that works the sum out and ends with
``#### <number>``, and a ``category`` (the kind of problem). grpolab reads such a file as the GSM8K
preset (``--format auto``): the prompt asks for the final answer after ``####`` and the built-in
answer check scores it, so no reward function is needed.

    {"question": "Ana has 12 apples and buys 7 more. How many apples does she have now?",
     "answer": "12 + 7 = 19\\n#### 19", "category": "add"}

    python examples/word_problems/make_data.py --out data/word_problems   # train.jsonl, test.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mo", "Nia"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "shells", "cards", "stamps"]


def _add(rng: random.Random) -> tuple[str, str, int]:
    name, thing, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(2, 60), rng.randint(2, 40)
    return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", f"{a} + {b}", a + b


def _sub(rng: random.Random) -> tuple[str, str, int]:
    name, thing, a = rng.choice(NAMES), rng.choice(THINGS), rng.randint(10, 90)
    b = rng.randint(1, a - 1)
    return f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?", f"{a} - {b}", a - b


def _mul(rng: random.Random) -> tuple[str, str, int]:
    name, a, b = rng.choice(NAMES), rng.randint(2, 12), rng.randint(2, 15)
    return f"{name} reads {a} pages a day for {b} days. How many pages does {name} read?", f"{a} * {b}", a * b


def _div(rng: random.Random) -> tuple[str, str, int]:
    name, thing, share, k = rng.choice(NAMES), rng.choice(THINGS), rng.randint(2, 12), rng.randint(2, 9)
    total = share * k
    question = f"{name} shares {total} {thing} equally among {k} friends. How many {thing} does each friend get?"
    return question, f"{total} / {k}", share


def _two_step(rng: random.Random) -> tuple[str, str, int]:
    name, a, b = rng.choice(NAMES), rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, min(20, a * b - 1))
    question = f"{name} buys {a} bags with {b} oranges in each and eats {c}. How many oranges are left?"
    return question, f"{a} * {b} - {c}", a * b - c


KINDS = {"add": _add, "sub": _sub, "mul": _mul, "div": _div, "two-step": _two_step}


def records(n: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    """``n`` distinct problems whose question is not in ``exclude``, the kinds in turn."""
    out = []
    while len(out) < n:
        kind = list(KINDS)[len(out) % len(KINDS)]
        question, work, value = KINDS[kind](rng)
        if question in exclude:
            continue
        exclude.add(question)
        out.append({"question": question, "answer": f"{work} = {value}\n#### {value}", "category": kind})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/word_problems", help="output directory")
    parser.add_argument("--train", type=int, default=1000, help="training problems")
    parser.add_argument("--test", type=int, default=200, help="held-out problems (none repeats a training one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, seen = random.Random(args.seed), set()
    test = records(args.test, rng, seen)
    train = records(args.train, rng, seen)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} training and {len(test)} held-out problems to {out}")


if __name__ == "__main__":
    main()
