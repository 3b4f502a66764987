"""Every CUDA path of grpolab, a few steps each, in one command: what holds on this GPU, with a figure each.

    tools/gpu-check [--cpu] [--only NAMES] [--skip NAMES] [--json FILE] [--work DIR] [--budget SECONDS]
    make gpu-check ARGS="--cpu"

Made for a GPU lent for minutes: nothing to write on the day, one line per check as it ends (passed, failed with
the error's first line, or skipped with why), every figure in a JSON file ($OUT/gpu-check.json when $OUT is set,
the device machine's output folder; else --json), written after each check. The models are random, so nothing is
downloaded: a model of Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 query and 2 key/value heads, vocabulary
151,936) over a character tokenizer padded to its vocabulary, a Qwen2.5-VL of 3B's shapes, and the built-in models.
With --cpu the same checks run on the CPU, the Qwen models at a few layers of width 64 and a vocabulary of 1,024: the
suite runs it, so a broken check is found before a GPU comes. On CUDA the checks not started within --budget
seconds (420) are skipped, said so, so that the run ends inside a device's time.

This file is the harness: the options, the environment line, the budget, running each check as its ``how`` says,
its line and the JSON. The checks are in tools/gpu_checks/, one Check each (its name, how it runs, its run, which
asserts its pass rule, its summary line), listed in the order they run by gpu_checks.CHECKS; --help lists them.

Exit status: 0 when no check failed (skipped ones included), 1 otherwise, 2 when there is no CUDA device and --cpu
was not given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

import gpu_checks  # before torch: it sets up the process (cuBLAS's workspace, this checkout on sys.path)
import torch
from gpu_checks.common import ROOT, Check, Context, Skip, first_line, padded_tokenizer
from gpu_checks.processes import Background
from gpu_checks.vllm_sync import check_vllm, check_vllm_lora

__all__ = ["Context", "check_vllm", "check_vllm_lora", "main", "padded_tokenizer"]
"""Besides main, what tests/e2e/test_gpu_check.py and tests/e2e/test_vllm_engine.py use."""


def checks_help() -> str:
    """The registry for --help: each check's name and what it does, in the order they run."""

    def names(how: str) -> str:
        quoted = [f"`{c.name}`" for c in gpu_checks.CHECKS if c.how == how]
        return " and ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)

    intro = (f"The checks, in the order they run (the processes of {names('background')} start first and run beside "
             f"the next ones; {names('timed')} time things or fill the GPU, so they run after those processes have "
             "ended, alone):")  # fmt: skip
    rows = [textwrap.fill(f"{c.about}. Passes when: {c.passes}.", 117, initial_indent=f"  {c.name:<12} ",
                          subsequent_indent=" " * 15) for c in gpu_checks.CHECKS]  # fmt: skip
    return "\n".join([textwrap.fill(intro, 117), "", *rows])


def say(result: dict) -> None:
    status, name, seconds = result["status"], result["name"], result["seconds"]
    text = result.get("reason") or result.get("error") or result.get("summary", "")
    print(f"{status:<7} {name:<12} {seconds:6.1f} s  {text}", flush=True)


def run_in_process(ctx: Context, check: Check) -> dict:
    t0 = time.perf_counter()
    result: dict = {"name": check.name}
    try:
        figures = check.run(ctx)
        result |= {"status": "passed", "figures": figures}
        try:
            result["summary"] = check.summary(figures)
        except Exception as e:  # a figure the line could not show: the JSON still has them all
            result["summary"] = f"(figures in the JSON; {first_line(e)})"
    except Skip as e:
        result |= {"status": "skipped", "reason": str(e)}
    except Exception as e:
        result |= {"status": "failed", "error": first_line(e), "traceback": traceback.format_exc()[-6000:]}
    result["seconds"] = time.perf_counter() - t0
    return result


def _nccl_version() -> str:
    """NCCL's version as torch reports it (a tuple, or an int in some builds), or why there is none."""
    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # the facts line must not stop the checks
        return f"unknown ({first_line(e)})"
    return ".".join(map(str, version)) if isinstance(version, tuple | list) else str(version)


