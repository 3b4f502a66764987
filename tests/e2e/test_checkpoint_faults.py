"""Checkpoints under the faults of real clusters: damaged files, pre-emption (SIGTERM/SIGINT), a full disk.

Every run is the shipped built-in model at one thread, so an interrupted-and-resumed run can be
compared with an uninterrupted one exactly (metrics apart from timings, and the weights).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli, torchrun_batch
from helpers.runs import small_cfg
from safetensors.torch import load_file

from grpolab.config.train import ConfigError
from grpolab.models import checkpoint
from grpolab.models.checkpoint import CheckpointError, verify
from grpolab.training.recipe import train
from grpolab.training.runlog import read_metrics

FLAGS = [
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--eval-questions",
    "8",
    "--eval-samples",
    "1",
    "--max-new-tokens",
    "32",
    "--threads",
    "1",
    "--warmup-steps",
    "0",
    "--no-progress",
    "--device",
    "cpu",
    "--hacking-every",
    "0",
    "--honeypots",
    "none",
]


def _metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run / "metrics.jsonl")]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path, step: int) -> None:
    wa, wb = _weights(a, step), _weights(b, step)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ckpt") / "ref"
    train(small_cfg(out, steps=4, save_every=2), log=lambda *a, **k: None)
    return out


def _truncate_weights(ckpt: Path) -> str:
    w = ckpt / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 3])
    return "model.safetensors"


def _drop_optimizer(ckpt: Path) -> str:
    (ckpt / "optimizer.pt").unlink()
    return "optimizer.pt"


def _damage_manifest(ckpt: Path) -> str:
    m = ckpt / checkpoint.MANIFEST
    m.write_text(m.read_text()[:40])
    return checkpoint.MANIFEST


def _flip_one_byte(ckpt: Path) -> str:
    w = ckpt / "optimizer.pt"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different contents: only the checksum sees it
    w.write_bytes(bytes(data))
    return "optimizer.pt"


@pytest.mark.slow
def test_every_checkpoint_has_a_manifest_and_verifies(reference):
    for step in (2, 4):
        ckpt = reference / "checkpoints" / f"step_{step}"
        files = json.loads((ckpt / checkpoint.MANIFEST).read_text())["files"]
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json"} <= set(files)
        assert verify(ckpt) is None


@pytest.mark.parametrize("damage", [_truncate_weights, _drop_optimizer, _damage_manifest, _flip_one_byte])
@pytest.mark.slow
def test_resume_skips_a_damaged_newest_checkpoint_and_equals_the_uninterrupted_run(reference, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    name = damage(run / "checkpoints" / "step_4")
    assert name in verify(run / "checkpoints" / "step_4")
    said: list[str] = []
    train(small_cfg(run, steps=4, save_every=2, resume=True), log=lambda *a, **k: said.append(" ".join(map(str, a))))
    warning = next(line for line in said if line.startswith("warning: checkpoint step_4 is damaged"))
    assert name in warning and "resuming from step_2" in warning and "\n" not in warning
    assert any("resuming" in line and "from step 2" in line for line in said)
    assert _metrics(run) == _metrics(reference)
    _assert_same_weights(run, reference, 4)
    assert verify(run / "checkpoints" / "step_4") is None  # rewritten whole


@pytest.mark.slow
def test_no_intact_checkpoint_is_a_one_line_error(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _truncate_weights(run / "checkpoints" / "step_4")
    _drop_optimizer(run / "checkpoints" / "step_2")
    with pytest.raises(
        ConfigError, match=r"--resume: no intact checkpoint in .*checkpoints \(newest, step_4: .*model.safetensors"
    ):
        train(small_cfg(run, steps=4, save_every=2, resume=True), log=lambda *a, **k: None)
    # the run's own options: no flag but what may change
    res = run_cli(
        ["train", "--out", str(run), "--steps", "4", "--save-every", "2", "--resume", "--no-progress"], tmp_path
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error: --resume: no intact checkpoint")


@pytest.mark.slow
def test_eval_rank_and_merge_refuse_a_damaged_checkpoint_in_one_line(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    _truncate_weights(run / "checkpoints" / "step_4")
    ckpt = str(run / "checkpoints" / "step_4")
    for args in (
        ["eval", "--model", ckpt, "--questions", "4", "--samples", "1"],
        ["eval", "--model", str(run), "--questions", "4", "--samples", "1"],
        ["rank", "--checkpoint", str(run), "--group-sizes", "2", "--prompts", "2", "--out", str(tmp_path / "rank")],
        ["merge", "--checkpoint", ckpt, "--out", str(tmp_path / "merged")],
    ):
        res = run_cli(args, tmp_path)
        assert res.returncode != 0 and "Traceback" not in res.stderr, (args, res.stderr[-500:])
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: checkpoint {ckpt} is damaged: ") and "model.safetensors" in last, args


# ---------------------------------------------------------------- a full disk


def _full_disk_at(step: int, real_save):
    """``torch.save`` on a disk that fills up when checkpoint ``step`` is written."""

    def save(obj, path, *a, **k):
        if f"step_{step}" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *a, **k)

    return save


@pytest.mark.slow
def test_a_save_that_fails_leaves_the_previous_checkpoint_and_stops_with_one_line(tmp_path, monkeypatch):
    real_save = checkpoint.torch.save
    monkeypatch.setattr(checkpoint.torch, "save", _full_disk_at(4, real_save))
    run = tmp_path / "run"
    with pytest.raises(CheckpointError) as info:
        train(small_cfg(run, steps=4, save_every=2), log=lambda *a, **k: None)
    assert str(info.value) == f"could not write checkpoint step_4 in {run / 'checkpoints'}: No space left on device"
    assert [s for s, _ in checkpoint.checkpoint_dirs(run)] == [2] and verify(run / "checkpoints" / "step_2") is None
    assert not list((run / "checkpoints").glob(".tmp_*"))  # nothing half-written left behind
    # through the command line: one line on stderr, no traceback (an exception escaping main fails the test)
    monkeypatch.setattr(checkpoint.torch, "save", _full_disk_at(2, real_save))
    res = run_cli(["train", "--out", str(tmp_path / "cli"), "--steps", "2", *FLAGS], tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert (
        res.stderr.strip()
        == f"error: could not write checkpoint step_2 in {tmp_path / 'cli' / 'checkpoints'}: No space left on device"
    )


# ---------------------------------------------------------------- pre-emption


def _start(tmp: Path, name: str, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [
        sys.executable,
        "-m",
        "grpolab",
        "train",
        "--out",
        str(tmp / name),
        "--steps",
        str(steps),
        "--eval-every",
        "0",
        "--save-every",
        "1000",
        *FLAGS,
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        path = run / "metrics.jsonl"
        # whole lines only: the run may be writing its last one as we read
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        if any(json.loads(line).get("step", 0) >= step for line in lines if line.strip()):
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    pytest.fail(f"{run} did not reach step {step}")


@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_resume_equals_the_uninterrupted_run(tmp_path, nproc):
    """SIGTERM once step 2 is logged: the run finishes the step it is in, saves it and exits; resumed, it ends as the
    uninterrupted run. 6 steps: the signal lands with at least 3 still to run, so the stop is the signal's."""
    steps = 6
    extra = ["--nproc", "2"] if nproc > 1 else []
    proc = _start(tmp_path, "cut", steps, *extra)
    _wait_for_step(tmp_path / "cut", 2, proc)
    proc.send_signal(signal.SIGTERM)  # with --nproc 2 this process is torchrun, which passes it to both ranks
    out, _ = proc.communicate(timeout=240)
    reached = max(r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl"))
    assert 2 <= reached < steps, out
    assert [s for s, _ in checkpoint.checkpoint_dirs(tmp_path / "cut")] == [reached], out
    assert f"stopped by SIGTERM after step {reached}: checkpoint" in out
    if nproc == 1:
        assert proc.returncode == 128 + signal.SIGTERM
    else:
        assert proc.returncode != 0
    common = ["--steps", str(steps), "--eval-every", "0", "--save-every", "1000", *FLAGS]
    resume = ["train", "--out", str(tmp_path / "cut"), *common, "--resume"]
    whole = ["train", "--out", str(tmp_path / "whole"), *common]
    if nproc > 1:  # both two-process runs in one torchrun launch (helpers.cli.torchrun_batch)
        torchrun_batch([resume, whole], cwd=tmp_path)
    else:
        for args in (resume, whole):
            res = run_cli(args, tmp_path, timeout=300)
            assert res.returncode == 0, res.stderr[-2000:]
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "whole")
    _assert_same_weights(tmp_path / "cut", tmp_path / "whole", steps)


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path):
    proc = _start(tmp_path, "twice", 200, "--nproc", "1")  # one process: a run this long would take one per core
    _wait_for_step(tmp_path / "twice", 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)  # a different signal, so the two are never merged into one
    proc.communicate(timeout=60)
    # killed by the second signal itself, no graceful exit status. Which of the two the process handles first is the
    # kernel's choice (a process-directed signal goes to any thread not blocking it): the second may be either.
    assert proc.returncode in (-signal.SIGTERM, -signal.SIGINT), proc.returncode
    assert checkpoint.checkpoint_dirs(tmp_path / "twice") == []  # it did not stay to save


