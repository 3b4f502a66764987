"""Run untrusted programs against their tests, each in a fresh sandboxed process, several at a time.

Layers, outermost first, and what each one stops (docs/code.md says what they do not):

- **bubblewrap** (``bwrap``, the tool Flatpak sandboxes with; preferred when installed): new mount, PID, network,
  IPC and UTS namespaces. The program sees ``/usr`` (and the interpreter's prefix) read-only, a size-limited
  tmpfs as its working directory and ``/tmp``, and nothing else: no home directory, no run directory, no
  ``/etc``. No network but a loopback of its own: nothing on the host's ports is reachable. When the
  sandbox's first process exits, the PID namespace ends and the kernel kills every process left in it
  (daemons included); ``--die-with-parent`` ends it if the runner dies.
- **unshare** (util-linux), when bubblewrap is missing: new network and PID namespaces (in a user namespace when
  not root), so no network and no surviving process; the filesystem is *not* hidden (the program can write
  where the user can), and its working directory is a fresh one under the system's temporary directory.
- **the harness** (``harness.py``) in every case: lowers its own resource limits before the program runs (CPU
  seconds, address space, file size, open files, processes), clears the environment and, started as root,
  becomes a user id of its own for the run, so the process limit bites and nothing of root's is writable.
- **this runner**: a wall-clock timeout after which the whole process group is killed, a cap on what it reads
  back, an environment with nothing of the trainer's; and the verdicts (``verdict.py``): the expected values and
  outputs stay here, the sandbox reports values and output digests, and a report no harness writes is forged.

Written here rather than taken from a library: the Python sandboxes on PyPI either run code in-process
(RestrictedPython), need a server (E2B, Piston, Judge0) or a container engine; bubblewrap is the well-kept
tool, and this module only assembles its command line and the limits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from grpolab.sandbox.verdict import Check, checks_of, read_report

HARNESS = Path(__file__).with_name("harness.py")
ISOLATIONS = ("auto", "bwrap", "unshare")
# User ids the harness takes when started as root, one per worker of each trainer process (the process limit
# counts per user id, so two workers, or two ranks on one machine, must not share one): UID_BASE + 256 * (pid mod
# 2^16) + worker, far above any real account's.
UID_BASE = 1_900_000_000
MAX_WORKERS = 256
STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "forged")


class SandboxError(RuntimeError):
    """The sandbox cannot be set up as asked (no isolation available, a tool that does not run)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use."""

    timeout_s: float = 5.0
    """Wall-clock seconds for the program and all its tests; then the whole sandbox is killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space of each process, MiB (RLIMIT_AS): a larger allocation raises MemoryError."""
    file_mb: int = 16
    """Largest file it may write, MiB (RLIMIT_FSIZE), its captured output included."""
    disk_mb: int = 64
    """Size of its working directory and of its /tmp (bubblewrap: tmpfs sizes), MiB each."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    processes: int = 32
    """Processes and threads it may run at once (RLIMIT_NPROC)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"sandbox limit {f.name} must be > 0, got {getattr(self, f.name)}")


@dataclasses.dataclass(frozen=True)
class Job:
    """A program and its tests: ``tests`` (Python statements run after it, each an ``assert``; or one
    HumanEval-style ``def check(candidate)`` with ``entry_point``) or ``io`` ((stdin, expected stdout) pairs); or,
    with ``capture`` > 0, no tests: the program runs as a script and what it printed (stdout and stderr, an
    uncaught exception's last line included) comes back in :attr:`Outcome.output`, at most ``capture`` characters
    (its one test: it ran to its end). The sandbox is sent only what the run needs: an ``assert EXPR == LITERAL``
    test's EXPR, an io test's stdin; their verdicts are taken here (:mod:`grpolab.sandbox.verdict`)."""

    program: str
    tests: tuple[str, ...] | None = None
    io: tuple[tuple[str, str], ...] | None = None
    entry_point: str | None = None
    capture: int = 0

    @property
    def n_tests(self) -> int:
        if self.capture:
            return 1
        return len(self.tests if self.tests is not None else self.io or ())


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one program."""

    status: Literal["passed", "failed", "timeout", "memory", "crashed", "forged"]
    """forged: the report holds a line no harness writes (two for one test, one of the wrong kind): none passed."""
    passed: int
    total: int
    seconds: float
    """Wall-clock seconds from start to the end of the sandbox."""
    error: str = ""
    """The first failing test's error, or why the sandbox ended."""
    output: str = ""
    """A ``capture`` job's printed output."""
    judged_inside: int = 0
    """Tests whose verdict the harness gave, in the program's interpreter (not ``assert EXPR == LITERAL`` nor io):
    the program can forge those (grpolab.sandbox.verdict)."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _top_level(path: str) -> list[str]:
    """bubblewrap arguments that show ``/path`` as on the host: a symlink (merged /usr) or a read-only bind."""
    if os.path.islink(path):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind", path, path] if os.path.isdir(path) else []


def bwrap_command(limits: Limits, argv: list[str]) -> list[str]:
    """The bubblewrap command line that runs ``argv`` inside (the harness is at ``/harness.py`` there)."""
    prefix = sys.base_prefix
    cmd = ["bwrap", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    cmd += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        cmd += _top_level(d)
    if not prefix.startswith("/usr/"):  # an interpreter outside /usr (pyenv, conda): its prefix, read-only
        cmd += ["--ro-bind", prefix, prefix]
        for parent in Path(prefix).parents:  # made by bwrap on its empty root; traversable by the program's uid
            if str(parent) != "/":
                cmd += ["--chmod", "0755", str(parent)]
    size = str(limits.disk_mb << 20)
    cmd += ["--ro-bind", str(HARNESS), "/harness.py", "--proc", "/proc", "--dev", "/dev"]
    cmd += ["--size", size, "--tmpfs", "/sandbox", "--size", size, "--tmpfs", "/tmp", "--chdir", "/sandbox"]
    if os.geteuid() == 0:  # the harness gives the tmpfs to its own user id, then becomes it
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN"]
    return cmd + ["--", *argv]


def unshare_command(argv: list[str]) -> list[str]:
    """util-linux's unshare running ``argv``: a network and a PID namespace (in a user namespace of its own when not
    root)."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--mount-proc", *argv]


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30, env={"PATH": os.defpath}).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_PROBED: dict[str, bool] = {}


