"""Configs and runs as a command builds them (the built-in model in a small, deterministic shape), the command lines of
the multi-process comparisons, and the checks two runs are compared with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpolab.config import fields

from .cli import run_cli

# A few steps of the built-in model at one thread: small enough for the fast tier, deterministic.
SMALL = dict(
    model="builtin",
    prompts_per_step=4,
    group_size=4,
    eval_questions=16,
    eval_samples=2,
    max_new_tokens=48,
    progress=False,
    threads=1,
    device="cpu",
    # a generator process or worker that stalls fails its test in 2 minutes, naming it, well inside pytest-timeout's
    # 600 s (the default, 900 s, outlived the test: a stall looked like the suite hanging)
    generator_timeout=120.0,
    # the hacking signs watch; they never change a run's rollouts or weights (tests/training/test_hacking.py): off
    # here, so that the many small runs pay no Gram pass and no honeypot draws
    hacking_every=0,
    honeypots="none",
)


def small_cfg(out: Path, **over):
    """A :class:`grpolab.config.train.TrainConfig` of the built-in model in ``SMALL``'s shape, writing to ``out``."""
    from grpolab.config.train import TrainConfig

    return TrainConfig(out=str(out), **{**SMALL, **over})


def quiet(*args, **kwargs) -> None:
    """A ``log`` that says nothing."""


def for_run(cls, spec: str, model_field: str, **options):
    """A ``cls`` config as ``grpolab`` builds one for the model or run ``spec``: the run's own options as the
    defaults (:func:`grpolab.eval.runs.run_defaults`), then ``options``."""
    from grpolab.eval.runs import run_defaults

    base = run_defaults(cls, spec) or cls()
    return fields.replace(base, **{model_field: spec}, **options)


def task_of(cfg):
    """The :class:`grpolab.eval.runs.RunTask` of a training config: what a probe of its run measures on."""
    from grpolab.eval.runs import RunTask, Target
    from grpolab.training.setup import checked_config

    checked = checked_config(cfg)
    return RunTask.of(Target(checked.policy.model, None, checked.to_dict()))


def by_step(rows: list[dict]) -> dict[int, dict]:
    """Metrics rows by step, each step once."""
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate rows for steps {steps}"
    return {r["step"]: r for r in rows}


def metrics_by_step(out: Path) -> dict[int, dict]:
    """A run's metrics by step, times left out."""
    from grpolab.training.runlog import read_metrics

    return {s: {k: v for k, v in r.items() if not k.startswith("time/")} for s, r in by_step(read_metrics(out / "metrics.jsonl")).items()}  # fmt: skip


def state_dict(path) -> dict[str, torch.Tensor]:
    """The weights of a saved model directory (a checkpoint)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def rollouts_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


def assert_same_metrics(a: Path, b: Path) -> None:
    """Two runs' metrics agree step by step (``rel`` 1e-4): the float noise of differently batched forwards
    (``engine/*``), the rank-0 records (``credit/*``), the times and a generator's own books (``generators/*``, vLLM's ``vllm/*``:
    its seconds) aside."""
    from grpolab.training.runlog import read_metrics

    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(len(ra)))  # one row per step
    for x, y in zip(ra, rb):
        for k, v in x.items():
            if k.startswith(("time/", "engine/", "credit/", "generators/", "vllm/")) or v is None:
                continue
            if k == "doctor/weights_unmoved_frac":  # a few of ~1e5 sampled fp32 weights sit at the edge of rounding
                assert y[k] == pytest.approx(v, abs=1e-3), (x["step"], k, v, y[k])  # and flip with float noise
                continue
            # a loss is a difference of larger terms: its float noise is theirs (1.4e-6 on 2.2e-3 held to AVX2)
            tol = 1e-5 if k.startswith("loss/") else 1e-6
            assert y[k] == pytest.approx(v, rel=1e-4, abs=tol), (x["step"], k, v, y[k])


# The flags of the multi-process comparisons' runs (the held-out questions: split over 2 processes, 4 each).
CLI_BASE = [
    *("--prompts-per-step", "4", "--group-size", "4", "--eval-questions", "8", "--eval-samples", "2"),
    *("--warmup-steps", "0", "--log-rollouts", "--no-progress", "--device", "cpu"),
    *("--hacking-every", "0", "--honeypots", "none"),  # as SMALL: the signs have tests of their own
]
# The KL reference, importance ratios (mu = 2), micro-batches and token-mean's global token count.
# Every run also records 2 rollouts a step token by token (rank 0's own: its block of the step's prompts).
KL_MU = [
    *("--beta", "0.04", "--mu", "2", "--micro-batch", "2", "--estimator", "rloo", "--aggregation", "token-mean"),
    *("--log-token-credit", "2"),
]
REL_TOL = 1e-5


def train_args(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False) -> list[str]:
    """The arguments of ``grpolab train`` of ``steps`` steps in ``CLI_BASE``'s shape (plus ``extra``) into
    ``tmp/name``."""
    return ["train", "--out", str(tmp / name), "--steps", str(steps), *CLI_BASE, *extra] + (
        ["--resume"] if resume else []
    )


def train_cli(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False) -> Path:
    """``grpolab train`` of ``steps`` steps in ``CLI_BASE``'s shape (plus ``extra``) into ``tmp/name``."""
    res = run_cli(train_args(tmp, name, steps, *extra, resume=resume), cwd=tmp, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / name


def assert_same_params(a: Path, b: Path, step: int = 3) -> None:
    """Two runs' weights at ``step`` agree to ``REL_TOL`` (relative, per tensor), and they did move from the start."""
    from safetensors.torch import load_file

    from grpolab.models.policy import ASSET_DIR

    pa = load_file(str(a / "checkpoints" / f"step_{step}" / "model.safetensors"))
    pb = load_file(str(b / "checkpoints" / f"step_{step}" / "model.safetensors"))
    start = load_file(str(ASSET_DIR / "model.safetensors"))
    moved = max(float((pa[k] - start[k]).norm() / start[k].norm()) for k in start)
    assert moved > 100 * REL_TOL, f"the runs barely trained (moved {moved:.2e}): the comparison would prove nothing"
    assert pa.keys() == pb.keys() == start.keys()  # FSDP's gathered checkpoint too: the tied head saved once
    for k in start:
        rel = float((pa[k] - pb[k]).norm() / pa[k].norm())
        assert rel <= REL_TOL, f"{k}: relative difference {rel:.2e} between {a.name} and {b.name}"


def assert_identical_runs(a: Path, b: Path, step: int) -> None:
    """Two runs are the same bit for bit: every metric (times and the generators' own books aside), every
    logged rollout, and the weights saved at ``step``."""
    from safetensors.torch import load_file

    def books(run: Path) -> dict:
        return {s: {k: v for k, v in r.items() if not k.startswith("generators/")} for s, r in metrics_by_step(run).items()}  # fmt: skip

    assert books(a) == books(b)
    assert rollouts_of(a) == rollouts_of(b)
    wa = load_file(str(a / "checkpoints" / f"step_{step}" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / f"step_{step}" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
