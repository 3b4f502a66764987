"""``grpolab trl distillation``: the installed trl's own trl/scripts/distillation.py run on grpolab.trl, its two
imports changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.models import builtin_teacher
from helpers.paths import REPO

BUILTIN = REPO / "grpolab" / "assets" / "arith-sft"


def test_the_script_differs_from_trl_s_own_in_its_two_imports_only():
    import difflib

    import trl.scripts.distillation

    from grpolab.commands.trl_script import script_source

    theirs = Path(trl.scripts.distillation.__file__).read_text().splitlines()
    ours = script_source("distillation")[0].splitlines()
    changed = [line for line in difflib.ndiff(theirs, ours) if line[:2] in ("- ", "+ ")]
    assert sorted(changed) == sorted([
        "-     from trl import DistillationTrainer, get_dataset, get_peft_config, get_quantization_config",
        "-     from trl import DatasetMixtureConfig, DistillationConfig, ModelConfig, ScriptArguments, TrlParser",
        "+     from grpolab.trl import DistillationTrainer",
        "+     from trl import get_dataset, get_peft_config, get_quantization_config",
        "+     from grpolab.trl import DistillationConfig",
        "+     from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser",
    ])  # fmt: skip


@pytest.mark.slow
def test_grpolab_trl_distillation_runs_trl_s_script_for_two_steps_from_local_directories(tmp_path):
    """A local student, teacher and dataset directory: exit 0, the model saved, grpolab's run written."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"Q: {a}+{b}=?\nA:"} for a in range(1, 5) for b in range(1, 5)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    teacher = builtin_teacher(tmp_path / "teacher")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "grpolab", "trl", "distillation", "--model_name_or_path", str(BUILTIN),
               "--teacher_model_name_or_path", str(teacher), "--dataset_name", str(data), "--max_steps", "2",
               "--per_device_train_batch_size", "4", "--max_completion_length", "16", "--use_cpu", "--bf16", "false",
               "--report_to", "none", "--logging_steps", "1", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in said, said[-3000:]
    assert "Model saved to" in said
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["distill/kl"] > 0
