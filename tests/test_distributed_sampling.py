"""--sampling filter|adaptive and the loss variants on two processes: the rollouts, metrics and weights of one.

A file of its own so that the test scheduler can run it beside test_distributed.py
(resuming in each mode is tested in test_sampling.py, in one process). The two-process runs share one torchrun
launch (helpers.torchrun_batch); each one-process run is the command line in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import KL_MU, assert_same_metrics, assert_same_params, rollouts_of, torchrun_batch, train_args, train_cli

from grpolab.training.runlog import read_metrics

pytestmark = pytest.mark.slow  # every test here starts processes (torchrun) or an engine


def _sampling(mode: str) -> list[str]:
    """filter's later rounds split unevenly over the ranks (a rank may keep no group); adaptive's groups differ
    in size and the allocation is taken on the gathered pilots. KL, ratios and micro-batches on, as in the
    reference pair."""
    args = ["--sampling", mode, "--pilot-size", "2", "--reward-fn", "reward_fixtures:code_sum_mod4"]
    return [*args, "--format-weight", "0", *KL_MU]


# The options whose statistics span the whole step: the batch reward std (--scale-rewards batch), the entropy
# threshold over every rank's tokens (--top-entropy-quantile), the token count without truncated completions
# (--mask-truncated, token-mean); with GSPO ratios, two-sided clipping, the overlong penalty, KL and mu = 2.
VARIANTS = [
    *("--estimator", "grpo_std", "--scale-rewards", "batch", "--importance-sampling", "sequence"),
    *("--clip-delta", "1.5", "--mask-truncated", "--max-new-tokens", "20", "--overlong-buffer", "4"),
    *("--top-entropy-quantile", "0.3", "--beta", "0.04", "--mu", "2", "--micro-batch", "2"),
    *("--aggregation", "token-mean"),
]
# --group-size-control rank: G doubles (B halves) when the probe's rank falls, the same decision on every rank
CONTROL = [*KL_MU, "--probe-every", "1", "--probe-groups", "2", "--group-size-control", "rank"]
CONTROL += ["--control-patience", "1", "--control-share", "0.9"]
CASES = {"filter": _sampling("filter"), "adaptive": _sampling("adaptive"), "variants": VARIANTS, "control": CONTROL}
STEPS = {"control": 4}  # else 2


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Each case's two steps on two processes, one launch for all."""
    tmp = tmp_path_factory.mktemp("two")
    torchrun_batch([train_args(tmp, name, STEPS.get(name, 2), *args) for name, args in CASES.items()], cwd=tmp)
    return tmp


def _one_and_two_processes_agree(tmp_path: Path, two: Path, case: str, monkeypatch) -> list[dict]:
    """Two steps on one process and on two: the same rollouts, metrics and weights. Returns the step rows."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the run imports reward_fixtures
    steps = STEPS.get(case, 2)
    one = train_cli(tmp_path, "one", steps, *CASES[case])
    assert rollouts_of(two / case) == rollouts_of(one)
    assert_same_metrics(one, two / case)
    assert_same_params(one, two / case, step=steps)
    return read_metrics(one / "metrics.jsonl")[1:]


@pytest.mark.parametrize("mode", ["filter", "adaptive"])
def test_sampling_modes_on_two_processes_equal_one_process(tmp_path, two, monkeypatch, mode):
    rows = _one_and_two_processes_agree(tmp_path, two, mode, monkeypatch)
    key = "sampling/rounds" if mode == "filter" else "sampling/group_size_max"
    assert max(r[key] for r in rows) > (1 if mode == "filter" else 4), "the runs must exercise the mode"


def test_loss_variants_on_two_processes_equal_one_process(tmp_path, two, monkeypatch):
    rows = _one_and_two_processes_agree(tmp_path, two, "variants", monkeypatch)
    assert all(0 < r["completion/truncated_frac"] < 1 for r in rows), (
        "some completions must be cut for the test to bite"
    )


def test_the_rank_controlled_group_size_on_two_processes_equals_one_process(tmp_path, two, monkeypatch):
    rows = _one_and_two_processes_agree(tmp_path, two, "control", monkeypatch)
    sizes = [r["control/group_size"] for r in rows]
    assert sizes[0] == 4 and sizes[-1] == 8, sizes  # the group size changed within the run (16 rollouts, B 4 -> 2)
