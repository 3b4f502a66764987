"""The program inside the sandbox: lowers its own limits, runs a model's program, then its tests, and reports.

This file runs *in* the sandbox (``grpolab.sandbox.runner`` starts it there), on the standard library alone,
so that no grpolab or torch import reaches the untrusted side. It reads one job as JSON on stdin::

    {"program": str, "tests": [{"expr": str} | {"stmt": str}] | null, "io": [stdin, ...] | null,
     "entry_point": str | null, "capture": int,
     "limits": {"cpu_s", "memory_mb", "file_mb", "open_files", "processes"}, "uid": int | null, "home": str}

and writes one JSON line per test to its stdout as it goes, then ``{"done": true, "memory": bool}``:

- ``{"expr": EXPR}`` (the runner's ``assert EXPR == LITERAL``, the literal kept outside): ``{"test": i, "value":
  typed}``, EXPR's value in the program's namespace as typed JSON (:func:`encode`), judged by the runner;
- ``{"stmt": STATEMENT}`` (any other test): ``{"test": i, "ok": bool, "error": str}``, judged here;
- an io test's stdin: ``{"test": i, "output_sha256": hex}``, the digest of its normalised printed output
  (:func:`output_digest`), compared by the runner with the expected output's;
- a test that could not run (the program raised, EXPR raised or its value has no typed form): ``{"test": i,
  "error": str}``.

With ``capture`` > 0 there are no tests: the program runs as a script and ``{"output": str}`` (what it printed, at
most ``capture`` characters) comes before its one test line. The program's own stdout and stderr go to
``output.log`` in its working directory (capped by the file-size limit), never into that report.

The program runs in this very interpreter and can write anything on the report's file descriptor: the runner keeps
every expected value and output to itself (grpolab.sandbox.verdict), so only a ``stmt`` test's verdict can be
forged (docs/code.md).
"""

import hashlib
import io
import json
import os
import resource
import signal
import sys

RESULT_FD = 1  # the report channel: main() dups fd 1 here before pointing fd 1 at output.log
VALUE_CAP = 1 << 16  # characters of one encoded value: a larger one fails its test instead of filling the report


def report(**line) -> None:
    os.write(RESULT_FD, (json.dumps(line) + "\n").encode())


def lower_limits(limits: dict) -> None:
    """Lower soft and hard limits alike, so the program cannot raise them back."""
    mb = 1 << 20
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu_s, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)  # a big allocation -> MemoryError
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * mb,) * 2)  # every file, output.log included
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)  # counted per user id: see runner
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def drop_privileges(uid: int) -> None:
    """As root in the sandbox: give the working directories to ``uid`` and become it for good.

    A user id of its own makes the process limit bite (the kernel exempts root from it) and leaves the
    program no capability and no file of anyone else's to write."""
    for path in (os.getcwd(), "/tmp"):
        os.chown(path, uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


class CappedText(io.StringIO):
    """Captured stdout of an io test, cut at ``cap`` characters (a program printing a gigabyte fails, not us)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def write(self, s: str) -> int:
        if self.tell() + len(s) > self.cap:
            raise OSError(f"more than {self.cap} characters of output")
        return super().write(s)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def normalise(text: str) -> str:
    """Output compared line by line, trailing white space and trailing empty lines ignored."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def encode(value, depth: int = 0):
    """``value`` as typed JSON, ``[type name, payload]``, for exact builtin types only (``type(v) is int``, never a
    subclass, whose ``==`` could be anything): None, bool, int, float, complex, str, bytes, list, tuple, set,
    frozenset, dict. TypeError for any other, ValueError past 100 levels. Written by hand: json alone loses tuple
    vs list, int vs float and sets, and pickle would let the program run code in the runner that reads it."""
    t = type(value)
    if depth > 100:
        raise ValueError("a value nested more than 100 levels deep")
    if value is None:
        return ["None", None]
    if t is bool or t is str:
        return [t.__name__, value]
    if t is int:
        return ["int", int.__repr__(value)]
    if t is float:
        return ["float", float.__repr__(value)]
    if t is complex:
        return ["complex", [float.__repr__(value.real), float.__repr__(value.imag)]]
    if t is bytes:
        return ["bytes", value.hex()]
    if t in (list, tuple, set, frozenset):
        return [t.__name__, [encode(v, depth + 1) for v in value]]
    if t is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"a value of type {t.__name__!r}, not a plain literal type")


def output_digest(text: str) -> str:
    """SHA-256 of ``text`` normalised (:func:`normalise`): how an io test's output is compared, here and outside."""
    return hashlib.sha256(normalise(text).encode("utf-8", "surrogatepass")).hexdigest()


