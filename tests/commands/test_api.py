"""The Python API (grpolab.train / evaluate / the probes): objects in, the same run as the command line out.

Smoke tier on the built-in model: a run from Python with data in memory and a closure reward equals the CLI run on a
file and a module function (metrics, rollouts, bit-identical weights at 1 thread); a model object trains in place; a
datasets.Dataset's chat prompts and extra columns reach a TRL-form reward; wrong keywords give the flag's one line;
resuming needs the objects again; torchrun of a script equals one process.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.cli import run_cli
from safetensors.torch import load_file

import grpolab
from grpolab.data import arithmetic
from grpolab.data.answers import extract_final_number, numbers_equal
from grpolab.models.policy import ASSET_DIR
from grpolab.training.runlog import read_metrics

# the hacking signs off, as in helpers.runs.SMALL: they have tests of their own (tests/training/test_hacking.py)
SMALL = dict(prompts_per_step=4, group_size=4, eval_questions=8, eval_samples=1, warmup_steps=0, progress=False,
             hacking_every=0, honeypots="none")  # fmt: skip
SMALL_FLAGS = ["--prompts-per-step", "4", "--group-size", "4", "--eval-questions", "8", "--eval-samples", "1",
               "--warmup-steps", "0", "--no-progress", "--hacking-every", "0", "--honeypots", "none"]  # fmt: skip
REWARD_SOURCE = """
from grpolab.data.answers import extract_final_number, numbers_equal


def correct(completions, answer, **kwargs):
    return [float(numbers_equal(extract_final_number(c), a)) for c, a in zip(completions, answer)]
"""


def _rows(n: int = 60) -> list[dict]:
    """Prompt-format rows: the question, its answer and its category as extra columns."""
    return [
        {"prompt": r["question"], "answer": str(r["ground_truth"]), "category": r["category"]}
        for r in arithmetic.test_set(n, arithmetic.ArithmeticSpec())
    ]


def _same_run(a, b, exact: bool = True, skip: tuple[str, ...] = ("time/", "memory/")) -> None:
    """Two run directories hold the same metrics (times and ``skip`` aside), rollouts and final weights."""
    ma, mb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb] and len(ma) >= 3
    for x, y in zip(ma, mb):
        keys = {k for k in x if not k.startswith(skip)}
        assert keys == {k for k in y if not k.startswith(skip)}
        for k in keys:
            close = exact or not isinstance(x[k], float)
            assert x[k] == y[k] if close else x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
    assert (a / "rollouts.jsonl").read_text() == (b / "rollouts.jsonl").read_text()
    last = max(int(p.name.split("_")[1]) for p in (a / "checkpoints").iterdir())
    wa = load_file(a / "checkpoints" / f"step_{last}" / "model.safetensors")
    wb = load_file(b / "checkpoints" / f"step_{last}" / "model.safetensors")
    start = load_file(ASSET_DIR / "model.safetensors")
    assert wa.keys() == wb.keys() and any(not torch.equal(wa[k], start[k]) for k in start), "the runs did not train"
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:  # summed over 2 processes in another order: within 1e-5 relative, as grpolab train --nproc 2
            assert float((wa[k] - wb[k]).norm() / wa[k].norm()) <= 1e-5, k


@pytest.mark.slow
def test_a_python_run_equals_the_cli_run_on_files(tmp_path):
    """In-memory rows == the same rows in a JSONL file; a closure reward == the same function in a module."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    cli = run_cli(
        ["train", "--data", str(data), "--reward-fn", f"{tmp_path / 'my_rewards.py'}:correct", "--eval-fraction",
         "0.2", "--steps", "2", "--log-rollouts", "--threads", "1", "--out", str(tmp_path / "cli"), *SMALL_FLAGS],
        tmp_path,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]

    def correct(completions, answer, **kwargs):  # a closure: no module can import it
        return [float(numbers_equal(extract_final_number(c), a)) for c, a in zip(completions, answer)]

    run = grpolab.train(train_dataset=_rows(), reward_funcs=[correct], eval_fraction=0.2, steps=2, log_rollouts=True,
                        threads=1, out=str(tmp_path / "py"), **SMALL)  # fmt: skip
    _same_run(tmp_path / "cli", run.dir)
    assert [e["step"] for e in run.evaluations] == [0, 2] and "eval/accuracy_greedy" in run.evaluations[0]
    assert len(run.metrics) == 3 and run.policy.model is not None
    config = run.config
    assert config["reward_fn"][0].startswith("reward function defined in Python: ")
    assert config["reward_fn"][0].endswith("test_a_python_run_equals_the_cli_run_on_files.<locals>.correct")
    assert config["data"].startswith("data in memory: 60 rows, sha256 ")

    # resuming needs the same objects again, and says so in one line
    with pytest.raises(grpolab.ConfigError, match=r"^--resume: the run was started with reward function .*correct; "
                       r"pass the same object again"):  # fmt: skip
        grpolab.train(train_dataset=_rows(), eval_fraction=0.2, steps=3, out=str(run.dir), resume=True, **SMALL)
    with pytest.raises(grpolab.ConfigError, match=r"^--resume: the run was started with data in memory: 60 rows"):
        grpolab.train(train_dataset=_rows()[1:], reward_funcs=[correct], eval_fraction=0.2, steps=3,
                      out=str(run.dir), resume=True, **SMALL)  # fmt: skip
    resumed = grpolab.train(train_dataset=_rows(), reward_funcs=[correct], eval_fraction=0.2, steps=3,
                            out=str(run.dir), resume=True, threads=1, **SMALL)  # fmt: skip
    assert [m["step"] for m in resumed.metrics] == [0, 1, 2, 3]
    # evaluating the run on its own task needs its objects too
    with pytest.raises(
        grpolab.ConfigError, match=r"data in memory: 60 rows.*: a Python object, not saved with the run"
    ):
        grpolab.evaluate(model=run.dir, questions=4, samples=0, log=lambda *a: None)
    report = grpolab.evaluate(model=run.dir, train_dataset=_rows(), reward_funcs=[correct], questions=4, samples=0,
                              log=lambda *a: None)  # fmt: skip
    assert report["weights"].endswith("step_3") and report["questions"] == 4


