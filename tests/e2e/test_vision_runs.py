"""Vision-language runs end to end through ``grpolab train``: each family trains, checkpoints and resumes exactly; LoRA
adapts the language model only and merges into a model that ``grpolab eval`` loads."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli
from helpers.runs import assert_identical_runs
from helpers.vlm import VLM_FAMILIES, picture, save_tiny_vlm

pytestmark = pytest.mark.slow

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def _task(root) -> list[str]:
    """A folder with 9 rows (a picture of one colour each, sizes varying) and the train options that read it."""
    rows = []
    for i in range(9):
        name = list(COLOURS)[i % 3]
        picture(COLOURS[name], (28 + 5 * i, 28 + 3 * i)).save(root / f"{i}.png")
        rows.append({"prompt": [{"role": "user", "content": "Which colour?"}], "image": f"{i}.png", "answer": name})
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--model", "model", "--data", "data.jsonl", "--reward-fn", "reward_fixtures:names_the_colour",
            "--group-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "6", "--eval-fraction", "0",
            "--seed", "3", "--log-rollouts", "--threads", "1"]  # fmt: skip


def _train(root, args: list[str], *extra: str) -> None:
    res = run_cli(["train", *args, *extra], root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path, family):
    save_tiny_vlm(family, tmp_path / "model")
    args = _task(tmp_path)
    _train(tmp_path, args, "--steps", "3", "--out", "straight")
    _train(tmp_path, args, "--steps", "2", "--out", "part")
    _train(tmp_path, args, "--steps", "3", "--out", "part", "--resume")
    assert_identical_runs(tmp_path / "straight", tmp_path / "part", step=3)
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3


def test_lora_adapts_the_language_model_only_and_merges_into_a_model_eval_loads(tmp_path):
    save_tiny_vlm("llava", tmp_path / "model")
    args = _task(tmp_path)
    _train(tmp_path, args, "--steps", "2", "--out", "lora", "--lora-rank", "4")
    adapter = tmp_path / "lora" / "checkpoints" / "step_2"
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert targets and all(t.startswith("model.language_model.") for t in targets)
    res = run_cli(["merge", "--checkpoint", adapter, "--out", "merged"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli(["eval", "--model", "merged", "--reward-fn",
                   "reward_fixtures:names_the_colour", "--max-new-tokens", "6", "--eval-data", "data.jsonl"], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "greedy" in res.stdout and "\nall                  9" in res.stdout, res.stdout


def test_the_probes_the_doctor_and_the_report_run_on_a_vision_language_run(tmp_path):
    save_tiny_vlm("llava", tmp_path / "model")
    args = [
        a if a != "reward_fixtures:names_the_colour" else "reward_fixtures:pays_for_length" for a in _task(tmp_path)
    ]
    args[args.index("--eval-fraction") + 1] = "0.34"
    _train(tmp_path, args, "--steps", "2", "--out", "run", "--probe-every", "1", "--log-token-credit", "1")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ranks = [(r["probe/eff_rank"], r["probe/top1_frac"]) for r in rows if r.get("probe/eff_rank") is not None]
    assert ranks and all(e >= 1 and 0 < t <= 1 for e, t in ranks)  # over the language model's parameters
    assert (tmp_path / "run" / "token_credit.jsonl").read_text().strip()
    for command in (
        ["doctor", "run"],
        ["report", "run"],
        ["rank", "--checkpoint", "run", "--prompts", "3", "--out", "rank"],
    ):
        res = run_cli(command, tmp_path)
        assert res.returncode == 0, (command, res.stdout[-2000:] + res.stderr[-2000:])
    page = (tmp_path / "run" / "report.html").read_text()
    assert page.count('class="thumb"') >= 1  # each held-out sample's picture beside its completion
    assert json.loads((tmp_path / "rank" / "rank.json").read_text())
    # every credit card carries its prompt's picture, as the samples table does
    cards = [c.split('<div class="tc-text">')[0] for c in page.split('<div class="tc-roll"')[1:]]
    assert cards and all('<img class="thumb"' in c for c in cards), len(cards)
    # the header names the data, its reward function and the model's family, not the arithmetic task's defaults
    header = page.split('<h2 id="')[0]
    assert "data.jsonl (prompt column &#x27;prompt&#x27;)" in header and "reward_fixtures:pays_for_length" in header
    assert "llava family" in header and "built-in arith" not in header and "operands" not in header
    res = run_cli(["tokens", "run", "--plain"], tmp_path)  # the terminal cannot draw it: it counts it
    assert res.returncode == 0 and res.stdout.count("[1 picture]") == res.stdout.count("\nQ: "), res.stdout[-2000:]


@pytest.mark.hardware
def test_stale_rollouts_from_the_generator_process_in_bf16_mixed(tmp_path):
    save_tiny_vlm("qwen2-vl", tmp_path / "model")
    _train(
        tmp_path, _task(tmp_path), "--steps", "3", "--out", "run", "--max-staleness", "1", "--precision", "bf16-mixed"
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss/policy" in r][-1] == 3
    assert rows[-1]["async/staleness_max"] == 1  # drawn with the weights of the step before, in the generator process


def test_the_shapes_demo_writes_its_task_and_reports_accuracy_before_and_after(tmp_path):
    res = run_cli(["demo", "--task", "shapes", "--out", "demo", "--steps", "1", "--eval-questions", "8"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["before"]["step"] == 0 and summary["after"]["step"] == 1
    assert 0 <= summary["after"]["eval/accuracy_greedy"] <= 1
    task = tmp_path / "demo" / "task"
    assert len((task / "test.jsonl").read_text().splitlines()) == 200 and (task / "images").is_dir()
    assert "held-out accuracy" in res.stdout


def test_two_processes_ddp_and_fsdp_train_a_vision_language_model_as_one(tmp_path):
    """P-invariance with pictures: the same rollouts, the same weights (to float noise) on 2 processes, DDP and FSDP2."""
    from helpers.cli import torchrun_batch
    from helpers.runs import rollouts_of
    from safetensors.torch import load_file

    save_tiny_vlm("llava", tmp_path / "model")
    args = [*_task(tmp_path), "--steps", "3", "--lr", "1e-3"]
    args[args.index("--prompts-per-step") + 1] = "4"
    args[args.index("reward_fixtures:names_the_colour")] = "reward_fixtures:pays_for_length"  # rewards that vary
    _train(tmp_path, args, "--out", "p1")
    torchrun_batch([["train", *args, "--out", "p2"], ["train", *args, "--out", "fsdp", "--fsdp"]], cwd=tmp_path)
    start = load_file(str(tmp_path / "model" / "model.safetensors"))
    one = load_file(str(tmp_path / "p1" / "checkpoints" / "step_3" / "model.safetensors"))
    assert max(float((one[k] - start[k]).norm()) for k in start) > 1e-3  # it trained
    for run in ("p2", "fsdp"):
        assert rollouts_of(tmp_path / run) == rollouts_of(tmp_path / "p1"), run
        other = load_file(str(tmp_path / run / "checkpoints" / "step_3" / "model.safetensors"))
        for k in one:
            assert float((one[k] - other[k]).norm()) <= 1e-5 * max(float(one[k].norm()), 1e-6), (run, k)