def value_line(i: int, expr: str, ns: dict) -> dict:
    """The report line of test ``i``: ``expr``'s value in ``ns``, typed (or why there is none)."""
    value = eval(compile(expr, f"<test {i}>", "eval"), ns)
    try:
        typed = encode(value)
    except (TypeError, ValueError, RecursionError) as e:
        return {"test": i, "error": f"{expr}: no plain value ({describe(e)})"}
    if len(json.dumps(typed)) > VALUE_CAP:
        return {"test": i, "error": f"{expr}: a value of more than {VALUE_CAP} characters"}
    return {"test": i, "value": typed}


def run_tests(code, tests: list[dict], entry_point: str | None) -> bool:
    """Program once, then each test in its namespace: an ``expr`` reported as its value, a ``stmt`` run and judged
    here; True if a MemoryError was seen."""
    memory = False
    ns = {"__name__": "solution"}
    try:
        exec(code, ns)
        loaded = ""
    except BaseException as e:  # noqa: BLE001 - whatever the program raises, its tests fail
        loaded, memory = describe(e), isinstance(e, MemoryError)
    for i, test in enumerate(tests):
        if loaded:
            report(test=i, error=f"the program did not run: {loaded}")
            continue
        try:
            if "expr" in test:
                report(**value_line(i, test["expr"], ns))
                continue
            exec(compile(test["stmt"], f"<test {i}>", "exec"), ns)
            if entry_point and callable(ns.get("check")) and "def check" in test["stmt"]:  # HumanEval style
                ns["check"](ns[entry_point])
            report(test=i, ok=True, error="")
        except BaseException as e:  # noqa: BLE001
            memory = memory or isinstance(e, MemoryError)
            report(test=i, error=describe(e))
    return memory


def run_io(code, stdins: list[str], output_cap: int) -> bool:
    """The program as a script once per stdin, each output's digest reported; True if a MemoryError was seen."""
    memory = False
    for i, given in enumerate(stdins):
        out = CappedText(output_cap)
        sys.stdin = io.TextIOWrapper(io.BytesIO(given.encode()))
        sys.stdout, error = out, ""
        try:
            exec(code, {"__name__": "__main__"})
        except SystemExit as e:
            error = "" if e.code in (None, 0) else f"exit status {e.code}"
        except BaseException as e:  # noqa: BLE001
            memory, error = memory or isinstance(e, MemoryError), describe(e)
        finally:
            sys.stdout = sys.__stdout__
        if error:
            report(test=i, error=error)
        else:
            report(test=i, output_sha256=output_digest(out.getvalue()))
    return memory


def run_script(code, cap: int, log: int) -> bool:
    """The program as a script, its prints (and an uncaught exception's last line) in output.log (open as ``log``);
    then up to ``cap`` characters of that log reported back; one test: it ran to its end. True if a MemoryError was
    seen."""
    error, memory = "", False
    try:
        exec(code, {"__name__": "__main__"})
    except SystemExit as e:
        error = "" if e.code in (None, 0) else f"exit status {e.code}"
    except BaseException as e:  # noqa: BLE001 - what the program raises is part of its output
        error, memory = describe(e), isinstance(e, MemoryError)
        print(error, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    text = os.pread(log, 4 * cap + 4, 0).decode("utf-8", errors="replace")  # read through the fd: the file is root's
    report(output=text if len(text) <= cap else text[:cap] + "\n[... output cut]")
    report(test=0, ok=not error, error=error)
    return memory


def main() -> None:
    global RESULT_FD
    RESULT_FD = os.dup(1)  # kept before fd 1 is pointed at output.log
    job = json.loads(sys.stdin.buffer.read())
    log = os.open("output.log", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)  # the program's prints, and tracebacks, land here, not in the report
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the file-size limit a write fails (EFBIG) instead
    if job.get("uid") is not None:
        drop_privileges(job["uid"])
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": job.get("home") or os.getcwd(), "LANG": "C.UTF-8"})
    lower_limits(job["limits"])
    try:
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError) as e:
        code, err = None, describe(e)
    if code is None:
        n = 1 if job.get("capture") else len(job.get("tests") or job.get("io") or [])
        if job.get("capture"):
            report(output=err)
        for i in range(n):
            report(test=i, error=err)
        memory = False
    elif job.get("capture"):
        memory = run_script(code, int(job["capture"]), log)
    elif job.get("io") is not None:
        memory = run_io(code, job["io"], job["limits"]["file_mb"] << 20)
    else:
        memory = run_tests(code, job["tests"], job.get("entry_point"))
    report(done=True, memory=memory)
    os._exit(0)  # no atexit hook or lingering thread of the program runs after the report


if __name__ == "__main__":
    main()
