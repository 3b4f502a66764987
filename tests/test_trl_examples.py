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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "trl"
BUILTIN = ROOT / "grpolab" / "assets" / "arith-sft"
SCRIPTS = ["quickstart", "two_rewards", "tools", "environment", "lora", "resume"]
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


@pytest.mark.parametrize("script", sorted(TRL_CANNOT))
def test_trl_refuses_tools_without_a_tool_calling_chat_template(runs, script):
    result, _ = runs["trl", script]
    assert result.returncode != 0
    assert TRL_CANNOT[script] in result.output
