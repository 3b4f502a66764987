"""The checks that start processes (background: they run beside the other checks): DDP and FSDP2 on 2 processes
against 1 (``distributed``), and a generator worker process with its trainer against the inline run (``workers``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import ROOT, Check, Context, first_line, metric_difference, rollouts, run_args, weight_difference

PAIRS = {"ddp": ("32-true", []), "fsdp": ("32-true", ["--fsdp"]), "fsdp-mixed": ("bf16-mixed", ["--fsdp"])}
"""The distributed check's runs on 2 processes: (precision, options), each against 1 process in that precision."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BATCH = ROOT / "tools" / "torchrun_batch.py"
"""Runs a list of grpolab commands in one process, or in each of a torchrun launch's, importing torch once."""


class Launch:
    """``python ARGV`` in a process of its own (the environment's PYTHONPATH plus this checkout), its output kept in a
    log file."""

    def __init__(self, ctx: Context, name: str, argv: list[str], env: dict | None = None):
        self.name, self.log = name, ctx.work / f"{name}.log"
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        environ = {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200", **(env or {})}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env=environ,
                                         cwd=ctx.work)  # fmt: skip

    def wait(self, timeout: float) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name}: still running after {timeout:.0f} s (killed); {self.log}") from None
        if code != 0:
            raise AssertionError(f"{self.name}: exit code {code}: {self.tail()}")

    def tail(self) -> str:
        """The log's last exception line (``SomeError: ...``), else its last line naming an error, else its last."""
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        # torchrun's own summary (ChildFailedError) is left out: the child's error is the one to show
        raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)
                  and "ChildFailedError" not in line]  # fmt: skip
        named = [line for line in lines if "error" in line.lower() and "traceback" not in line.lower()]
        return (raised or named or lines or ["(no output)"])[-1][:300]


def batch(ctx: Context, name: str, commands: list[list[str]], processes: int = 1) -> list[str]:
    """The argv (after ``python``) that runs ``commands`` in one process, or in each of ``processes`` (torchrun)."""
    spec = ctx.work / f"{name}.json"
    spec.write_text(json.dumps(commands))
    if processes == 1:
        return [str(BATCH), str(spec)]
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", str(BATCH), str(spec)]


def finished(run: Path) -> bool:
    from grpolab.models.checkpoint import checkpoint_dirs

    return bool(checkpoint_dirs(run))


