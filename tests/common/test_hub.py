"""Models and data sets by their Hugging Face Hub id, from a cache laid out as huggingface_hub lays it out, offline;
and the errors of ids that cannot be had, each one line through the Python API and the command line. No test here
reaches the network: the cache is built under a temporary HF_HOME with HF_HUB_OFFLINE=1, and the errors only the Hub
itself can give (no such repository, gated, private, no such revision) come from a local HTTP server that answers as
the Hub does (status and X-Error-Code), through huggingface_hub's own error handling."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from helpers.cli import run_cli
from helpers.hub import COMMIT_A, COMMIT_B, hub_repo, offline_hub
from helpers.runs import quiet
from reward_fixtures import contains_answer

import grpolab
from grpolab.common.hub import HubError, is_hub_id
from grpolab.data.dataset import DataError, Ref, load_records
from grpolab.models.policy import ASSET_DIR

TINY = dict(prompts_per_step=2, group_size=2, eval_questions=4, eval_samples=1, max_new_tokens=8, threads=1)
README_CONFIGS = """---
configs:
- config_name: easy
  data_files:
  - split: train
    path: easy/train.jsonl
- config_name: hard
  data_files:
  - split: train
    path: hard/train.jsonl
  - split: test
    path: hard/test.jsonl
---
"""


def sums(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"{i} + {i + 1} =", "answer": str(2 * i + 1)} for i in range(start, start + n)]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def model_files() -> dict:
    return {f.name: f for f in ASSET_DIR.iterdir() if f.is_file()}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A cache with a model (main = A, tag v1 = B), a data set with train/test splits, one with two configurations,
    and one with no data files."""
    hub = offline_hub(tmp_path / "hf", monkeypatch)
    hub_repo(hub, "org/tiny-arith", "model", COMMIT_A, model_files())
    hub_repo(hub, "org/tiny-arith", "model", COMMIT_B, model_files(), refs=("v1",))
    hub_repo(hub, "org/sums", "dataset", COMMIT_A, {
        "data/train-00000-of-00001.jsonl": jsonl(sums(24)),
        "data/test-00000-of-00001.jsonl": jsonl(sums(6, start=100)),
    })  # fmt: skip
    hub_repo(hub, "org/levels", "dataset", COMMIT_A, {
        "README.md": README_CONFIGS,
        "easy/train.jsonl": jsonl(sums(8)),
        "hard/train.jsonl": jsonl(sums(16, start=50)),
        "hard/test.jsonl": jsonl(sums(4, start=200)),
    })  # fmt: skip
    hub_repo(hub, "org/empty", "dataset", COMMIT_A, {"README.md": "no data here\n"})
    monkeypatch.chdir(tmp_path)
    return hub


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("openai/gsm8k")
    for spec in (
        "builtin",
        "smollm2-135m-instruct",
        "/abs/path",
        "./org/name",
        "a/b/c",
        "data/train.jsonl",
        "x/m.gguf",
    ):
        assert not is_hub_id(spec), spec
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a local path wins


def test_a_model_and_a_data_set_by_hub_id_train_two_steps_and_evaluate(hub, tmp_path):
    run = grpolab.train("org/tiny-arith", "org/sums", [contains_answer], eval_dataset="org/sums", steps=2,
                        out=str(tmp_path / "run"), log=quiet, **TINY)  # fmt: skip
    config = json.loads((run.dir / "config.json").read_text())
    assert config["model"] == "org/tiny-arith" and config["data"] == config["eval_data"] == "org/sums"
    assert config["hub"] == {
        "model": {"id": "org/tiny-arith", "revision": "main", "commit": COMMIT_A},
        "data": {"id": "org/sums", "revision": "main", "commit": COMMIT_A},
        "eval_data": {"id": "org/sums", "revision": "main", "commit": COMMIT_A},
    }
    assert [e["step"] for e in run.evaluations] == [0, 2]
    samples = [json.loads(line) for line in (run.dir / "samples.jsonl").read_text().splitlines()]
    train_q = {s["question"] for s in samples if s["kind"] == "train"}
    eval_q = {s["question"] for s in samples if s["kind"] == "eval"}
    assert train_q and train_q <= {r["prompt"] for r in sums(24)}  # --data: its train split
    assert eval_q == {r["prompt"] for r in sums(4, start=100)}  # --eval-data, the same id: its test split
    # The run's starting model, evaluated again: read from the cache at the run's revision, on the run's questions
    report = grpolab.evaluate(str(run.dir), step=0, samples=0, questions=4, log=quiet)
    assert report["metrics"]["eval/accuracy_greedy"] == run.evaluations[0]["eval/accuracy_greedy"]
    assert {e["question"] for e in report["examples"]} == eval_q