# ---------------------------------------------------------------- no pickled code


class _RunsCode:
    """Unpickled, this object would run ``code``: what a crafted checkpoint file can carry."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


@pytest.mark.slow
def test_a_checkpoint_file_that_would_run_code_is_refused_and_the_code_never_runs(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ckpt, marker = run / "checkpoints" / "step_4", tmp_path / "ran"
    payload = {"state": {}, "param_groups": [], "x": _RunsCode(f"open({str(marker)!r}, 'w').write('ran')")}
    torch.save(payload, ckpt / "optimizer.pt")
    checkpoint.write_manifest(ckpt)  # a checksum says nothing of origin: the file is "intact"
    torch.load(ckpt / "optimizer.pt", weights_only=False)  # the file is armed: a plain unpickling runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: refused: it holds Python objects"):
        train(small_cfg(run, steps=6, save_every=2, resume=True), log=lambda *a, **k: None)
    res = run_cli(
        ["train", "--out", str(run), "--steps", "6", "--save-every", "2", "--resume", "--no-progress"], tmp_path
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "optimizer.pt: refused" in res.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_a_checkpoint_written_before_the_pickle_free_rng_state_still_resumes(reference, tmp_path):
    """rng.pt used to hold Python's state as tuples and numpy's as an array: it loads through the restricted
    unpickler (numpy's array reconstruction allowed, nothing else) and the resumed run equals the uninterrupted one."""
    import numpy as np

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step_4")
    ckpt = run / "checkpoints" / "step_2"
    new = torch.load(ckpt / "rng.pt", weights_only=True)
    py, npy = new["python"], new["numpy"]
    old = {
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": (
            npy["name"],
            npy["key"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        ),
        "torch": new["torch"],
    }
    torch.save(old, ckpt / "rng.pt")
    checkpoint.write_manifest(ckpt)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(ckpt / "rng.pt", weights_only=True)  # the old format: not plain values
    train(small_cfg(run, steps=4, save_every=2, resume=True), log=lambda *a, **k: None)
    assert _metrics(run) == _metrics(reference)
    _assert_same_weights(run, reference, 4)
