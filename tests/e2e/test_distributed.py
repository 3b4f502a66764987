"""Data-parallel GRPO on torch.distributed: the same run on 1 and on 2 processes (gloo, CPU).

Unit tier: how work is split over ranks, the backend choice, the launcher's argument
handling and the config checks. Smoke tier: real two-process runs of `grpolab train` (torchrun,
gloo; one launch runs them all) of the built-in model against single-process runs with the same
global batch and seed: identical rollouts, parameters equal within 1e-5 relative, and a
run stopped on one process count resumed on another; the same for the sampling modes (filter, adaptive), the loss
variants whose statistics span the whole step, the rank-controlled group size, and a stale run (--max-staleness 1,
each rank drawing in a generator process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli, torchrun_batch
from helpers.paths import TESTS
from helpers.processes import free_port, rank_of_two_failing_on_main
from helpers.runs import (
    CLI_BASE,
    KL_MU,
    REL_TOL,
    assert_same_metrics,
    assert_same_params,
    rollouts_of,
    train_args,
    train_cli,
)
from safetensors.torch import load_file

from grpolab.common.distributed import World, backend
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.models.policy import ASSET_DIR
from grpolab.training.launch import drop_flag
from grpolab.training.runlog import read_metrics

pytestmark = pytest.mark.slow  # every test here starts processes (torchrun) or an engine

# ---------------------------------------------------------------- unit


@pytest.mark.parametrize("n,size", [(16, 2), (7, 2), (5, 3), (2, 4), (0, 2)])
def test_split_blocks_concatenate_to_the_whole_range_in_rank_order(n, size):
    blocks = [World(rank=r, size=size).split(n) for r in range(size)]
    assert [i for b in blocks for i in b] == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_single_world_owns_everything():
    w = World()
    assert w.split(10) == range(10) and w.is_main and not w.distributed


def test_backend_is_gloo_on_cpu_and_adds_nccl_for_cuda(monkeypatch):
    monkeypatch.delenv("GRPOLAB_DIST_BACKEND", raising=False)
    assert backend(cuda_available=False) == "gloo"
    assert backend(cuda_available=True) == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("GRPOLAB_DIST_BACKEND", "gloo")  # gloo for CUDA tensors too: two ranks on one GPU
    assert backend(cuda_available=True) == "gloo"
    from grpolab.rollout.remote.common import transport_backend

    assert transport_backend("cuda:0", "cuda:0") == "gloo"
    monkeypatch.setenv("GRPOLAB_DIST_BACKEND", "nccl")
    if not torch.distributed.is_nccl_available():  # a CPU build: named NCCL is refused in one line
        with pytest.raises(ValueError, match="GRPOLAB_DIST_BACKEND=nccl: this torch .* has no NCCL"):
            backend(cuda_available=True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)  # as on a GPU build
    # NCCL where tensors are on CUDA, gloo for CPU tensors and a CPU worker's weights
    assert backend(cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert (transport_backend("cuda:0", "cuda:1"), transport_backend("cpu", "cuda:0")) == ("nccl", "gloo")
    monkeypatch.setenv("GRPOLAB_DIST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="must be gloo or nccl"):
        backend(cuda_available=True)


def test_drop_flag_removes_the_flag_and_its_value_only():
    args = ["--nproc", "2", "--steps", "3", "--nproc=4", "--nprocx", "1"]
    assert drop_flag(args, "--nproc") == ["--steps", "3", "--nprocx", "1"]


@pytest.mark.parametrize(
    "over,world,msg",
    [
        (dict(prompts_per_step=5), 2, "prompts-per-step"),
        (dict(fsdp=True, lora_rank=4), 2, "fsdp"),
        (dict(fsdp=True, probe_every=5), 2, "probe"),
        (dict(nproc=-1), 1, "nproc"),
    ],
)
def test_invalid_multi_process_configs_name_the_field(over, world, msg):
    cfg = TrainConfig(**over)
    with pytest.raises(ConfigError, match=msg):
        cfg.validate_world(world)


def test_nproc_with_an_indivisible_batch_is_refused_before_launching(tmp_path):
    res = run_cli(["train", "--out", str(tmp_path / "x"), "--nproc", "2", "--prompts-per-step", "5"], cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: --prompts-per-step: 5 prompts cannot be split over 2")
    assert "launching" not in res.stderr


def test_a_valid_config_passes_on_any_divisor_world():
    TrainConfig(prompts_per_step=4).validate_world(4)
    TrainConfig(prompts_per_step=4, fsdp=True).validate_world(2)


# ---------------------------------------------------------------- runs


def _params(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "model.safetensors"))


# The reference pair (and FSDP, resume, two nodes against it): KL, ratios, micro-batches and the
# spectrum probe, whose groups can sit on either rank.
REF = [*KL_MU, "--probe-every", "1", "--probe-groups", "3"]


LORA = ["--lora-rank", "4", "--beta", "0.04", "--lr", "1e-3", "--dtype", "float64"]
_i = REF.index("--micro-batch")  # packing: passes planned by a token budget instead of 2 rows a pass
PACKED = [*REF[:_i], *REF[_i + 2 :], "--packing", "--micro-batch-tokens", "64"]
MIXED = [*KL_MU, "--precision", "bf16-mixed", "--lr", "1e-4"]  # bf16 autocast over fp32 masters, bf16 rollouts
BAD = ["--reward-fn", "reward_fixtures:overflow_when_correct_muldiv", "--estimator", "vanilla", "--format-weight", "0"]
# Every two-process run of this file, by directory: (steps, options). One torchrun launch runs them all
# (helpers.cli.torchrun_batch); `grpolab train --nproc 2` itself is run by the two-node, SIGTERM and vLLM tests.
TWO = {
    "p2": (3, REF),
    "lora2": (3, LORA),
    "fsdp": (3, [*KL_MU, "--fsdp"]),  # the probe needs whole parameters; it changes no weight
    "packed2": (3, PACKED),
    "resumed": (2, [*KL_MU, "--fsdp"]),  # resumed on one process below
    "nan2": (2, BAD),
    "mixed2": (2, MIXED),
    "fsdp_mixed": (2, [*MIXED, "--fsdp"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    torchrun_batch([train_args(tmp, name, steps, *args) for name, (steps, args) in TWO.items()], cwd=tmp)
    return tmp, {"p1": train_cli(tmp, "p1", 3, *REF), "p2": tmp / "p2"}


@pytest.mark.long  # scheduled first (tests/conftest.py)
def test_two_processes_sample_identical_rollouts(runs):
    _, r = runs
    one, two = rollouts_of(r["p1"]), rollouts_of(r["p2"])
    assert len(one) == 3 * 16
    assert one == two
    assert len({x["advantage"] != 0 for x in one}) == 2, "some rollouts should carry credit and some not"


def test_two_processes_reach_the_same_parameters(runs):
    _, r = runs
    assert_same_params(r["p1"], r["p2"])


def test_two_processes_log_the_same_metrics_once(runs):
    _, r = runs
    assert_same_metrics(r["p1"], r["p2"])
    assert all(row["loss/kl"] is not None for row in read_metrics(r["p2"] / "metrics.jsonl")[1:])
    probed = [row for row in read_metrics(r["p2"] / "metrics.jsonl")[1:] if row["probe/groups_measured"]]
    assert probed and all(row["probe/eff_rank"] > 0 for row in probed)
    saved = json.loads((r["p2"] / "config.json").read_text())
    assert saved["world_size"] == 2


def _credit(run: Path) -> dict[tuple, dict]:
    lines = (run / "token_credit.jsonl").read_text().splitlines()
    return {(c["step"], c["prompt"], c["rollout"]): c for c in map(json.loads, lines)}


def _assert_rank_0_records_its_own(one: Path, two: Path) -> None:
    """Two ranks: rank 0 records 2 rollouts a step from its block (prompts 0-1 of 4); a rollout both runs recorded
    has the same tokens, advantages and log-prob changes (to float noise)."""
    a, b = _credit(one), _credit(two)
    assert sorted({k[0] for k in b}) == [1, 2, 3] and len(b) == 6
    assert all(k[1] in (0, 1) for k in b)
    both = a.keys() & b.keys()
    assert both, "the runs should record some rollout in common"
    for k in both:
        assert a[k]["tokens"] == b[k]["tokens"] and a[k]["adv"] == pytest.approx(b[k]["adv"], abs=1e-6)
        assert a[k]["dlogp"] == pytest.approx(b[k]["dlogp"], abs=1e-5)


def test_token_credit_is_recorded_by_rank_0(runs):
    _, r = runs
    _assert_rank_0_records_its_own(r["p1"], r["p2"])
    rows = read_metrics(r["p2"] / "metrics.jsonl")[1:]
    assert all(row["credit/rollouts"] == 2 and row["credit/abs_mean"] > 0 for row in rows)


def test_lora_adapters_train_the_same_on_two_processes(runs):
    """peft adapters under DDP, with the KL reference the same model with the adapter disabled.

    In float64: the adapter's B starts at zero and AdamW's first steps are g / (|g| + eps), about lr whatever
    the gradient's size, so in fp32 the two runs' rounding differences (different prompt padding per rank)
    reach 1.2e-5 relative in B (measured); in float64 they are 1e-15, and any error of the method would show."""
    tmp, _ = runs
    one, two = train_cli(tmp, "lora1", 3, *LORA), tmp / "lora2"
    assert rollouts_of(one) == rollouts_of(two)
    a, b = (load_file(str(r / "checkpoints" / "step_3" / "adapter_model.safetensors")) for r in (one, two))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) <= REL_TOL, k


def test_fsdp_matches_one_process(runs):
    tmp, r = runs
    fsdp = tmp / "fsdp"
    assert rollouts_of(fsdp) == rollouts_of(r["p1"])
    assert_same_params(r["p1"], fsdp)
    _assert_rank_0_records_its_own(r["p1"], fsdp)  # the forward after the update is a collective here


def test_packing_on_two_processes_matches_one_process(runs):
    """--packing with passes planned by a token budget (1-3 rollouts each, a different number per rank) on two
    processes: the rollouts, metrics and weights of the padded run on one."""
    tmp, r = runs
    packed = tmp / "packed2"
    assert rollouts_of(packed) == rollouts_of(r["p1"])
    assert_same_params(r["p1"], packed)
    assert_same_metrics(r["p1"], packed)


def test_a_run_resumes_on_another_process_count(runs):
    """Two steps sharded over 2 processes, the third on 1: the uninterrupted single-process run."""
    tmp, r = runs
    resumed = train_cli(tmp, "resumed", 3, *KL_MU, resume=True)  # its first two steps: TWO["resumed"]
    assert rollouts_of(resumed) == rollouts_of(r["p1"])
    assert_same_params(r["p1"], resumed)
    steps = [json.loads(line)["step"] for line in (resumed / "token_credit.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 2, 2, 3, 3]  # cut back to the checkpoint, then written again


@pytest.mark.hardware
def test_bf16_mixed_on_two_processes_matches_one_process(runs):
    """bf16-mixed under DDP and FSDP2, two steps: the same rollouts as one process (the bf16 sampler copies are cast
    from equal fp32 masters) and the same update. The masters, the gradients' reduction and the optimizer
    state are fp32; only the products run in bf16, on each rank's rows as on one process's. The updates agree to 5%.

    Two steps, not more, and the updates compared, not the weights to REL_TOL: a weight gradient is a product
    summed over the rows, and its bf16 result is rounded once over all the rows on one process but once per half on
    two. Adam's first step moves by the gradient's sign, which that rounding leaves alone; from the second on it
    moves by its size, and by the third the weights differ enough (1.1e-3 relative on a CPU with AMX) to sample
    other tokens. After two, the rollouts of both steps are equal and the two-process update is the one-process one
    to within 5% per tensor (measured at most 0.8%, on the embedding, held to AVX2; bf16's spacing is 0.4%); with each rank
    left its own gradient (a planted comm hook that skips the all-reduce) the update was off by 114%."""
    tmp, _ = runs
    one = train_cli(tmp, "mixed1", 2, *MIXED)
    saved = json.loads((one / "config.json").read_text())
    assert (saved["precision"], saved["rollout_dtype"]) == ("bf16-mixed", "bfloat16")
    start = load_file(str(ASSET_DIR / "model.safetensors"))
    for two in (tmp / "mixed2", tmp / "fsdp_mixed"):
        assert rollouts_of(two) == rollouts_of(one), two.name
        p1, p2 = _params(one, 2), _params(two, 2)
        assert max(float((p1[k] - start[k]).norm() / start[k].norm()) for k in start) > 1e-3  # it trained
        for k in start:
            update = float((p1[k] - start[k]).norm())
            assert p2[k].dtype == torch.float32 and float((p1[k] - p2[k]).norm()) <= 0.05 * update, (two, k)


def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(runs, monkeypatch):
    """A rank with a non-finite loss still runs its backward (no rank is left waiting in the
    gradient reduction), and the update is skipped, and counted, everywhere: as on one process."""
    tmp, _ = runs
    monkeypatch.syspath_prepend(str(TESTS))  # the run imports reward_fixtures
    one, two = train_cli(tmp, "nan1", 2, *BAD), tmp / "nan2"
    assert rollouts_of(one) == rollouts_of(two)
    skipped = [[r["loss/skipped_updates"] for r in read_metrics(run / "metrics.jsonl")[1:]] for run in (one, two)]
    assert skipped[0] == skipped[1] and sum(skipped[0]) >= 1, skipped
    # In a skipped step the overflow sat on one rank only: the other's loss was finite.
    overflowed = [
        {r["prompt"] // 2 for r in rollouts_of(two) if r["step"] == step and r["reward"] > 1e30} for step in (1, 2)
    ]
    assert any(len(ranks) == 1 for ranks, n in zip(overflowed, skipped[1]) if n), overflowed
    start = load_file(str(ASSET_DIR / "model.safetensors"))
    p1, p2 = _params(one, 2), _params(two, 2)
    for k in start:
        assert float((p1[k] - p2[k]).norm() / p1[k].norm()) <= REL_TOL, k
        if all(skipped[0]):
            assert torch.equal(p1[k], start[k]), f"{k}: a skipped update changed the weights"


@pytest.mark.slow
def test_an_error_of_any_kind_on_rank_0_during_a_save_reaches_every_rank_at_once():
    """Rank 0 fails inside ``on_main`` (a checkpoint's save) with an error that is not a checkpoint's, and stays (a
    run closing its engines): it told rank 1 before it left the save, so rank 1 raises its one clear error in
    seconds instead of waiting out the group's timeout (60 s)."""
    import multiprocessing as mp

    ctx, port = mp.get_context("spawn"), free_port()
    said, done = ctx.Queue(), ctx.Event()
    ranks = [ctx.Process(target=rank_of_two_failing_on_main, args=(r, port, 60.0, said, done)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        got = sorted(said.get(timeout=45) for _ in ranks)
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [g[:3] for g in got] == [(0, "RuntimeError", "the disk went away"), (1, "ValueError", "failed on rank 0")]
    assert max(g[3] for g in got) < 10, got


def test_two_nodes_by_rendezvous_match_one_process(runs):
    """The README's several-node command, as two 'nodes' on this machine: one torchrun each, one
    process each, meeting at a c10d rendezvous on the loopback address."""
    tmp, r = runs
    out = tmp / "nodes"
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "grpolab-test",
        "-m",
        "grpolab",
        "train",
        "--out",
        str(out),
        "--steps",
        "3",
        *CLI_BASE,
        *REF,
    ]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    nodes = [
        subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [n.communicate(timeout=300) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), [err[-2000:] for _, err in results]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert rollouts_of(out) == rollouts_of(r["p1"])
    assert_same_params(r["p1"], out)


# ---------------------------------------------------------------- sampling modes, loss variants, the rank control
# (resuming in each sampling mode is tested in algo/test_group_budget.py, in one process; their two-process runs are in
# TWO, run by the same launch)


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
# CISPO (the weight truncated close to 1 so that mu = 2's second pass truncates some) with the off-policy mask
# (whose drift statistic is per rollout), and SAPO's gate; KL, ratios and micro-batches as in the reference pair
CISPO = [*KL_MU, "--loss-type", "cispo", "--cispo-cap", "1.001", "--off-policy-mask-threshold", "0.0001"]
SAPO = [*KL_MU, "--loss-type", "sapo", "--sapo-temperature-neg", "2"]
CASES = {"filter": _sampling("filter"), "adaptive": _sampling("adaptive"), "variants": VARIANTS, "control": CONTROL}
CASES |= {"cispo": CISPO, "sapo": SAPO}
TWO.update({case: (4 if case == "control" else 2, args) for case, args in CASES.items()})
# --max-staleness 1: each rank draws in a generator process of its own, a step behind (rollout/test_staleness.py holds the rest)
STALE = ["--max-staleness", "1"]
TWO["stale2"] = (3, STALE)


def _one_and_two_processes_agree(tmp_path: Path, runs, case: str, monkeypatch) -> list[dict]:
    """A case's steps on one process and on two: the same rollouts, metrics and weights. Returns the step rows."""
    monkeypatch.syspath_prepend(str(TESTS))  # the run imports reward_fixtures
    two = runs[0]
    steps = TWO[case][0]
    one = train_cli(tmp_path, "one", steps, *CASES[case])
    assert rollouts_of(two / case) == rollouts_of(one)
    assert_same_metrics(one, two / case)
    assert_same_params(one, two / case, step=steps)
    return read_metrics(one / "metrics.jsonl")[1:]


@pytest.mark.parametrize("mode", ["filter", "adaptive"])
def test_sampling_modes_on_two_processes_equal_one_process(tmp_path, runs, monkeypatch, mode):
    rows = _one_and_two_processes_agree(tmp_path, runs, mode, monkeypatch)
    key = "sampling/rounds" if mode == "filter" else "sampling/group_size_max"
    assert max(r[key] for r in rows) > (1 if mode == "filter" else 4), "the runs must exercise the mode"


def test_loss_variants_on_two_processes_equal_one_process(tmp_path, runs, monkeypatch):
    rows = _one_and_two_processes_agree(tmp_path, runs, "variants", monkeypatch)
    assert all(0 < r["completion/truncated_frac"] < 1 for r in rows), (
        "some completions must be cut for the test to bite"
    )


def test_the_rank_controlled_group_size_on_two_processes_equals_one_process(tmp_path, runs, monkeypatch):
    rows = _one_and_two_processes_agree(tmp_path, runs, "control", monkeypatch)
    sizes = [r["control/group_size"] for r in rows]
    assert sizes[0] == 4 and sizes[-1] == 8, sizes  # the group size changed within the run (16 rollouts, B 4 -> 2)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_cispo_and_sapo_on_two_processes_equal_one_process(tmp_path, runs, monkeypatch, loss_type):
    rows = _one_and_two_processes_agree(tmp_path, runs, loss_type, monkeypatch)
    assert any(r["loss/ratio_mean"] != 1.0 for r in rows), "the second pass must be off-policy for the test to bite"
    if loss_type == "cispo":
        assert any(r["loss/clip_frac"] > 0 for r in rows), "some weights must be truncated"


def test_a_stale_run_on_two_processes_equals_one_at_k_1(tmp_path, runs):
    """K = 1 on two processes, each drawing in its own generator process: the rollouts (each naming the weights that
    drew it: the start's for steps 1-2, step 1's for step 3), metrics and weights of the one-process run."""
    one, two = train_cli(tmp_path, "one", 3, *STALE), runs[0] / "stale2"
    assert rollouts_of(two) == rollouts_of(one) and {r["weights"] for r in rollouts_of(one)} == {0, 1}
    assert_same_metrics(one, two)
    assert_same_params(one, two, step=3)
