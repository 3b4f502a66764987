"""examples/trl/: each TRL-style script run for 2 steps on the built-in model, under grpolab.trl as written and
under real TRL with only its import line changed (README.md there).

The built-in model has no chat template, so the scripts run with ``--plain`` (TRL's standard, plain-text prompts).
One module fixture runs the twelve: the grpolab scripts in one process and TRL's copies in another
(tests/script_batch.py), and the tests read their results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers.paths import REPO

pytestmark = pytest.mark.slow

ROOT = REPO
EXAMPLES = ROOT / "examples" / "trl"
BUILTIN = ROOT / "grpolab" / "assets" / "arith-sft"
SCRIPTS = ["quickstart", "two_rewards", "tools", "environment", "lora", "resume", "trl_rewards"]
GRPOLAB_IMPORT = "from grpolab.trl import GRPOConfig, GRPOTrainer"
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"

# TRL 1.16 checks at construction that the tokenizer's chat template renders a tool-calling conversation; the
# built-in model has no chat template, so TRL cannot run the tool and environment scripts with it (grpolab can: it
# shows tools in plain text). The test asserts that error rather than skipping.
TRL_CANNOT = {
    "tools": "ValueError: The provided chat template does not support tool calling.",
    "environment": "ValueError: The provided chat template does not support tool calling.",
}


def trl_copy(script: str, into: Path) -> Path:
    """The script with its one import line changed to TRL's, beside copies of the helpers it imports."""
    source = (EXAMPLES / f"{script}.py").read_text()
    assert source.count(GRPOLAB_IMPORT) == 1
    into.mkdir(parents=True, exist_ok=True)
    for helper in ("task.py", "smollm2.py"):
        (into / helper).write_text((EXAMPLES / helper).read_text())
    target = into / f"{script}.py"
    target.write_text(source.replace(GRPOLAB_IMPORT, TRL_IMPORT))
    return target


def _batch(jobs: dict, tmp: Path, name: str) -> subprocess.Popen:
    """One process running ``jobs`` (``{key: (script, output_dir)}``) in turn (tests/script_batch.py)."""
    listing = [
        {"script": str(script), "log": str(out) + ".log",
         "argv": ["--model", str(BUILTIN), "--max-steps", "2", "--use-cpu", "--plain", "--output-dir", str(out)]}
        for script, out in jobs.values()
    ]  # fmt: skip
    (tmp / f"{name}.json").write_text(json.dumps(listing))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "script_batch.py"), str(tmp / f"{name}.json")],
                            cwd=tmp, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{(backend, script): (Result, output_dir)}`` for every script under grpolab and under TRL: the grpolab scripts
    in one process and TRL's copies in another, side by side, so that each imports torch and its trainer once."""
    tmp = tmp_path_factory.mktemp("trl_examples")
    jobs = {}
    for script in SCRIPTS:
        jobs["grpolab", script] = (EXAMPLES / f"{script}.py", tmp / "grpolab" / script)
        jobs["trl", script] = (trl_copy(script, tmp / "trl_scripts" / script), tmp / "trl" / script)
    for _, out in jobs.values():
        out.parent.mkdir(parents=True, exist_ok=True)
    launched = [
        _batch({k: v for k, v in jobs.items() if k[0] == backend}, tmp, backend) for backend in ("grpolab", "trl")
    ]
    for process in launched:
        assert process.wait(timeout=600) == 0
    results = {}
    for key, (_, out) in jobs.items():
        log = Path(str(out) + ".log")
        results[key] = (Result(int(Path(str(log) + ".status").read_text()), log.read_text()), out)
    return results


class Result(NamedTuple):
    """A script's exit status and its output (stdout and stderr together)."""

    returncode: int
    output: str


def _ok(result: Result) -> None:
    assert result.returncode == 0, result.output[-3000:]


def _steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "reward/mean" in r]


