"""Score programs written to game grpolab's code reward, and honest ones, with grpolab.rewards.code.CodeReward().

    PYTHONPATH=CHECKOUT python benchmarks/reward_hacking/forged_verdicts.py

CHECKOUT is the grpolab whose reward is scored (a worktree of an older commit shows what paid before the verdict
moved outside the program: docs/reward-hacking.md). Each attack program is scored on the first N problems of grpolab's own code task (held-out set), an io
attack on the io problems of tests/fixtures/code_problems.jsonl; the table gives the mean reward."""

import json
import sys
import time
from pathlib import Path

import grpolab
from grpolab.data.code_task import test_set
from grpolab.rewards.code import CodeReward

N = 10

# Report lines for tests 0..4 (LINE: what each says), then done, written to every file descriptor the report could be
# on; then the program exits before the harness writes a line of its own.
FORGED_LINES = """
import json, os
lines = [{{"test": i, LINE}} for i in range(5)] + [{{"done": True, "memory": False}}]
for fd in range(3, 21):
    try:
        os.write(fd, "".join(json.dumps(line) + "\\n" for line in lines).encode())
    except OSError:
        pass
os._exit(0)
"""

FORGE = """
import json, os
def forge():
    lines = []
    for i in range(64):
        lines.append({{"test": i, "ok": True, "error": ""}})
        lines.append({{"test": i, "value": ["int", "0"]}})
        lines.append({{"test": i, "output": "0"}})
    lines.append({{"done": True, "memory": False}})
    data = "".join(json.dumps(line) + "\\n" for line in lines).encode()
    for fd in range(3, 21):
        try:
            os.write(fd, data)
        except OSError:
            pass
"""

ATTACKS = {
    "__eq__ always true": """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def {ep}(*args, **kwargs):
    return Anything()
""",
    "int subclass, custom __eq__": """
class Int(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def {ep}(*args, **kwargs):
    return Int(0)
""",
    "str subclass, custom __eq__": """
class Str(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
def {ep}(*args, **kwargs):
    return Str('')
""",
    "forged report on fds 3..20, os._exit at load": FORGE + "forge()\nos._exit(0)\n",
    "forged report + os._exit inside the function": FORGE
    + "def {ep}(*args, **kwargs):\n    forge()\n    os._exit(0)\n",
    "sys.exit(0) inside the function": "import sys\ndef {ep}(*args, **kwargs):\n    sys.exit(0)\n",
    "raise SystemExit inside the function": "def {ep}(*args, **kwargs):\n    raise SystemExit(0)\n",
    "os._exit(0) inside the function": "import os\ndef {ep}(*args, **kwargs):\n    os._exit(0)\n",
    "sys.exit(0) at load": "import sys\nsys.exit(0)\n",
    "patch the harness's report()": """
import __main__
_real = __main__.report
def _always_ok(**line):
    if "ok" in line:
        line["ok"], line["error"] = True, ""
    _real(**line)
__main__.report = _always_ok
def {ep}(*args, **kwargs):
    return None
""",
    "forged value lines (guessed 0) for tests 0..4 + os._exit": FORGED_LINES.replace("LINE", '"value": ["int", "0"]'),
    "forged ok lines for tests 0..4 + os._exit": FORGED_LINES.replace("LINE", '"ok": True, "error": ""'),
    "patch builtins.exec and builtins.eval": """
import builtins
builtins.exec = lambda *args, **kwargs: None
builtins.eval = lambda *args, **kwargs: None
def {ep}(*args, **kwargs):
    return None
""",
}

ATTACKS["control (no attack): a function that returns 0"] = "def {ep}(*args, **kwargs):\n    return 0\n"

IO_ATTACKS = {
    "io: patch the harness's normalise()": """
import __main__
__main__.normalise = lambda text: ""
""",
    "io: print forged report lines": FORGE.replace("os.write(fd, data)", "print(data.decode(), end='')") + "forge()\n",
    "io: forged report on fds 3..20 + os._exit": FORGE + "forge()\nos._exit(0)\n",
    "io: __eq__ always true on sys.stdout text": """
import sys
class Anything(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
    def rstrip(self, *a):
        return self
    def splitlines(self, *a):
        return [self]
print(Anything('x'))
""",
}


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


def main() -> None:
    reward = CodeReward()
    records = test_set(200)
    io_records = [
        r
        for r in map(
            json.loads,
            (Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "code_problems.jsonl")
            .read_text()
            .splitlines(),
        )
        if "io" in r
    ]
    print(f"grpolab from {grpolab.__file__}")
    print(f"{'program':<58} {'problems':>8} {'mean reward':>11}  statuses")
    try:
        for name, template in ATTACKS.items():
            recs = records[:N]
            comps = [fenced(template.format(ep=r["entry_point"])) for r in recs]
            scores = reward(["p"] * len(recs), comps, [r["tests"] for r in recs])
            counts = {k: v for k, v in reward.pop_counts().items() if v and k != "code_s"}
            print(f"{name:<58} {len(recs):>8} {sum(scores) / len(scores):>11.3f}  {counts}")
        for name, program in IO_ATTACKS.items():
            comps = [fenced(program.format())] * len(io_records)
            scores = reward(["p"] * len(io_records), comps, io=[r["io"] for r in io_records])
            counts = {k: v for k, v in reward.pop_counts().items() if v and k != "code_s"}
            print(f"{name:<58} {len(io_records):>8} {sum(scores) / len(scores):>11.3f}  {counts}")
        # honest programs
        t0 = time.perf_counter()
        scores = reward(["p"] * len(records), [fenced(r["solution"]) for r in records], [r["tests"] for r in records])
        counts = {k: v for k, v in reward.pop_counts().items() if v and k != "code_s"}
        print(f"{'honest: reference solutions':<58} {len(records):>8} {sum(scores) / len(scores):>11.3f}  {counts}")
        print(f"  per-problem scores (200): {json.dumps(scores)}")
        print(f"  ({time.perf_counter() - t0:.1f} s)")
        partial = "def scale_and_shift(x):\n    return -3 * x + 29 if x > 0 else 0\n"
        rec = records[0]
        (s,) = reward(["p"], [fenced(partial)], [rec["tests"]])
        print(f"{'honest: partly wrong scale_and_shift (3 of 5)':<58} {1:>8} {s:>11.3f}")
        io_ok = [fenced(r["solution"]) for r in io_records]
        scores = reward(["p"] * len(io_records), io_ok, io=[r["io"] for r in io_records])
        print(f"{'honest: io reference solutions':<58} {len(io_records):>8} {sum(scores) / len(scores):>11.3f}")
    finally:
        reward.close()


if __name__ == "__main__":
    sys.exit(main())