class Background:
    """The ``distributed`` and ``workers`` checks (their ``run`` is :meth:`distributed` / :meth:`workers`): their processes start at once and run beside the other checks;
    :meth:`finish` waits for them and compares. The one-process references run in one process, the two-process runs
    in one torchrun launch (tools/torchrun_batch.py), the trainer and its worker each in its own.

    Their backend is ``$GRPOLAB_DIST_BACKEND``'s, else NCCL on CUDA and gloo on the CPU. Where NCCL is asked for and
    fails (two ranks on one GPU), or this torch has none, the check runs on gloo and keeps why in its figures."""

    def __init__(self, ctx: Context, checks: list[Check]):
        """Starts the processes of ``checks`` (this module's, any of them; none: nothing starts)."""
        self.ctx, self.checks, self.t0 = ctx, checks, time.perf_counter()
        names = [c.name for c in checks]
        self.launches: dict[str, Launch] = {}
        self.one = ctx.work / "p1"
        first = os.environ.get("GRPOLAB_DIST_BACKEND") or ("gloo" if ctx.cpu else "nccl")
        self.used = dict.fromkeys(names, first)
        self.nccl: dict[str, str] = {}
        if first == "nccl" and not torch.distributed.is_nccl_available():
            self.used = dict.fromkeys(names, "gloo")
            self.nccl = dict.fromkeys(names, f"this torch ({torch.__version__}) has no NCCL")
        if not names:
            return
        singles = [run_args(ctx, self.one, 2)]
        if "distributed" in names:
            singles.append(run_args(ctx, ctx.work / "p1-mixed", 2, precision="bf16-mixed"))
            self.start("pairs", batch(ctx, "pairs", self.pairs(""), 2), self.env("distributed"))
        self.start("single", batch(ctx, "single", singles))
        if "workers" in names:
            self.start_worker("")

    def env(self, check: str) -> dict | None:
        """The environment a check's processes get: gloo named when gloo is what it uses, else as it is."""
        return {"GRPOLAB_DIST_BACKEND": "gloo"} if self.used[check] == "gloo" else None

    def fall_back(self, check: str, error: AssertionError) -> None:
        """NCCL failed ``check``'s first try: keep why, and use gloo (raises ``error`` if gloo was what failed)."""
        if self.used[check] == "gloo":
            raise error
        self.used[check], self.nccl[check] = "gloo", first_line(error)

    def start_worker(self, suffix: str) -> None:
        """A trainer drawing through one generator worker, and the worker, into ``trainer + suffix``."""
        port, env = free_port(), self.env("workers")
        listen = ["--generators", "1", "--generator-listen", f"127.0.0.1:{port}"]
        self.start("trainer" + suffix, ["-m", "grpolab", *run_args(self.ctx, self.ctx.work / ("trainer" + suffix), 2,
                                                                   *listen)], env)  # fmt: skip
        self.start("worker" + suffix, ["-m", "grpolab", "generator", "--connect", f"127.0.0.1:{port}", "--device",
                                       self.ctx.dev, "--threads", "1"], env)  # fmt: skip

    def pairs(self, suffix: str) -> list[list[str]]:
        """The two-process runs' commands (:data:`PAIRS`), into ``KIND + suffix``."""
        return [run_args(self.ctx, self.ctx.work / (kind + suffix), 2, *extra, precision=precision)
                for kind, (precision, extra) in PAIRS.items()]  # fmt: skip

    def start(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.launches[name] = Launch(self.ctx, name, argv, env)

    def finish(self) -> list[tuple[Check, str, dict, str, float]]:
        """Waits for the processes and runs each check's comparison: ``(check, status, figures, error, seconds)``
        each, the seconds since the processes started; then the checks are done (:attr:`checks` is empty)."""
        out = []
        timeout = 150 if self.ctx.cpu else 240
        try:
            self.launches["single"].wait(timeout)
            reference = None
        except AssertionError as e:
            reference = str(e)
        for check in self.checks:
            try:
                if reference:
                    raise AssertionError(f"the one-process reference runs failed: {reference}")
                figures = check.run(self, timeout)
                out.append((check, "passed", figures, "", time.perf_counter() - self.t0))
            except AssertionError as e:
                out.append((check, "failed", getattr(e, "figures", {}), first_line(e), time.perf_counter() - self.t0))
        for launch in self.launches.values():
            if launch.proc.poll() is None:
                launch.proc.kill()
        self.checks = []
        return out

    def distributed(self, timeout: float) -> dict:
        suffix, error = "", None
        try:
            self.launches["pairs"].wait(timeout)
        except AssertionError as e:
            self.fall_back("distributed", e)
            suffix = "-gloo"
            retry = Launch(self.ctx, "pairs-gloo", batch(self.ctx, "pairs-gloo", self.pairs(suffix), 2),
                           self.env("distributed"))  # fmt: skip
            try:
                retry.wait(timeout)
            except AssertionError as again:
                error = first_line(again)  # the runs that finished before it are still compared
        figures: dict = {}
        for kind, (precision, _) in PAIRS.items():
            figures[kind] = {"backend": self.used["distributed"]} | self.why_not_nccl("distributed")
            run = self.ctx.work / (kind + suffix)
            if not finished(run):
                figures[kind]["error"] = error or "the run wrote no checkpoint"
                continue
            figures[kind] |= self.compare(run, self.one if precision == "32-true" else self.ctx.work / "p1-mixed")
        # fp32: the same rollouts and weights to float noise; bf16-mixed: the products' rounding differs with the
        # rows a process holds, so a sampled token may flip (the figure says how many), the weights stay close
        bad = [k for k, v in figures.items() if "error" in v or not self.holds(k, v)]
        if bad:
            error = AssertionError(f"{', '.join(bad)} on 2 processes: {[figures[k] for k in bad]}")
            error.figures = figures
            raise error
        return figures

    @staticmethod
    def holds(kind: str, figures: dict) -> bool:
        """fp32: the same rollouts and weights within 1e-4; bf16-mixed: weights within 1e-3."""
        if "mixed" in kind:
            return figures["weights_rel_diff"] <= 1e-3
        return figures["same_rollouts"] and figures["weights_rel_diff"] <= 1e-4

    def workers(self, timeout: float) -> dict:
        suffix = ""
        try:
            self.launches["trainer"].wait(timeout)
        except AssertionError as e:
            self.fall_back("workers", e)  # NCCL may refuse a trainer and a worker on one GPU
            suffix = "-gloo"
            self.launches["worker"].proc.kill()
            self.start_worker(suffix)
            self.launches["trainer" + suffix].wait(timeout)
        self.launches["worker" + suffix].wait(30)
        figures = self.compare(self.ctx.work / ("trainer" + suffix))
        figures |= {"backend": self.used["workers"]} | self.why_not_nccl("workers")
        if not (figures["same_rollouts"] and figures["weights_rel_diff"] <= 1e-5):
            error = AssertionError(f"the worker's run differs from the inline one: {figures}")
            error.figures = figures
            raise error
        return figures

    def why_not_nccl(self, check: str) -> dict:
        return {"nccl": self.nccl[check]} if check in self.nccl else {}

    def compare(self, run: Path, reference: Path | None = None) -> dict:
        reference = reference or self.one
        mine, theirs = rollouts(run), rollouts(reference)
        return dict(same_rollouts=mine == theirs, rollouts=len(mine),
                    rollouts_differing=sum(a != b for a, b in zip(mine, theirs)) + abs(len(mine) - len(theirs)),
                    weights_rel_diff=weight_difference(reference, run),
                    metrics_rel_diff=metric_difference(reference, run))  # fmt: skip


def distributed_summary(figures: dict) -> str:
    nccl = next((v["nccl"] for v in figures.values() if "nccl" in v), None)
    return "; ".join(f"{k} ({v['backend']}) {v['rollouts'] - v['rollouts_differing']}/{v['rollouts']} rollouts "
                     f"equal, weights within {v['weights_rel_diff']:.1e}" for k, v in figures.items()) + (
                     f" [NCCL failed first: {nccl[:120]}]" if nccl else "")  # fmt: skip


def workers_summary(figures: dict) -> str:
    nccl = figures.get("nccl")
    return (f"({figures['backend']}) {figures['rollouts'] - figures['rollouts_differing']}/{figures['rollouts']} "
            f"rollouts equal, weights within {figures['weights_rel_diff']:.1e}"
            + (f" [NCCL failed first: {nccl[:120]}]" if nccl else ""))  # fmt: skip


DISTRIBUTED = Check(
    "distributed", "background", Background.distributed, distributed_summary,
    "DDP and FSDP2 (fp32) and FSDP2 (bf16-mixed) on 2 processes sharing one GPU (NCCL, else gloo for CUDA tensors, "
    "said which) against 1 process: the same rollouts, the weights' largest relative difference",
    passes="fp32 (DDP, FSDP2): the same rollouts as one process and weights within 1e-4 relative; bf16-mixed: "
    "weights within 1e-3",
)  # fmt: skip
WORKERS = Check(
    "workers", "background", Background.workers, workers_summary,
    "a generator worker process (`grpolab generator`) and its trainer on the one device, 2 steps: the same rollouts "
    "and weights as the inline run",
    passes="the same rollouts as the inline run and weights within 1e-5 relative",
)  # fmt: skip
