"""Write the guessing game's records: each row is a secret number (train.jsonl, test.jsonl under --out).

    python examples/guess/make_data.py [--train 1000] [--seed 0] [--out data/guess]

The test set is every number from 1 to 20 five times over (100 games); the training rows are drawn at random.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="data/guess")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    train = [{"game": i, "secret": rng.randint(1, 20)} for i in range(args.train)]
    test = [{"game": 100_000 + i, "secret": 1 + i % 20} for i in range(100)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {path}: {len(rows)} games")


if __name__ == "__main__":
    main()
