"""``grpolab trl rloo``: the installed trl's own trl/scripts/rloo.py run on grpolab.trl, its two imports changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO

BUILTIN = REPO / "grpolab" / "assets" / "arith-sft"


def test_the_script_differs_from_trl_s_own_in_its_two_imports_only():
    import difflib

    import trl.scripts.rloo

    from grpolab.commands.trl_script import script_source

    theirs = Path(trl.scripts.rloo.__file__).read_text().splitlines()
    ours = script_source("rloo")[0].splitlines()
    changed = [line for line in difflib.ndiff(theirs, ours) if line[:2] in ("- ", "+ ")]
    assert sorted(changed) == sorted([
        "-     from trl import RLOOTrainer, get_dataset, get_peft_config, get_quantization_config",
        "-     from trl import DatasetMixtureConfig, ModelConfig, RLOOConfig, TrlParser",
        "+     from grpolab.trl import RLOOTrainer",
        "+     from trl import get_dataset, get_peft_config, get_quantization_config",
        "+     from grpolab.trl import RLOOConfig",
        "+     from trl import DatasetMixtureConfig, ModelConfig, TrlParser",
    ])  # fmt: skip


@pytest.mark.slow
def test_grpolab_trl_rloo_runs_trl_s_script_for_two_steps_from_a_local_directory(tmp_path):
    """A local model and dataset directory and a reward by dotted path, as a --config recipe: exit 0, the model
    saved, grpolab's run written; without --beta 0.0 (TRL's default 0.05), one line and exit 2."""
    import yaml

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"Q: {a}+{b}=?\nA:", "solution": f"${a + b}$"} for a in range(1, 5) for b in range(1, 5)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kw):\n    return [-len(c) / 100 for c in "
                                            "completions]\n")  # fmt: skip
    recipe = {"model_name_or_path": str(BUILTIN), "dataset_name": str(data), "output_dir": str(tmp_path / "out"),
              "max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 16,
              "use_cpu": True, "bf16": False, "report_to": "none", "logging_steps": 1,
              "reward_funcs": ["my_rewards.brevity"]}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "grpolab", "trl", "rloo", "--config", str(tmp_path / "recipe.yaml")]

    def run(*more: str):
        done = subprocess.run([*command, *more], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr

    rc, said = run("--beta", "0.0")
    assert rc == 0 and "Traceback" not in said, said[-3000:]
    assert "Model saved to" in said
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward/brevity" in rows[-1]
    rc, said = run("--output_dir", str(tmp_path / "refused"))
    assert rc == 2 and "Traceback" not in said
    assert said.strip().splitlines()[-1].startswith("error: RLOOConfig.beta=0.05: ")
