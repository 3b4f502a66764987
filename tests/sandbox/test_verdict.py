"""The verdicts judged outside the program's interpreter: which tests are sent as an expression, how values cross
from the harness (typed JSON) and compare, and which reports are forged. No sandbox: pure functions."""

from __future__ import annotations

import collections
import json

import pytest

from grpolab.sandbox.harness import encode, output_digest
from grpolab.sandbox.verdict import Check, checks_of, decode, equality_test, read_report, same


# ------------------------------------------------------------------ which tests are judged outside
@pytest.mark.parametrize(
    ("test", "split"),
    [
        ("assert f(1) == 2", ("f(1)", 2)),
        ("assert 2 == f(1)", ("f(1)", 2)),  # the literal on the left
        ("assert f(1, 'a') == [1, (2.5, None)], 'f is wrong'", ("f(1, 'a')", [1, (2.5, None)])),
        ("assert is_multiple(15363) == True", ("is_multiple(15363)", True)),
        ("assert f(-3) == -7", ("f(-3)", -7)),
        ("assert g() == {'a': {1, 2}, 'b': b'x'}", ("g()", {"a": {1, 2}, "b": b"x"})),
        ("assert g() == set()", ("g()", set())),
        ("assert f(\n    1,\n    2,\n) == 3", ("f(1, 2)", 3)),  # over several lines
        ("assert v == '0'", ("v", "0")),
    ],
)
def test_an_equality_with_a_literal_is_sent_as_its_expression_alone(test, split):
    assert equality_test(test) == split


@pytest.mark.parametrize(
    "test",
    [
        "assert f(1)",
        "assert abs(f(1) - 2) < 1e-9",
        "assert f(1) == g(2)",  # no literal side
        "assert f(1) == 2 == 2",  # a chain
        "assert f(1) != 2",
        "assert f(1) is None",
        "assert f(1) == ...",  # a literal of a type with no typed comparison
        "def check(candidate):\n    assert candidate(1) == 2\n",
        "x = f(1)\nassert x == 2",  # two statements
        "assert f(1 == 2",  # no Python
        "",
    ],
)
def test_any_other_test_is_judged_inside(test):
    assert equality_test(test) is None
    (check,) = checks_of((test,), None)
    assert check == Check("inside", test)


def test_the_code_tasks_tests_are_all_judged_outside():
    from grpolab.data.code_task import test_set

    checks = [c for r in test_set(200) for c in checks_of(tuple(r["tests"]), None)]
    assert len(checks) == 1000 and {c.kind for c in checks} == {"value"}


def test_an_io_test_sends_its_stdin_and_keeps_its_outputs_digest():
    (check,) = checks_of(None, (("1 2\n", "3\n"),))
    assert (check.kind, check.sent) == ("output", "1 2\n")
    assert check.expected == output_digest("3") == output_digest("3  \n\n")  # normalised as before
    assert check.expected != output_digest("4\n")


# ------------------------------------------------------------------ values: typed JSON and comparison
VALUES = [
    None,
    True,
    False,
    0,
    -37,
    10**40,
    2.5,
    -0.0,
    float("inf"),
    1e-300,
    complex(1, -2),
    "",
    "a\n'b\"\udc80",  # a lone surrogate crosses too
    b"\x00\xff",
    [],
    [1, [2, [3]]],
    (1, "a", None),
    (),
    {1, "a", (2, 3)},
    frozenset({1, 2}),
    {"a": [1, 2], 3: (4,), (5, 6): {7: None}},
]


def value_id(value) -> str:
    """A test id that is the same in every process: a set's repr follows the hash seed, which differs between
    pytest-xdist's workers (they must collect the same ids)."""
    return f"set{sorted(map(repr, value))}" if isinstance(value, (set, frozenset)) else repr(value)


@pytest.mark.parametrize("value", VALUES, ids=value_id)
def test_a_plain_value_crosses_as_typed_json_and_comes_back_the_same(value):
    back = decode(json.loads(json.dumps(encode(value))))
    assert same(back, value) and type(back) is type(value)


class Anything:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


class Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Str(str):
    pass