def test_each_copy_differs_from_its_script_in_the_import_line_only(tmp_path):
    for script in SCRIPTS:
        before = (EXAMPLES / f"{script}.py").read_text().splitlines()
        after = trl_copy(script, tmp_path).read_text().splitlines()
        changed = [(a, b) for a, b in zip(before, after) if a != b]
        assert len(before) == len(after) and changed == [(GRPOLAB_IMPORT, TRL_IMPORT)], script


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "resume"])
def test_grpolab_runs_the_script(runs, script):
    result, out = runs["grpolab", script]
    _ok(result)
    assert _steps(out) == [1, 2]
    assert "step 2/2" in result.output


def test_grpolab_resumes(runs):
    result, out = runs["grpolab", "resume"]
    _ok(result)
    assert _steps(out) == [1, 2, 3, 4]  # the second trainer continued the first's run: steps 3 and 4 added
    assert "resumed at step 2, stopped at step 4" in result.output


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in TRL_CANNOT and s != "resume"])
def test_trl_runs_the_copy(runs, script):
    result, out = runs["trl", script]
    _ok(result)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


def test_trl_resumes_the_copy(runs):
    result, out = runs["trl", "resume"]
    _ok(result)
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert "resumed at step 2, stopped at step 4" in result.output


def test_trl_s_reward_functions_and_keywords_under_both(runs):
    """trl.rewards' token-level functions and a function that logs a column and a metric and returns None: under
    both trainers each function's mean is logged by its name and the metric by its own; grpolab keeps the column
    beside each rollout."""
    for backend in ("grpolab", "trl"):
        result, _ = runs[backend, "trl_rewards"]
        _ok(result)
        printed = [line for line in result.output.splitlines() if line.startswith("logged: ")]
        assert len(printed) == 2, (backend, result.output[-2000:])
        for name in ("letter_judged", "soft_overlong_punishment_reward", "repetition_penalty_reward"):
            assert f"'rewards/{name}/mean'" in printed[-1], (backend, printed)
        assert "'replied_with_a_letter'" in printed[-1], (backend, printed)
    _, out = runs["grpolab", "trl_rewards"]
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert records and all(isinstance(r["extra"]["first_letter"], str) for r in records)


@pytest.mark.parametrize("script", sorted(TRL_CANNOT))
def test_trl_refuses_tools_without_a_tool_calling_chat_template(runs, script):
    result, _ = runs["trl", script]
    assert result.returncode != 0
    assert TRL_CANNOT[script] in result.output


# ---------------------------------------------------------------- TRL's own trl/scripts/grpo.py


def trl_script_on_grpolab(into: Path) -> Path:
    """The installed trl's own ``trl/scripts/grpo.py`` (the code behind ``trl grpo``), its two imports changed, as
    ``grpolab trl grpo`` runs it."""
    from grpolab.commands.trl_script import script_source

    target = into / "grpo.py"
    target.write_text(script_source("grpo")[0])
    return target


def test_the_script_differs_from_trl_s_own_in_its_two_imports_only(tmp_path):
    import difflib

    import trl.scripts.grpo

    theirs = Path(trl.scripts.grpo.__file__).read_text().splitlines()
    ours = trl_script_on_grpolab(tmp_path).read_text().splitlines()
    changed = [line for line in difflib.ndiff(theirs, ours) if line[:2] in ("- ", "+ ")]
    assert sorted(changed) == sorted([
        "-     from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config",
        "-     from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser",
        "+     from grpolab.trl import GRPOTrainer",
        "+     from trl import get_dataset, get_peft_config, get_quantization_config",
        "+     from grpolab.trl import GRPOConfig",
        "+     from trl import DatasetMixtureConfig, ModelConfig, TrlParser",
    ])  # fmt: skip