def available(isolation: str, python: str) -> bool:
    """Whether ``isolation`` runs on this machine (tried once per process)."""
    if isolation not in _PROBED:
        nothing = [python, "-I", "-c", "0"]
        if isolation == "bwrap":
            ok = shutil.which("bwrap") is not None and _works(bwrap_command(Limits(), nothing))
        else:
            ok = shutil.which("unshare") is not None and _works(unshare_command(nothing))
        _PROBED[isolation] = ok
    return _PROBED[isolation]


def _process_count(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts), read from /proc."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return n


class Sandbox:
    """Runs :class:`Job` s, each in a fresh sandboxed process, ``workers`` at a time.

    ``isolation``: ``auto`` (bubblewrap if it runs here, else unshare), ``bwrap`` or ``unshare``;
    ``command``: a command of the user's own instead (a stronger boundary: a VM, gVisor's runsc, a container): it
    is run in a fresh directory holding ``harness.py``, with ``{dir}`` in it replaced by that directory and
    ``harness.py`` appended, and must run Python 3 on that file there. ``allow_network``: without it, a machine
    where no network namespace can be made refuses to run programs (SandboxError); with it they run with the
    harness's limits alone.
    """

    def __init__(
        self,
        limits: Limits = Limits(),
        workers: int = 0,
        isolation: str = "auto",
        command: str = "",
        allow_network: bool = False,
        python: str = "",
    ):
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.limits, self.command = limits, command
        self.workers = workers or os.cpu_count() or 1
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"sandbox workers must be in [1, {MAX_WORKERS}], got {self.workers}")
        self.python = python or os.path.realpath(sys.executable)  # the base interpreter, not a venv's shim
        self.isolation = self._choose(isolation, allow_network)
        self.label = f"grpolab-sandbox-{uuid.uuid4().hex[:12]}"
        """On the command line of every process of this sandbox's programs (``pgrep -f`` finds them)."""
        self._slots = list(range(self.workers))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")

    def _choose(self, isolation: str, allow_network: bool) -> str:
        if self.command:
            return "command"
        order = ("bwrap", "unshare") if isolation == "auto" else (isolation,)
        for kind in order:
            if available(kind, self.python):
                return kind
        if isolation != "auto":
            raise SandboxError(f"sandbox {isolation!r} does not run on this machine (is it installed?)")
        if not allow_network:
            raise SandboxError(
                "no network namespace can be made on this machine (neither bubblewrap nor unshare runs), so "
                "programs could reach the network: install bubblewrap, or pass --code-allow-network to run them "
                "anyway with the harness's limits alone"
            )
        return "none"

    def describe(self) -> str:
        """One line saying what the sandbox isolates, printed at the start of a run."""
        lim = self.limits
        what = {
            "bwrap": "bubblewrap: no network, read-only /usr and nothing else of the host's, private tmpfs, PID "
            "namespace" + (", own user id" if os.geteuid() == 0 else ""),
            "unshare": "unshare: no network, PID namespace; the filesystem is NOT hidden (install bubblewrap)",
            "none": "NO namespaces: programs CAN reach the network and the filesystem (--code-allow-network)",
            "command": f"the command {self.command!r}",
        }[self.isolation]
        return (
            f"code sandbox: {what}; {self.workers} worker(s); limits {lim.timeout_s:g} s wall, {lim.cpu_s} s CPU, "
            f"{lim.memory_mb} MiB memory, {lim.file_mb} MiB files, {lim.processes} processes"
        )

    # ------------------------------------------------------------------ running
    def run(self, jobs: Sequence[Job]) -> list[Outcome]:
        """Outcomes of ``jobs``, in order, ``workers`` at a time."""
        return list(self._pool.map(self._run_one, jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run_one(self, job: Job) -> Outcome:
        with self._lock:
            slot = self._slots.pop()
        try:
            return self._run_in_slot(job, slot)
        finally:
            with self._lock:
                self._slots.append(slot)

    def _spawn_args(self, slot: int) -> tuple[list[str], str | None, dict]:
        """The command, its working directory (None: the sandbox makes its own) and the job's extra fields."""
        extra: dict = {"uid": None, "home": None}
        root = os.geteuid() == 0
        if self.isolation == "bwrap":
            extra["uid"] = UID_BASE + MAX_WORKERS * (os.getpid() % 2**16) + slot if root else None
            return bwrap_command(self.limits, [self.python, "-I", "/harness.py", self.label]), None, extra
        workdir = tempfile.mkdtemp(prefix="grpolab-sandbox-")
        shutil.copy(HARNESS, workdir)
        extra["home"] = workdir
        if self.isolation == "unshare":
            return unshare_command([self.python, "-I", "harness.py", self.label]), workdir, extra
        # A process between the runner and the harness: the program's os.kill(os.getppid(), 9) kills it, not us.
        inner = (
            [a.replace("{dir}", workdir) for a in shlex.split(self.command)] if self.command else [self.python, "-I"]
        )
        return [self.python, "-I", "-c", INTERPOSE, *inner, "harness.py", self.label], workdir, extra

    def _process_limit(self, uid: int | None) -> int:
        """RLIMIT_NPROC for the harness: its own user id's count starts at 0; a shared one (not root) already
        counts every process of the user, so the limit is that count plus the allowance."""
        if uid is not None:
            return self.limits.processes
        return _process_count(os.getuid()) + self.limits.processes

    def _run_in_slot(self, job: Job, slot: int) -> Outcome:
        cmd, workdir, extra = self._spawn_args(slot)
        limits = dataclasses.asdict(self.limits) | {"processes": self._process_limit(extra["uid"])}
        # only what the program's run needs: an expression, never the value it must equal; a stdin, never its output
        checks = [Check("inside", "")] if job.capture else checks_of(job.tests, job.io)
        sent = {"value": "expr", "inside": "stmt"}
        payload = {
            "program": job.program,
            "tests": [{sent[c.kind]: c.sent} for c in checks] if job.tests is not None else None,
            "io": [c.sent for c in checks] if job.io is not None else None,
            "entry_point": job.entry_point,
            "capture": job.capture,
            "limits": limits,
            **extra,
        }
        t0 = time.perf_counter()
        try:
            lines, rc, timed_out = _execute(cmd, workdir, json.dumps(payload).encode(), self.limits.timeout_s)
        finally:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.perf_counter() - t0
        return _outcome(lines, rc, timed_out, checks, seconds, self.limits.cpu_s, self.isolation != "unshare")


# Runs its arguments and exits as a shell would: 128 + N when they died of signal N.
INTERPOSE = "import subprocess, sys; r = subprocess.call(sys.argv[1:]); sys.exit(128 - r if r < 0 else r)"

# Read back at most this much of the harness's report: a program that floods it is cut off, not buffered.
REPORT_CAP = 1 << 20


def _execute(cmd: list[str], cwd: str | None, stdin: bytes, timeout: float) -> tuple[list[bytes], int, bool]:
    """Run ``cmd`` in a process group of its own with ``stdin``; its report lines, exit status, and whether the
    wall-clock timeout killed it."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # nothing of the trainer's: no tokens, no run paths
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
        start_new_session=True,  # its own process group, killed whole below
    )
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read_capped, args=(proc.stdout, chunks), daemon=True)
    reader.start()
    # the payload is written on a thread too: a harness that never reads it (never started, hung) holds a write of
    # more than the pipe's 64 KiB, and the wall-clock timeout below must already be running; its kill ends the write
    writer = threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True)
    writer.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of it is left, timed out or not
        except ProcessLookupError:
            pass
        proc.wait()
    writer.join(timeout=1.0)  # (likewise: a daemon that inherited the pipe may hold it open unread)
    reader.join(timeout=1.0)  # a daemon outside any PID namespace may hold the pipe: do not wait for it
    return b"".join(chunks).splitlines(), proc.returncode, timed_out


def _feed(stream, data: bytes) -> None:
    """Write ``data`` to the harness's stdin and close it; a harness that ended (or was killed) first is no error."""
    with contextlib.suppress(OSError, ValueError):
        stream.write(data)
    with contextlib.suppress(OSError, ValueError):
        stream.close()


def _read_capped(stream, chunks: list[bytes]) -> None:
    total = 0
    while block := stream.read1(1 << 16):
        if total < REPORT_CAP:
            chunks.append(block[: REPORT_CAP - total])
        total += len(block)


def _outcome(
    lines: list[bytes], rc: int, timed_out: bool, checks: list[Check], seconds: float, cpu_s: float, shell_status: bool
) -> Outcome:
    """Read the harness's report: the tests that passed before the end, and how it ended. ``shell_status``: the
    sandbox's first process reports a signal death as exit status 128 + N (bubblewrap, the interposed process)."""
    report = read_report(lines, checks)
    n, inside = len(checks), sum(c.kind == "inside" for c in checks)
    passed = sum(ok for ok, _ in report.results.values())
    first_error = next((err for _, (ok, err) in sorted(report.results.items()) if not ok), "")
    signum = -rc if rc < 0 else (rc - 128 if shell_status and rc > 128 else 0)
    # A SIGKILL that is not our timeout, after cpu_s: the CPU hard limit (a program that ignored SIGXCPU). Memory
    # shows as the MemoryError the address-space limit raises; any other death (the kernel's OOM killer, a program
    # that killed its own process group) is a crash.
    cpu_kill = signum == signal.SIGXCPU or (signum == signal.SIGKILL and seconds >= cpu_s)
    if report.forged:
        status, passed, error = "forged", 0, f"a forged report: {report.forged}"
    elif timed_out or (cpu_kill and not report.done):
        status, error = "timeout", "wall-clock timeout" if timed_out else "CPU time limit"
    elif report.memory:
        status, error = "memory", first_error or "MemoryError"
    elif not report.done:
        why = f"signal {signum}" if signum else f"exit status {rc}"
        status, error = "crashed", f"ended without a report ({why})"
    else:
        status, error = ("passed" if passed == n else "failed"), first_error
    return Outcome(status, passed, n, seconds, error, report.output or "", inside)
