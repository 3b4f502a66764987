"""The hacking signs in a run: logged at their cadence with their evidence, never changing the run's rollouts or
weights; an audit that raises is counted, never the run's end; a bad --honeypots or --audit-reward is one line before
any step."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import paths
from helpers.cli import run_cli
from helpers.runs import quiet, small_cfg
from safetensors.torch import load_file


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # two runs of 4 steps: 8 s; the only test of the signs inside a run
def test_the_signs_watch_without_changing_the_run(tmp_path):
    from grpolab.training.recipe import train

    shape = dict(steps=4, eval_every=2, log_rollouts=True, save_every=4, group_size=4, prompts_per_step=8)
    said: list[str] = []
    on = train(
        small_cfg(tmp_path / "on", hacking_every=2, honeypots="auto", audit_reward="reward_fixtures:always_raises",
                  **shape),
        log=said.append,
    )  # fmt: skip
    off = train(small_cfg(tmp_path / "off", **shape), log=quiet)
    assert (on / "rollouts.jsonl").read_text() == (off / "rollouts.jsonl").read_text()
    a, b = (
        load_file(on / "checkpoints/step_4/model.safetensors"),
        load_file(off / "checkpoints/step_4/model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = _lines(on / "metrics.jsonl")
    plain = [{k: v for k, v in r.items() if not k.startswith(("hacking/", "time/"))} for r in rows]
    assert plain == [{k: v for k, v in r.items() if not k.startswith("time/")} for r in _lines(off / "metrics.jsonl")]
    steps = {
        k: [r["step"] for r in rows if k in r] for k in ("hacking/align", "hacking/trick_sim", "hacking/honeypot_paid")
    }
    assert steps == {"hacking/align": [2, 4], "hacking/trick_sim": [1, 2, 3, 4], "hacking/honeypot_paid": [0, 2, 4]}
    assert all(0 < r["hacking/align"] <= 1 for r in rows if "hacking/align" in r)
    errors = [r["hacking/audit_errors"] for r in rows if r["step"]]
    assert errors == [32] * 4  # --audit-sample's 32 of the 32 rollouts counted at every step: the run went on
    assert sum("--audit-reward reward_fixtures:always_raises raised" in line for line in said) == 1
    kept = _lines(on / "hacking.jsonl")
    assert [r["step"] for r in kept if r["sign"] == "align"] == [2, 4]
    assert all(m["completion"] and m["advantage"] > 0 for r in kept if r["sign"] == "align" for m in r["rollouts"])


@pytest.mark.slow  # two processes: 8 s
def test_a_bad_honeypots_file_or_audit_is_one_line_before_any_step(tmp_path):
    bad = tmp_path / "honeypots.jsonl"
    bad.write_text('{"question": "1+x", "ground_truth": "none"}\n{cut\n')
    base = ["train", "--steps", "2", "--eval-questions", "4", "--no-progress", "--out"]
    cases = [
        (["--honeypots", str(bad)], f"--honeypots: {bad}:2: not valid JSON"),
        (["--audit-reward", str(paths.TESTS / "nothing_here.py") + ":fn"], "--audit-reward: "),
    ]
    for i, (args, words) in enumerate(cases):
        res = run_cli([*base, str(tmp_path / f"run{i}"), *args], tmp_path)
        err = res.stderr.strip().splitlines()
        assert res.returncode == 2 and err[-1].startswith("error: ") and words in err[-1], res.stderr
        assert "Traceback" not in res.stderr and not (tmp_path / f"run{i}" / "metrics.jsonl").exists()