def test_a_revision_and_a_data_set_configuration(hub, tmp_path):
    run = grpolab.train("org/tiny-arith", "org/levels", [contains_answer], revision="v1", data_config="hard",
                        eval_dataset="org/levels", steps=1, out=str(tmp_path / "run"), log=quiet, **TINY)  # fmt: skip
    config = json.loads((run.dir / "config.json").read_text())
    assert config["hub"]["model"] == {"id": "org/tiny-arith", "revision": "v1", "commit": COMMIT_B}
    samples = [json.loads(line) for line in (run.dir / "samples.jsonl").read_text().splitlines()]
    assert {s["question"] for s in samples if s["kind"] == "train"} <= {r["prompt"] for r in sums(16, start=50)}
    assert {s["question"] for s in samples if s["kind"] == "eval"} == {r["prompt"] for r in sums(4, start=200)}
    # a single-split configuration reads its only split whatever it is called
    assert load_records("org/levels", ref=Ref(config="easy")) == [{"prompt": r["prompt"], "answer": r["answer"]}
                                                                 for r in sums(8)]  # fmt: skip


def test_parquet_and_csv_files_of_a_hub_data_set(hub, tmp_path):
    import datasets

    rows = sums(5)
    for name in ("train", "test"):
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / f"{name}.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "all.csv"), index=False)
    hub_repo(hub, "org/tables", "dataset", COMMIT_A, {
        "data/train-00000-of-00001.parquet": tmp_path / "train.parquet",
        "data/test-00000-of-00001.parquet": tmp_path / "test.parquet",
    })  # fmt: skip
    hub_repo(hub, "org/sheet", "dataset", COMMIT_A, {"sums.csv": tmp_path / "all.csv"})
    assert load_records("org/tables") == rows  # --data: the train split
    assert load_records("org/tables", ref=Ref(default_split="test", flag="--eval-data")) == rows
    with pytest.raises(DataError, match=r"--eval-data org/tables: no split 'dev' \(splits: train, test\)"):
        load_records("org/tables", split="dev", ref=Ref(flag="--eval-data"))
    # a CSV's only split, whatever --eval-data would choose by default (its numbers come back as numbers)
    held = load_records("org/sheet", ref=Ref(default_split="test", flag="--eval-data"))
    assert [r["prompt"] for r in held] == [r["prompt"] for r in rows]


def test_a_local_directory_named_like_an_id_loads_from_disk(hub, tmp_path):
    local = tmp_path / "me" / "my-model"  # no such repository in the cache: only the disk has it
    local.mkdir(parents=True)
    for name, src in model_files().items():
        (local / name).write_bytes(src.read_bytes())
    run = grpolab.train("me/my-model", steps=1, out=str(tmp_path / "run"), log=quiet, **TINY)
    config = json.loads((run.dir / "config.json").read_text())
    assert config["model"] == "me/my-model" and "hub" not in config


# ---------------------------------------------------------------- errors, offline


def _one_line_api(fn, *args, **kwargs) -> str:
    with pytest.raises((HubError, DataError, FileNotFoundError)) as e:
        fn(*args, **kwargs)
    text = str(e.value)
    assert "\n" not in text, text
    return text


def _one_line_cli(args: list[str], cwd) -> str:
    done = run_cli(["train", *args, "--steps", "1", "--out", str(cwd / "cli-run")], cwd)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return lines[0]


OFFLINE_ERRORS = [
    # (train keywords, the CLI's flags, what the line says)
    (dict(model="org/not-cached"), ["--model", "org/not-cached"], "not in the Hugging Face cache"),
    (dict(model="org/tiny-arith", revision="v9"), ["--model", "org/tiny-arith", "--revision", "v9"],
     "not in the Hugging Face cache"),
    (dict(model="org/tiny-arith", gguf_file="m.gguf"), ["--model", "org/tiny-arith", "--gguf-file", "m.gguf"],
     "not in the Hugging Face cache"),
    (dict(train_dataset="org/nothing"), ["--data", "org/nothing"], "--data org/nothing: not in the Hugging Face cache"),
    (dict(train_dataset="org/empty"), ["--data", "org/empty"], "no loadable data files"),
    (dict(train_dataset="org/levels"), ["--data", "org/levels"], "several configurations (easy, hard)"),
    (dict(train_dataset="org/levels", data_config="medium"), ["--data", "org/levels", "--data-config", "medium"],
     "no configuration 'medium' (configurations: easy, hard)"),
    (dict(train_dataset="org/levels", data_config="hard", data_split="dev"),
     ["--data", "org/levels", "--data-config", "hard", "--data-split", "dev"], "no split 'dev' (splits: train, test)"),
]  # fmt: skip