def environment(ctx: Context) -> dict:
    import transformers

    facts = {"mode": "cpu" if ctx.cpu else "cuda", "torch": torch.__version__, "cuda": torch.version.cuda,
             "transformers": transformers.__version__, "python": platform.python_version(),
             "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}  # fmt: skip
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        facts |= {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
                  "nccl": _nccl_version()}  # fmt: skip
    with contextlib.suppress(Exception):
        facts["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True).stdout.strip()  # fmt: skip
    return facts


def selected(only: str, skip: str) -> list[Check]:
    """The checks --only and --skip leave, in the registry's order; a name no check has ends the command."""
    chosen = [c for c in gpu_checks.CHECKS if not only or c.name in only.split(",")]
    unknown = {n for n in (only + "," + skip).split(",") if n} - set(gpu_checks.BY_NAME)
    if unknown:
        names = ", ".join(gpu_checks.BY_NAME)
        raise SystemExit(f"gpu-check: no check named {', '.join(sorted(unknown))}; the checks: {names}")
    return [c for c in chosen if c.name not in skip.split(",")]


def run_checks(ctx: Context, checks: list[Check], background: Background, record, budget: float,
               started: float) -> None:  # fmt: skip
    """Each of ``checks`` in order, the background's joined before the first timed one; a check not started within
    ``budget`` seconds (0: none) of ``started`` is skipped, said so."""

    def join_background() -> None:
        for check, status, figures, error, seconds in background.finish():
            line = {"name": check.name, "status": status, "figures": figures, "seconds": seconds}
            record(line | ({"error": error} if error else {"summary": check.summary(figures)}))

    for check in checks:
        if check.how == "timed" and background.checks:
            join_background()
        if check.how == "background":
            continue
        spent = time.monotonic() - started
        if budget and spent > budget:  # what is left is said, and the JSON is whole
            record({"name": check.name, "status": "skipped", "seconds": 0.0,
                    "reason": f"out of time: {spent:.0f} s spent of --budget {budget:g}"})  # fmt: skip
            continue
        record(run_in_process(ctx, check))
    if background.checks:
        join_background()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__, epilog=checks_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--cpu", action="store_true", help="run every check on the CPU (small shapes)")
    p.add_argument("--only", default="", help=f"comma-separated checks to run (of {', '.join(gpu_checks.BY_NAME)})")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out")
    p.add_argument("--json", default="", help="where the figures go (default: $OUT/gpu-check.json when $OUT is set)")
    p.add_argument("--work", default="", help="a directory for the runs (default: a temporary one, removed after)")
    p.add_argument("--budget", type=float, default=None, help="seconds after which the checks not yet started are "
                   "skipped, said so (default: 420 on CUDA, a device lent for minutes; none with --cpu)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    checks = selected(args.only, args.skip)
    started = time.monotonic()
    if args.budget is None:
        args.budget = 0.0 if args.cpu else 420.0
    import transformers

    transformers.utils.logging.disable_progress_bar()  # loading and saving bars between the checks' lines
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; --cpu runs the checks on the CPU", file=sys.stderr)
        return 2
    target = args.json or (os.path.join(os.environ["OUT"], "gpu-check.json") if os.environ.get("OUT") else "")
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(torch.device("cpu" if args.cpu else "cuda:0"), args.cpu, work)
        if ctx.device.type == "cuda":
            from grpolab.common.devices import prepare_device

            torch.cuda.set_device(ctx.device)
            prepare_device(ctx.device)
        facts = environment(ctx)
        print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
        report = {"environment": facts, "checks": {}}
        background = Background(ctx, [c for c in checks if c.how == "background"])
        results = []

        def record(result: dict) -> None:
            say(result)
            results.append(result)
            report["checks"][result["name"]] = {k: v for k, v in result.items() if k != "name"}
            if target:  # written after every check: a run cut short keeps what it reached
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                Path(target).write_text(json.dumps(report, indent=2, default=str))

        run_checks(ctx, checks, background, record, args.budget, started)
    counts = {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "skipped")}
    print(f"gpu-check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
          + (f"; figures in {target}" if target else ""), flush=True)  # fmt: skip
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