@pytest.mark.slow
def test_evaluate_takes_a_model_object_as_its_name(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ASSET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    quiet = dict(questions=16, samples=2, log=lambda *a: None)
    by_name = grpolab.evaluate(model="builtin", **quiet)
    by_object = grpolab.evaluate(model=model, tokenizer=tokenizer, **quiet)
    assert by_name["metrics"] == by_object["metrics"] and by_object["metrics"]["eval/accuracy_greedy"] > 0
    assert by_object["model"] == f"model object: LlamaForCausalLM ({ASSET_DIR})"


@pytest.mark.slow
def test_a_loaded_model_object_is_what_trains(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ASSET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = grpolab.train(model=model, tokenizer=tokenizer, steps=2, threads=1, lr=1e-3, out=str(tmp_path / "r"), **SMALL)
    assert run.policy.model is model and run.policy.tokenizer is tokenizer
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before), "every parameter of the object itself should have moved"
    saved = load_file(run.dir / "checkpoints" / "step_2" / "model.safetensors")
    name = "model.embed_tokens.weight"
    assert torch.equal(saved[name], model.state_dict()[name])  # the checkpoint is the object's weights
    assert run.config["model"] == f"model object: LlamaForCausalLM ({ASSET_DIR})"
    assert len(run.config["model_fingerprint"]) == 16

    with pytest.raises(grpolab.ConfigError, match=r"^tokenizer: a loaded model needs its tokenizer"):
        grpolab.train(model=model, steps=1, out=str(tmp_path / "no-tok"))


@pytest.mark.slow
def test_a_run_of_a_model_object_resumes_into_the_object(tmp_path):
    """Resume loads the checkpoint into the object given; with a KL term its reference must be the starting weights
    (checked by their fingerprint), so the trained object itself is refused and a fresh load is taken."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def fresh():
        return AutoModelForCausalLM.from_pretrained(ASSET_DIR)

    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    common = dict(tokenizer=tokenizer, threads=1, beta=0.04, lr=1e-3, log_rollouts=True, log=lambda *a: None, **SMALL)
    whole = grpolab.train(model=fresh(), steps=3, out=str(tmp_path / "whole"), **common)
    trained = grpolab.train(model=fresh(), steps=2, out=str(tmp_path / "cut"), **common).policy.model
    with pytest.raises(grpolab.ConfigError, match=r"^--resume: the KL reference \(--beta\) is the run's starting"):
        grpolab.train(model=trained, steps=3, resume=True, out=str(tmp_path / "cut"), **common)
    resumed = grpolab.train(model=fresh(), steps=3, resume=True, out=str(tmp_path / "cut"), **common)
    # the cut run evaluated its last step (eval/ and the honeypots drawn with it)
    _same_run(whole.dir, resumed.dir, skip=("time/", "memory/", "eval/", "hacking/honeypot"))


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.mark.slow
def test_a_dataset_with_chat_prompts_and_extra_columns_reaches_trl_rewards(tmp_path):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ASSET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    tokenizer.chat_template = CHAT_TEMPLATE
    rows = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"], "level": i % 3}
        for i, r in enumerate(_rows(24))
    ]
    ds = datasets.Dataset.from_list(rows)
    calls = []

    def reward(prompts, completions, answer, level, **kwargs):
        calls.append({"prompts": prompts, "completions": completions, "answer": answer, "level": level, **kwargs})
        return [float(len(c[0]["content"]) % 2) for c in completions]

    grpolab.train(model=model, tokenizer=tokenizer, train_dataset=ds, reward_funcs=reward, eval_fraction=0.25,
                  steps=1, threads=1, out=str(tmp_path / "r"), **SMALL)  # fmt: skip
    call = next(c for c in calls if len(c["completions"]) == 16)  # the training step's 4 prompts x 4 rollouts
    assert len(call["prompts"]) == len(call["answer"]) == len(call["level"]) == 16
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in call["prompts"])
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in call["completions"])
    by_question = {r["prompt"][0]["content"]: r for r in rows}
    for p, a, lv in zip(call["prompts"], call["answer"], call["level"]):
        row = by_question[p[-1]["content"]]
        assert (a, lv) == (row["answer"], row["level"]) and isinstance(lv, int)


@pytest.mark.parametrize(
    "keywords, flags",
    [
        ({"group_size": "eight"}, ["--group-size", "eight"]),
        ({"grup_size": 8}, ["--grup-size", "8"]),
        ({"estimator": "ppo"}, ["--estimator", "ppo"]),
        ({"group_size": 0}, ["--group-size", "0"]),
        ({"lr": "fast"}, ["--lr", "fast"]),
    ],
)
def test_a_bad_keyword_or_type_is_the_flags_one_line(keywords, flags, tmp_path, capsys):
    from grpolab.commands.cli import main

    with pytest.raises(SystemExit):
        main(["train", *flags, "--out", str(tmp_path / "cli")])
    cli_line = capsys.readouterr().err.strip()
    assert cli_line.startswith("error: --") and "\n" not in cli_line
    with pytest.raises(grpolab.ConfigError) as e:
        grpolab.train(out=str(tmp_path / "py"), **keywords)
    assert f"error: {e.value}" == cli_line
    assert not (tmp_path / "py" / "metrics.jsonl").exists()


def test_a_bad_object_is_one_line_naming_its_keyword():
    for kwargs, message in [
        ({"reward_funcs": [3]}, "--reward-fn: expected a reward function or a 'module:name' string, got 3"),
        ({"train_dataset": 5}, "train_dataset: expected a datasets.Dataset, a list of dicts or a path, got int"),
        ({"train_dataset": [{"prompt": "x"}, "y"]}, "train_dataset: row 2 is a str, not a dict"),
        ({"model": 3}, "model: expected a path, a name or a loaded model, got int"),
    ]:
        with pytest.raises(grpolab.ConfigError) as e:
            grpolab.train(**kwargs)
        assert str(e.value) == message


SCRIPT = """
import sys
import grpolab
from grpolab.data.arithmetic import ArithmeticSpec, test_set


def odd(completions, records):  # defined in the script: no module can import it
    return [float(sum(map(ord, c)) % 2) for c in completions]


rows = [{{"question": r["question"], "answer": "#### " + str(r["ground_truth"])}} for r in test_set(40, ArithmeticSpec())]
grpolab.train(train_dataset=rows, reward_funcs=[odd], eval_fraction=0.25, steps=2, log_rollouts=True, out=sys.argv[1],
              **{small})
"""


@pytest.mark.slow
def test_torchrun_of_a_script_equals_one_process(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(small=SMALL)))
    with pytest.MonkeyPatch.context() as mp:  # one process: the script run here, as `python SCRIPT p1` runs it
        mp.chdir(tmp_path)
        mp.setattr(sys, "argv", [str(script), str(tmp_path / "p1")])
        threads = torch.get_num_threads()
        runpy.run_path(str(script), run_name="__main__")
        torch.set_num_threads(threads)
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(tmp_path / "p2")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    assert json.loads((tmp_path / "p2" / "config.json").read_text())["world_size"] == 2
    # engine/*: the sampler-trainer mismatch is float rounding, which depends on how the batch is split
    _same_run(tmp_path / "p1", tmp_path / "p2", exact=False, skip=("time/", "memory/", "engine/"))


@pytest.mark.slow
def test_the_probes_take_objects_as_the_flags_take_names(tmp_path):
    """rank on a model object, rows in memory and a closure reward == rank on the model's name, the rows' file and
    the module function; multiturn on an environment class defined here == on the importable one it copies."""
    from env_fixtures import Echo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(8)))
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    probe = dict(group_sizes=[4], prompts=3, progress=False, max_new_tokens=24)
    by_name = grpolab.rank(model="builtin", data=str(data), reward_funcs=f"{tmp_path / 'my_rewards.py'}:correct",
                           out=str(tmp_path / "rank-names"), log=lambda *a: None, **probe)  # fmt: skip

    def correct(completions, answer, **kwargs):
        return [float(numbers_equal(extract_final_number(c), a)) for c, a in zip(completions, answer)]

    model = AutoModelForCausalLM.from_pretrained(ASSET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
    by_object = grpolab.rank(model=model, tokenizer=tokenizer, data=_rows(8), reward_funcs=[correct],
                             out=str(tmp_path / "rank-objects"), log=lambda *a: None, **probe)  # fmt: skip
    keys = ("effective_rank", "top1_fraction", "num_rank", "frac_zero_var", "reward_std_mean")
    assert [{k: r[k] for k in keys} for r in by_name["results"]] == [
        {k: r[k] for k in keys} for r in by_object["results"]
    ]
    assert by_object["results"][0]["frac_zero_var"] < 1, "no prompt had reward variance: the comparison is empty"

    class LocalEcho(Echo):  # the same environment, under a name no module has
        pass

    episodes = dict(stages=2, group_size=2, episodes=2, branches=2, bootstrap=20, max_new_tokens=8)
    echo = [{"prompt": p} for p in ("go", "say yes", "again", "yes?")]
    named = grpolab.multiturn_bias(model="builtin", env=Echo, data=echo, out=str(tmp_path / "m1"), log=lambda *a: None,
                              **episodes)  # fmt: skip
    local = grpolab.multiturn_bias(model="builtin", env=LocalEcho, data=echo, out=str(tmp_path / "m2"),
                              log=lambda *a: None, **episodes)  # fmt: skip
    assert named == local and len(named) > 0
    recorded = json.loads((tmp_path / "m2" / "multiturn.json").read_text())["config"]["env"]
    assert recorded.startswith("environment defined in Python: ") and recorded.endswith("<locals>.LocalEcho")


@pytest.mark.slow
def test_a_tool_defined_in_python_runs_in_the_worker_process():
    """A closure no module can import reaches the tool worker (pickled by value), and answers there."""
    from grpolab.commands.objects import ObjectNames
    from grpolab.config.train import TrainConfig
    from grpolab.env.tools import ToolRunner, load_tools

    offset = 7

    def shifted(x: int) -> int:
        """Add the offset.

        Args:
            x: a number
        """
        return x + offset

    names = ObjectNames(TrainConfig)
    spec = names.callable_spec(shifted, "tool", "--tools")
    (schema,) = load_tools([spec], names.given())
    runner = ToolRunner([spec], timeout_s=20.0, given=names.given())
    del names  # the call's objects are gone: the worker has its own (pickled)
    try:
        assert spec.startswith("tool defined in Python: ") and schema["function"]["name"] == "shifted"
        result = runner.call("shifted", {"x": 5})
        assert (result.text, result.error) == ("12", "")
    finally:
        runner.close()
