"""The program inside the sandbox: lowers its own limits, runs a model's program, then its tests, and reports.

This file runs *in* the sandbox (``grpolab.sandbox.runner`` starts it there), on the standard library alone,
so that no grpolab or torch import reaches the untrusted side. It reads one job as JSON on stdin::

    {"program": str, "tests": [str] | null, "io": [[stdin, stdout], ...] | null, "entry_point": str | null,
     "capture": int, "limits": {"cpu_s", "memory_mb", "file_mb", "open_files", "processes"}, "uid": int | null,
     "home": str}

and writes one JSON line per test to its stdout as it goes (``{"test": i, "ok": bool, "error": str}``), then
``{"done": true, "memory": bool}``. With ``capture`` > 0 there are no tests: the program runs as a script and
``{"output": str}`` (what it printed, at most ``capture`` characters) comes before its one test line. The program's own stdout and stderr go to ``output.log`` in its
working directory (capped by the file-size limit), never into that report.

A determined program runs in this very interpreter and can forge the report (write lines to the report's
file descriptor, or make ``==`` always true): the sandbox protects the machine, not the reward from a program
written to game it (docs/code.md).
"""

import io
import json
import os
import resource
import signal
import sys

RESULT_FD = os.dup(1)  # the report channel, kept before fd 1 is pointed at output.log


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


def run_tests(code, tests: list[str], entry_point: str | None) -> bool:
    """Program once, then each test in its namespace; True if a MemoryError was seen."""
    memory = False
    ns = {"__name__": "solution"}
    try:
        exec(code, ns)
        loaded = ""
    except BaseException as e:  # noqa: BLE001 - whatever the program raises, its tests fail
        loaded, memory = describe(e), isinstance(e, MemoryError)
    for i, test in enumerate(tests):
        if loaded:
            report(test=i, ok=False, error=f"the program did not run: {loaded}")
            continue
        try:
            exec(compile(test, f"<test {i}>", "exec"), ns)
            if entry_point and callable(ns.get("check")) and "def check" in test:  # HumanEval style
                ns["check"](ns[entry_point])
            report(test=i, ok=True, error="")
        except BaseException as e:  # noqa: BLE001
            memory = memory or isinstance(e, MemoryError)
            report(test=i, ok=False, error=describe(e))
    return memory


def run_io(code, pairs: list[list[str]], output_cap: int) -> bool:
    """The program as a script once per (stdin, expected stdout) pair; True if a MemoryError was seen."""
    memory = False
    for i, (given, expected) in enumerate(pairs):
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
        ok = not error and normalise(out.getvalue()) == normalise(expected)
        report(test=i, ok=ok, error=error or ("" if ok else "wrong output"))
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
            report(test=i, ok=False, error=err)
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