@pytest.mark.parametrize(
    "value",
    [Anything(), Int(3), Str("a"), [1, Int(2)], {"a": Anything()}, collections.OrderedDict(a=1), range(3), print],
    ids=lambda v: type(v).__name__,
)
def test_a_value_of_any_other_type_even_a_subclass_has_no_typed_form(value):
    with pytest.raises(TypeError):
        encode(value)


def test_a_value_too_deep_or_containing_itself_has_no_typed_form():
    loop: list = []
    loop.append(loop)
    deep: list = []
    for _ in range(200):
        deep = [deep]
    for value in (loop, deep):
        with pytest.raises(ValueError, match="100 levels"):
            encode(value)


@pytest.mark.parametrize(
    ("actual", "expected", "equal"),
    [
        (2, 2.0, True),  # int and float are numbers, compared by value
        (True, 1, False),  # bool is not int
        (False, 0, False),
        (0, False, False),
        ([1, 2], (1, 2), False),  # list is not tuple
        ({1, 2}, frozenset({1, 2}), False),
        ("a", b"a", False),
        ({"a": 1}, {"a": 1.0}, True),
        ({"a": 1}, {"a": True}, False),
        ([1, [2, (3,)]], [1.0, [2, (3.0,)]], True),
        ([1, [2, (3,)]], [1, [2, [3]]], False),
        (None, 0, False),
        (complex(1, 0), 1, False),
    ],
)
def test_values_compare_by_value_and_type(actual, expected, equal):
    assert same(actual, expected) is equal


@pytest.mark.parametrize(
    "node",
    [
        ["int", "1_0"],
        ["int", " 1"],
        ["int", 1],
        ["bool", 1],
        ["None", 0],
        ["list", "abc"],
        ["set", [["list", []]]],  # unhashable in a set
        ["dict", [[["int", "1"]]]],
        ["object", None],
        "1",
        ["str"],
        ["complex", [1.0, 2.0]],
    ],
)
def test_a_malformed_typed_value_is_refused(node):
    with pytest.raises((ValueError, TypeError)):
        decode(node)


# ------------------------------------------------------------------ the report
CHECKS = [Check("value", "f(1)", 2), Check("inside", "assert f(1)"), Check("value", "f(2)", [3])]


def lines(*objs) -> list[bytes]:
    return [json.dumps(o).encode() for o in objs]


def test_an_honest_report_is_judged_here():
    value, ok = {"test": 0, "value": ["int", "2"]}, {"test": 1, "ok": True, "error": ""}
    wrong = {"test": 2, "value": ["tuple", [["int", "3"]]]}
    report = read_report(lines(value, ok, wrong, {"done": True, "memory": False}), CHECKS)
    assert not report.forged and report.done
    assert report.results[0] == (True, "") and report.results[1] == (True, "")
    assert report.results[2] == (False, "f(2) gave (3,), expected [3]")


def test_a_missing_line_is_a_failed_test_and_garbage_lines_are_skipped():
    report = read_report([b"not json", b"[[[[" * 50_000, *lines({"test": 0, "value": ["int", "2"]}, [1, 2])], CHECKS)
    assert not report.forged and not report.done and set(report.results) == {0}


def test_an_error_line_fails_its_test_of_any_kind():
    report = read_report(lines(*({"test": i, "error": "boom"} for i in range(3))), CHECKS)
    assert not report.forged and report.results == {i: (False, "boom") for i in range(3)}


@pytest.mark.parametrize(
    "forged",
    [
        [{"test": 0, "value": ["int", "2"]}, {"test": 0, "value": ["int", "2"]}],  # a test reported twice
        [{"test": 0, "ok": True, "error": ""}],  # a verdict for a test whose value is judged here
        [{"test": 1, "value": ["int", "2"]}],  # a value for a test whose expression was not sent
        [{"test": 0, "value": ["int", "2"], "ok": True}],  # two kinds at once
        [{"test": 3, "ok": True}],  # past the last test
        [{"test": True, "ok": True}],  # not an index
        [{"test": 0, "output_sha256": "00"}],  # an io line in a job without io
        [{"done": True, "memory": False}, {"done": True, "memory": False}],
    ],
)
def test_a_report_no_harness_writes_is_forged(forged):
    assert read_report(lines(*forged), CHECKS).forged
