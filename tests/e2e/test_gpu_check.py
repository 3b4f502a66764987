"""tools/gpu-check: every CUDA path of grpolab in one command for a lent GPU. Here its --cpu mode runs every check
with the CPU in CUDA's place, so a check that broke is found before a GPU comes; what each check asserts (bit-for-bit
resume, P-invariance, a worker's run equal to the inline one, updates that register) is asserted by the checks
themselves, and this test holds their figures to it too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO

ROOT = REPO


@pytest.mark.hardware
@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.slow
def test_gpu_check_runs_every_check_on_the_cpu_and_writes_its_figures(tmp_path):
    # NCCL named where torch has none: the two-process checks run on gloo and say why, as where NCCL refuses
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "OMP_WAIT_POLICY": "PASSIVE",
           "GRPOLAB_DIST_BACKEND": "nccl"}  # fmt: skip
    # vllm, vllm-lora: tests/e2e/test_vllm_engine.py runs them on the engines its module has started (16 s of CPU less);
    # hacking: tests/training/test_hacking.py runs the same two runs, the signs on and off, on the CPU (25 s less);
    # distill: tests/training/test_distill.py trains with a teacher on the CPU, each loss's math against TRL's
    command = [
        str(ROOT / "tools" / "gpu-check"),
        "--cpu",
        "--skip",
        "vllm,vllm-lora,hacking,distill",
        "--work",
        str(tmp_path / "work"),
    ]
    res = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    lines = [line for line in res.stdout.splitlines() if line.split(" ")[0] in ("passed", "failed", "skipped")]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())  # $OUT, as on the device machine
    checks = report["checks"]
    order = ["checkpoint", "rewards", "vision", "qwen-vl", "distributed", "workers", "precisions", "decode"]
    assert sorted(checks) == sorted(order) and len(lines) == len(order)  # one line each
    for name, check in checks.items():
        assert check["status"] == "passed" or (check["status"] == "skipped" and check["reason"]), (name, check)
    assert report["environment"]["mode"] == "cpu"
    figures = {name: c.get("figures", {}) for name, c in checks.items()}
    # lr 1e-6: fp32 masters and Kahan's compensation register the update; plain AdamW on bf16 weights loses it
    shares = {k: v["moved_share"] for k, v in figures["precisions"].items() if "moved_share" in v}
    assert (
        min(shares["32-true"], shares["bf16-mixed"], shares["bf16-true/kahan"]) >= 0.99 > 0.1 > shares["bf16-true/none"]
    )
    assert "CUDA" in figures["precisions"]["16-mixed"]["skipped"]  # the CPU refuses fp16 with a scaler, and says so
    assert figures["checkpoint"]["same_weights"] and figures["checkpoint"]["same_rollouts"]
    for kind in ("ddp", "fsdp"):
        assert figures["distributed"][kind]["same_rollouts"] and figures["distributed"][kind]["weights_rel_diff"] < 1e-5
    assert figures["workers"]["same_rollouts"] and figures["workers"]["weights_rel_diff"] == 0
    for two in (*figures["distributed"].values(), figures["workers"]):  # each says why not NCCL, and ran on gloo
        assert two["backend"] == "gloo" and "has no NCCL" in two["nccl"], two
    assert figures["decode"]["grpolab"]["ms_per_token"] > 0 and "skipped" in figures["decode"]["generate-static"]


def _gpu_check():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    return gpu_check


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="asks what happens without a GPU")
def test_without_a_gpu_the_command_says_to_use_cpu(capsys):
    assert _gpu_check().main([]) == 2
    assert "--cpu" in capsys.readouterr().err


def test_a_check_that_does_not_exist_is_named():
    with pytest.raises(SystemExit, match="no check named nope; the checks: checkpoint, rewards"):
        _gpu_check().main(["--cpu", "--only", "decode,nope"])


def test_the_padded_tokenizer_decodes_every_id_the_model_can_sample():
    tok = _gpu_check().padded_tokenizer(1000, ("<|image_pad|>",))
    assert len(tok) == 1000 and tok.convert_tokens_to_ids("<|image_pad|>") < 1000
    assert tok.decode(tok("12 + 3")["input_ids"]) == "12 + 3"
    assert tok.decode([999]).startswith("<") and tok("a<|image_pad|>b")["input_ids"][1] == tok.convert_tokens_to_ids(
        "<|image_pad|>"
    )


def test_checks_not_started_within_the_budget_are_skipped_and_said(tmp_path):
    assert (
        _gpu_check().main(["--cpu", "--only", "rewards,decode", "--budget", "1e-9", "--json", str(tmp_path / "f")]) == 0
    )
    checks = json.loads((tmp_path / "f").read_text())["checks"]
    assert {c["status"] for c in checks.values()} == {"skipped"} and len(checks) == 2
    assert all(c["reason"].startswith("out of time") for c in checks.values())
