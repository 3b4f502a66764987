"""Write the calculator task: 3-digit multiplications, which SmolLM2-135M-Instruct gets wrong without a tool.

Each row: ``prompt`` (a chat: one worked example of calling the calculator, then the question), ``answer`` (the
product, as text) and ``category`` (``3x3``). The test set is fixed; no training question is a test question.

    python examples/calculator/make_data.py [--train 2000] [--test 100] [--seed 0] [--out data/calculator]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HINT = " Use the calculator tool."


def example(a: int, b: int) -> list[dict]:
    """One worked example: the question, the tool call, its result and the answer."""
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    return [
        {"role": "user", "content": f"What is {a} * {b}?{HINT}"},
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"{a} * {b} = {a * b}"},
    ]


def questions(n: int, rng: random.Random, exclude: set[tuple[int, int]]) -> list[dict]:
    out, seen = [], set(exclude)
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        prompt = example(12, 34) + [{"role": "user", "content": f"What is {a} * {b}?{HINT}"}]
        out.append({"prompt": prompt, "a": a, "b": b, "answer": str(a * b), "category": "3x3"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="data/calculator")
    args = ap.parse_args()
    test = questions(args.test, random.Random(10_000 + args.seed), set())
    train = questions(args.train, random.Random(args.seed), {(r["a"], r["b"]) for r in test})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {path}: {len(rows)} questions")


if __name__ == "__main__":
    main()
