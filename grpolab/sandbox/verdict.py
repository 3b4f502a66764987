"""Verdicts judged outside the program's interpreter: what the sandbox is sent of each test, and what its report means.

The program runs in the harness's own interpreter, so everything the harness writes can be forged by it (it can find
the report's file descriptor, patch the harness, or return an object whose ``==`` is always true). This module, on
the trusted side, therefore keeps the expected answers to itself:

- a test ``assert EXPR == LITERAL`` (or ``assert LITERAL == EXPR``, with or without a message), where ``LITERAL`` is
  a Python literal (``ast.literal_eval``), is sent as ``EXPR`` alone; the harness reports EXPR's value as typed
  JSON (:func:`grpolab.sandbox.harness.encode`), and :func:`same` compares it with the literal here, by value and
  type;
- an io test is sent as its stdin alone; the harness reports the SHA-256 of its normalised printed output, compared
  here with that of the expected output;
- any other test (a HumanEval ``def check(candidate)``, ``assert f(x)``, ``assert abs(f(x) - y) < 1e-9``) is run
  and judged inside, as the harness always did: its verdict can be forged (counted: ``Outcome.judged_inside``).

A report that no honest harness writes (two lines for one test, a line of the wrong kind for its test, a test
index out of range, two ``done`` lines) is a forged report, and the whole job fails (:func:`read_report`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from typing import Literal

from grpolab.sandbox.harness import output_digest

Kind = Literal["value", "inside", "output"]
ERROR_CHARS = 300
_INT = re.compile(r"-?[0-9]+")


@dataclasses.dataclass(frozen=True)
class Check:
    """One test as the sandbox gets it (``sent``) and what its report is held against (``expected``)."""

    kind: Kind
    """value: EXPR's value is compared here; inside: the harness's ok/failed stands; output: the output's digest."""
    sent: str
    """EXPR's source (value), the whole test (inside) or the stdin (output)."""
    expected: object = None
    """The literal (value) or the expected output's digest (output)."""


def equality_test(test: str) -> tuple[str, object] | None:
    """``(EXPR's source, LITERAL's value)`` of a test ``assert EXPR == LITERAL`` (either side the literal, a message
    allowed), or None for a test of any other form, or a literal of a type :func:`same` does not compare."""
    try:
        (stmt,) = ast.parse(test).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: more or fewer than one statement
        return None
    if not isinstance(stmt, ast.Assert) or not isinstance(stmt.test, ast.Compare):
        return None
    cmp = stmt.test
    if len(cmp.ops) != 1 or not isinstance(cmp.ops[0], ast.Eq):
        return None
    for expr, lit in ((cmp.left, cmp.comparators[0]), (cmp.comparators[0], cmp.left)):
        try:
            value = ast.literal_eval(lit)
            canonical(value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
        return ast.unparse(expr), value
    return None


def checks_of(tests: tuple[str, ...] | None, io: tuple[tuple[str, str], ...] | None) -> list[Check]:
    """Each test's :class:`Check`: ``tests`` (Python statements) or ``io`` ((stdin, expected stdout) pairs)."""
    if tests is not None:
        split = [(t, equality_test(t)) for t in tests]
        return [Check("value", *eq) if eq else Check("inside", t) for t, eq in split]
    return [Check("output", given, output_digest(want)) for given, want in io or ()]


# ------------------------------------------------------------------ values
# The typed JSON the harness writes: [type name, payload]. Decoded and compared by hand: json alone loses tuple vs
# list, int vs float and sets, and pickle (the library way to move typed values) would let the program run code in
# this reader; no library does typed round-trips of Python literals without it.
_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
MAX_DEPTH = 100


def decode(node: object, depth: int = 0) -> object:
    """The value a typed-JSON node stands for; ValueError (or TypeError: an unhashable set element) if malformed."""
    if depth > MAX_DEPTH or not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
        raise ValueError("not a typed value")
    tag, payload = node
    if tag == "None" and payload is None:
        return None
    if tag == "bool" and isinstance(payload, bool):
        return payload
    if tag == "int" and isinstance(payload, str) and _INT.fullmatch(payload):
        return int(payload)
    if tag == "float" and isinstance(payload, str):
        return float(payload)
    if tag == "complex" and isinstance(payload, list) and len(payload) == 2 and all(type(p) is str for p in payload):
        return complex(float(payload[0]), float(payload[1]))
    if tag in ("str", "bytes") and isinstance(payload, str):
        return payload if tag == "str" else bytes.fromhex(payload)
    if tag in _SEQUENCES and isinstance(payload, list):
        return _SEQUENCES[tag](decode(x, depth + 1) for x in payload)
    if tag == "dict" and isinstance(payload, list) and all(isinstance(p, list) and len(p) == 2 for p in payload):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in payload}
    raise ValueError(f"not a typed value of type {tag!r}")