@pytest.mark.parametrize("keywords, flags, says", OFFLINE_ERRORS, ids=[c[2][:30] for c in OFFLINE_ERRORS])
def test_each_offline_error_is_one_line(hub, tmp_path, keywords, flags, says):
    rest = {"reward_funcs": [contains_answer]} if "train_dataset" in keywords else {}
    text = _one_line_api(grpolab.train, out=str(tmp_path / "api-run"), steps=1, log=quiet, **rest, **keywords)
    assert says in text, text
    if "not in the Hugging Face cache" in says:
        assert "HF_HUB_OFFLINE" in text and "hf download" in text


@pytest.mark.slow
@pytest.mark.parametrize("keywords, flags, says", OFFLINE_ERRORS[::3], ids=[c[2][:30] for c in OFFLINE_ERRORS[::3]])
def test_each_offline_error_is_one_line_on_the_command_line(hub, tmp_path, keywords, flags, says):
    extra = ["--reward-fn", "reward_fixtures:contains_answer"] if "--data" in flags else []
    assert says in _one_line_cli([*flags, *extra], tmp_path)


# ---------------------------------------------------------------- errors only the Hub gives


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers the repository-info requests of huggingface_hub as the Hub does for a missing, a gated and a private
    repository and a missing revision (the status code and X-Error-Code header its error handling reads)."""

    ANSWERS = {
        "org/missing": (404, "RepoNotFound"),
        "org/gated": (401, "GatedRepo"),
        "org/private": (401, "RepoNotFound"),  # what the Hub answers for a private repository and no token
        "org/tiny-arith": (404, "RevisionNotFound"),
    }

    def do_GET(self):  # noqa: N802 - http.server's name
        repo = next((r for r in self.ANSWERS if f"/{r}/" in self.path or self.path.endswith(f"/{r}")), None)
        status, code = self.ANSWERS.get(repo, (404, "RepoNotFound"))
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def online_hub(tmp_path, monkeypatch):
    """huggingface_hub online, its endpoint a :class:`FakeHub` on this machine."""
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    hub = offline_hub(tmp_path / "hf", monkeypatch)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    yield hub
    server.shutdown()


ONLINE_ERRORS = [
    ("org/missing", "", "no such model repository on the Hugging Face Hub"),
    ("org/gated", "", "a gated repository; accept its conditions"),
    ("org/private", "", "or a private one: log in with `hf auth login` or set HF_TOKEN"),
    ("org/tiny-arith", "nope", "the repository has no revision 'nope'"),
]


@pytest.mark.parametrize("model, revision, says", ONLINE_ERRORS, ids=[c[0] for c in ONLINE_ERRORS])
def test_each_error_of_the_hub_is_one_line(online_hub, tmp_path, model, revision, says):
    text = _one_line_api(grpolab.train, model, steps=1, revision=revision, out=str(tmp_path / "r"), log=quiet)
    assert says in text, text


@pytest.mark.slow
def test_the_errors_of_the_hub_on_the_command_line(online_hub, tmp_path):
    for model, revision, says in ONLINE_ERRORS[1:3]:
        assert says in _one_line_cli(["--model", model, *(["--revision", revision] if revision else [])], tmp_path)
    line = _one_line_cli(["--data", "org/missing", "--reward-fn", "reward_fixtures:contains_answer"], tmp_path)
    assert "--data org/missing: no such dataset repository" in line


def test_a_lora_adapter_repository_loads_its_base_with_the_adapter_merged(hub, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model

    from grpolab.models.policy import load_policy

    base = load_policy("org/tiny-arith").model
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.peft_config["default"].base_model_name_or_path = "org/tiny-arith"  # a Hub id, as on the Hub
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    hub_repo(hub, "org/tiny-arith-lora", "model", COMMIT_B, {f.name: f for f in adapter.iterdir()})
    expected = peft_model.merge_and_unload()
    policy = load_policy("org/tiny-arith-lora")
    assert policy.origin == {"id": "org/tiny-arith-lora", "revision": "main", "commit": COMMIT_B}
    x = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.equal(policy.model(x).logits, expected.eval()(x).logits)
        assert not torch.equal(policy.model(x).logits, load_policy("org/tiny-arith").model(x).logits)