@pytest.mark.parametrize("how", ["flags", "config", "command"])
def test_trl_s_own_grpo_script_runs_on_grpolab_with_its_two_imports_changed(tmp_path, how):
    """A local model directory, a local dataset directory, accuracy_reward, think_format_reward and a reward by
    dotted path; as flags, as a --config YAML recipe, and as ``grpolab trl grpo --config recipe.yaml``: exit 0, no
    traceback, the model saved; invoked again with more steps, it resumes (flags and command: the --config form
    runs the same source as the command). The command's recipe also holds a key TRL's script ignores: it is said."""
    script = trl_script_on_grpolab(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"Q: {a}+{b}=?\nA:", "solution": f"${a + b}$"} for a in range(1, 5) for b in range(1, 5)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, **kw):\n    return [-len(c) / 100 for c in completions]\n"
    )
    options = {
        "model_name_or_path": str(BUILTIN), "dataset_name": str(data), "output_dir": str(tmp_path / "out"),
        "max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 16,
        "use_cpu": True, "bf16": False, "report_to": "none", "logging_steps": 1,
    }  # fmt: skip
    rewards = ["accuracy_reward", "think_format_reward", "my_rewards.brevity"]
    command = [sys.executable, "-m", "grpolab", "trl", "grpo"] if how == "command" else [sys.executable, str(script)]
    if how == "flags":
        args = [f"--{k}={v}" for k, v in options.items()] + ["--reward_funcs", *rewards]
    else:
        import yaml

        stray = {"not_a_trl_key": 3} if how == "command" else {}
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**options, "reward_funcs": rewards, **stray}))
        args = ["--config", str(tmp_path / "recipe.yaml")]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def invoke(*more: str) -> str:
        done = subprocess.run([*command, *args, *more], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        said = done.stdout + done.stderr
        assert done.returncode == 0 and "Traceback" not in said, said[-3000:]
        assert "Training completed." in said and "Model saved to" in said
        return said

    said = invoke()
    if how == "command":
        assert "'not_a_trl_key' in the recipe is no argument of trl grpo; ignored, as trl grpo ignores it" in said
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # 0: the evaluation before training (empty: no eval_dataset)
    assert {"reward/accuracy_reward", "reward/think_format_reward", "reward/brevity"} <= set(rows[-1]), rows[-1]
    from transformers import AutoConfig
    from transformers.trainer_utils import get_last_checkpoint

    assert AutoConfig.from_pretrained(out).model_type  # the saved model's config.json, beside the run's records
    last = get_last_checkpoint(str(out))
    assert last == str(out / "checkpoint-2")
    if how == "config":
        return

    # A second invocation with more steps resumes from that checkpoint (the run's options read from where the
    # model's config.json could not overwrite them): steps 3 and 4 appended, the first two kept once.
    said = invoke("--max_steps=4", f"--resume_from_checkpoint={last}")
    assert "read by scripts, not by the trainer" not in said  # the script passed it to train(): no note
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")


def test_grpolab_trl_grpo_refuses_in_one_line(tmp_path):
    """Bad input to ``grpolab trl grpo``: a field grpolab refuses, and a reward function returning the wrong number
    of values, are one line each, exit 2 (a recipe key TRL's script ignores: the command test above)."""
    import yaml

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"Q: {a}+{b}=?\nA:", "solution": f"${a + b}$"} for a in range(1, 5) for b in range(1, 5)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text("def miscounted(completions, **kw):\n    return [0.0]\n")
    base = {"model_name_or_path": str(BUILTIN), "dataset_name": str(data), "max_steps": 1, "use_cpu": True,
            "bf16": False, "report_to": "none", "per_device_train_batch_size": 4, "num_generations": 4,
            "max_completion_length": 8}  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def grpolab_trl_grpo(name: str, **recipe):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**base, "output_dir": str(tmp_path / name), **recipe}))
        done = subprocess.run([sys.executable, "-m", "grpolab", "trl", "grpo", "--config", str(path)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        return done.returncode, done.stdout + done.stderr

    rc, said = grpolab_trl_grpo("refused", reward_funcs=["think_format_reward"], adam_beta1=0.8)
    assert rc == 2 and "Traceback" not in said, said[-2000:]
    assert said.strip().splitlines()[-1].startswith("error: GRPOConfig.adam_beta1=0.8: ")
    rc, said = grpolab_trl_grpo("miscounted", reward_funcs=["my_rewards.miscounted"])
    assert rc == 2 and "Traceback" not in said, said[-2000:]
    assert said.strip().splitlines()[-1] == "error: reward function miscounted returned 1 rewards for 4 completions"