def canonical(value: object) -> object:
    """A key equal for two values exactly when :func:`same` holds: the type beside the value, all the way down.

    bool is not int, list is not tuple, set is not frozenset, str is not bytes; int and float are both numbers and
    compare by value (``2 == 2.0``, as in the tests' own ``==``). TypeError for any other type."""
    t = type(value)
    if value is None or t in (bool, str, bytes, complex):
        return (t.__name__, value)
    if t in (int, float):
        return ("number", value)
    if t in (list, tuple):
        return (t.__name__, tuple(canonical(v) for v in value))
    if t in (set, frozenset):
        return (t.__name__, frozenset(canonical(v) for v in value))
    if t is dict:
        return ("dict", frozenset((canonical(k), canonical(v)) for k, v in value.items()))
    raise TypeError(f"no typed comparison for {t.__name__}")


def same(actual: object, expected: object) -> bool:
    """Equal by value and type (:func:`canonical`): what ``assert actual == expected`` means here."""
    return canonical(actual) == canonical(expected)


# ------------------------------------------------------------------ the report
@dataclasses.dataclass
class Report:
    """What the harness's report says: each test's (passed, error), how it ended, and why it is forged if it is."""

    results: dict[int, tuple[bool, str]] = dataclasses.field(default_factory=dict)
    done: bool = False
    memory: bool = False
    output: str | None = None
    """A ``capture`` job's printed output."""
    forged: str = ""
    """Why no honest harness wrote this report ("" when one could have)."""

    def take(self, line: dict, checks: list[Check]) -> None:
        """Add one line of the report."""
        if "test" in line:
            i, kind = line["test"], line_kind(line)
            if type(i) is not int or not 0 <= i < len(checks) or kind not in ("error", checks[i].kind):
                self.forged = self.forged or f"a line no harness writes: {json.dumps(line)[:200]}"
            elif i in self.results:
                self.forged = self.forged or f"a second line for test {i}"
            elif kind == "error":
                self.results[i] = (False, str(line["error"])[:ERROR_CHARS])
            else:
                self.results[i] = judge(checks[i], line)
        elif line.get("done"):
            self.forged = self.forged or ("a second 'done' line" if self.done else "")
            self.done, self.memory = True, self.memory or bool(line.get("memory"))
        elif isinstance(line.get("output"), str):
            self.forged = self.forged or ("a second 'output' line" if self.output is not None else "")
            self.output = line["output"]


def judge(check: Check, line: dict) -> tuple[bool, str]:
    """One test's verdict from its report line (which :func:`line_kind` matched to ``check``)."""
    if check.kind == "inside":
        return line.get("ok") is True, str(line.get("error", ""))[:ERROR_CHARS]
    if check.kind == "output":
        ok = line["output_sha256"] == check.expected
        return ok, "" if ok else "wrong output"
    try:
        value = decode(line["value"])
    except (ValueError, TypeError, RecursionError, MemoryError):
        return False, f"{check.sent}: a malformed value"
    if same(value, check.expected):
        return True, ""
    return False, f"{check.sent} gave {value!r:.120}, expected {check.expected!r:.120}"[:ERROR_CHARS]


def line_kind(line: dict) -> str:
    """Which kind of test's line ``line`` is ("error" when it only says the test failed); "" if none or several."""
    kinds = [k for k, key in (("inside", "ok"), ("value", "value"), ("output", "output_sha256")) if key in line]
    if len(kinds) == 1:
        return kinds[0]
    return "error" if not kinds and "error" in line else ""


def read_report(lines: list[bytes], checks: list[Check]) -> Report:
    """Each test's verdict from the harness's report lines (a line that is no JSON object is skipped: a report cut
    at the runner's cap ends in one)."""
    report = Report()
    for raw in lines:
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: a line of 100,000 '['
            continue
        if isinstance(line, dict):
            report.take(line, checks)
    return report
