"""--generator process: the rollouts drawn in a process of its own. At K = 0 the run is bit for bit the synchronous
loop's (metrics, rollouts, weights); at K >= 1 the next step's rollouts are drawn ahead, during the update, and the
run is the one-process lagged run's; a generator that dies or hangs ends the run in one error, within a bounded
time, with its checkpoints intact and no process left behind."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.processes import within
from helpers.runs import metrics_by_step, quiet, rollouts_of, small_cfg, train_args

from grpolab.common.errors import GeneratorError
from grpolab.config.train import ConfigError


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    last = max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return load_file(last / "model.safetensors")


def assert_bit_identical(a: Path, b: Path) -> None:
    """Two runs' metrics (times and the generator's own books, ``generators/sync_*``, aside), rollouts and final
    weights are equal: no tolerance."""

    def books(run: Path) -> dict:
        return {s: {k: v for k, v in r.items() if not k.startswith("generators/")} for s, r in metrics_by_step(run).items()}  # fmt: skip

    assert books(a) == books(b)
    assert rollouts_of(a) == rollouts_of(b)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_k_0_through_the_generator_process_is_bit_identical_to_the_synchronous_loop(tmp_path):
    from grpolab.training.recipe import train

    options = dict(steps=4, log_rollouts=True, threads=1)
    sync = train(small_cfg(tmp_path / "sync", **options), log=quiet)
    process = train(small_cfg(tmp_path / "process", generator="process", max_staleness=0, **options), log=quiet)
    assert_bit_identical(sync, process)
    assert "async/staleness_max" not in metrics_by_step(process)[2]  # K = 0: on-policy, nothing stale to log
    sent = {s: r["generators/sync_bytes"] for s, r in metrics_by_step(process).items() if s}
    assert sent[1] == 0 and min(sent[s] for s in (2, 3, 4)) > 0  # the warmup's first step moves no weight: none sent


@pytest.mark.slow
def test_k_1_through_the_generator_process_is_the_lagged_run_and_draws_each_step_ahead(tmp_path):
    from grpolab.training.recipe import run_training, train

    options = dict(steps=4, log_rollouts=True, max_staleness=1, warmup_steps=0)
    inline = train(small_cfg(tmp_path / "inline", generator="inline", **options), log=quiet)
    recipe = run_training(small_cfg(tmp_path / "process", **options), log=quiet)  # auto: a process when K >= 1
    assert_bit_identical(inline, recipe.out)
    engine = recipe.trainer.sampling_stage.engine
    # steps 2..4 were each asked for before the update of the step before, and used as drawn (the evaluations of
    # steps 0 and 4 drew afresh: the one after step 4 left step 5's draw ahead waiting, not dropped)
    assert engine.prefetches == {"used": 3, "dropped": 0}
    # each step's draw and the two evaluations' greedy and sampled draws, each span timed
    assert [kind for kind, *_ in engine.spans].count("generate") == 4 + 2 * 2
    assert all(end >= start for _, start, end in engine.spans)
    assert not engine.process.is_alive()  # the run closed its generator


@pytest.mark.slow
def test_a_request_other_than_the_one_drawn_ahead_is_drawn_afresh(tmp_path):
    from grpolab.rollout.engine import SamplingSettings
    from grpolab.training.recipe import build_trainer

    trainer = build_trainer(small_cfg(tmp_path, max_staleness=1, warmup_steps=0), log=quiet)
    engine = trainer.sampling_stage.engine
    try:
        prompts, keys = [[1, 5, 6], [1, 7]], [(9, 1), (9, 2)]
        settings = SamplingSettings(8, 1.0, 1.0, True)
        trainer.step(1)  # its own draw, and step 2's drawn ahead with the weights after step 1
        assert engine.prefetch(prompts, keys, settings)  # in place of step 2's, which is dropped
        engine.weights_changed()  # now a draw uses the weights after step 1
        ahead = engine.generate(prompts, keys, settings)  # the one drawn ahead
        again = engine.generate(prompts, keys, settings)  # drawn afresh: the same rollouts
        assert engine.prefetch(prompts, keys, settings)  # ahead for the next sync's weights ...
        stale = engine.generate(prompts, keys, settings)  # ... so not what this draw asks for: drawn afresh
        other = engine.generate(prompts, [(9, 3), (9, 4)], settings)
        assert engine.prefetches == {"used": 1, "dropped": 1}
        engine.weights_changed()
        engine.generate(prompts, keys, settings)  # the draw ahead waited for its own request
        assert engine.prefetches == {"used": 2, "dropped": 1}
        assert engine.stale == 1  # the answer to the dropped one (its tag) came, and was read and let go
        for out in (again, stale):
            assert torch.equal(out.batch.completion_ids, ahead.batch.completion_ids)
            assert torch.equal(out.logprobs, ahead.logprobs)
        assert not torch.equal(other.batch.completion_ids, ahead.batch.completion_ids)
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_hung_generator_is_one_error_after_the_timeout_and_is_stopped(tmp_path):
    from grpolab.training.recipe import build_trainer

    trainer = build_trainer(small_cfg(tmp_path, max_staleness=1, warmup_steps=0, generator_timeout=2), log=quiet)
    process = trainer.sampling_stage.engine.process
    try:
        trainer.step(1)
        inbox, deadline = trainer.sampling_stage.engine._pipe.inbox, time.monotonic() + 30
        while inbox.empty() and time.monotonic() < deadline:  # step 2's rollouts, drawn ahead, were read whole
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGSTOP)  # alive, answering nothing
        t0 = time.monotonic()
        with pytest.raises(GeneratorError, match=r"gave no answer in 2 s while .*--generator-timeout"):
            # step 2 reads its rollouts from the pipe (sent by value: nothing is fetched from the stopped child),
            # then waits for the child to have taken step 1's weights: when that answer too reached the pipe before
            # the stop, step 2 ends and step 3 waits for its draw ahead, which the stopped child never makes
            trainer.step(2)
            trainer.step(3)
        assert time.monotonic() - t0 < 20
        assert not process.is_alive()
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_generator_stopped_between_an_answers_length_and_its_payload_is_one_error_in_time(tmp_path, monkeypatch):
    """The child writes the length of its first draw's answer and stops itself (SIGSTOP) before the payload: the
    trainer reads messages whole on a thread of its own, so its wait keeps its deadline (--generator-timeout 2)
    instead of blocking in the pipe's read for ever."""
    from grpolab.rollout.replica import STOP_MID_ANSWER
    from grpolab.training.recipe import build_trainer

    monkeypatch.setenv(STOP_MID_ANSWER, "drawn")  # read by the child at its first draw's answer
    trainer = build_trainer(small_cfg(tmp_path, max_staleness=1, warmup_steps=0, generator_timeout=2), log=quiet)
    process = trainer.sampling_stage.engine.process
    try:
        t0 = time.monotonic()
        with pytest.raises(GeneratorError, match=r"gave no answer in 2 s while drawing"):
            within(60, lambda: trainer.step(1))
        assert time.monotonic() - t0 < 20 and not process.is_alive()
    finally:
        trainer.close()


def _big_answer_then_answer_each(conn):
    """A scripted child: a 2 MB answer to tag 1, written whether or not the trainer reads, then an answer to each
    request it reads."""
    from grpolab.rollout.replica import get_message as _get
    from grpolab.rollout.replica import put_message as _put

    _put(conn, ("draw", 1, b"a" * (2 << 20)))
    while True:
        kind, tag, *_ = _get(conn)
        _put(conn, (kind, tag, "ok"))


@pytest.mark.slow
def test_a_big_request_while_the_child_writes_a_big_answer_is_read_and_answered(tmp_path):
    """Both ends writing 2 MB at once (the pipe holds ~200 KB each way): an evaluation's request sent while the
    child still writes the draw made ahead. The trainer's reader drains the answer, so the child reads the request."""
    import multiprocessing as mp

    from grpolab.rollout.generator import ProcessEngine
    from grpolab.rollout.replica import pipe_end as _pipe

    ctx = mp.get_context("fork")  # a scripted child, no model: fork is enough
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_big_answer_then_answer_each, args=(child,), daemon=True)
    process.start()
    child.close()
    engine = object.__new__(ProcessEngine)  # the trainer's side alone, over the scripted child
    engine._pipe, engine.process, engine.timeout = _pipe(conn), process, 10.0
    engine._answers, engine._dropped, engine._tag, engine.stale = {}, set(), 1, 0
    try:
        tag = within(30, lambda: engine._send("draw", b"r" * (2 << 20)))
        assert within(30, lambda: engine._answer(1, "drawing ahead"))[:3] == b"aaa"
        assert within(30, lambda: engine._answer(tag, "drawing")) == "ok"
    finally:
        engine.close(ask=False)
    assert not process.is_alive()


def answer_bytes(out) -> int:
    """The bytes of a draw's answer: its tensors' (what the child writes into the pipe)."""
    tensors = [*out.batch.tensors, out.logprobs, out.entropy]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.slow
def test_answers_of_megabytes_at_k_1_with_an_evaluation_and_a_group_size_change_between_are_each_answered(tmp_path):
    """At K = 1 a step's draw ahead (here 2,000 rows of 60 + 60 tokens: over 3 MB) is outstanding while the trainer
    sends requests that do not match it, as an evaluation (the newest weights) and a group-size change (another number
    of rows) do, each of them over 200 KB of prompts: both ends write more than the pipe holds (~200 KB each way) at
    once. Every answer comes, and the draw ahead is still the one its own request gets."""
    from grpolab.rollout.engine import SamplingSettings
    from grpolab.training.recipe import build_trainer

    trainer = build_trainer(small_cfg(tmp_path, max_staleness=1, warmup_steps=0, generator_timeout=60), log=quiet)
    engine = trainer.sampling_stage.engine
    n, settings = 2000, SamplingSettings(60, 1.0, 1.0, ignore_eos=True)
    prompts = [[1, *range(5, 64)] for _ in range(n)]
    keys = [(11, i) for i in range(n)]
    try:
        assert within(120, lambda: engine.prefetch(prompts, keys, settings))
        with engine.current_weights():  # an evaluation: drawn with the newest weights, another request
            evaluation = within(120, lambda: engine.generate(prompts, [(12, i) for i in range(n)], settings))
        fewer = within(120, lambda: engine.generate(prompts[:1500], keys[:1500], settings))  # G changed
        ahead = within(120, lambda: engine.generate(prompts, keys, settings))
        assert engine.prefetches == {"used": 1, "dropped": 0} and engine.stale == 0
        assert min(answer_bytes(out) for out in (evaluation, ahead)) > 3 << 20
        assert len(fewer.batch.completion_ids) == 1500
        assert not torch.equal(evaluation.batch.completion_ids, ahead.batch.completion_ids)
    finally:
        trainer.close()


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (Linux's /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with open(task / "children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.slow
def test_a_killed_generator_ends_the_run_in_one_error_with_its_checkpoint_intact_and_no_process_left(tmp_path):
    from grpolab.models.checkpoint import newest_intact

    out = tmp_path / "run"
    args = train_args(tmp_path, "run", 40, "--max-staleness", "1", "--save-every", "2")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "grpolab", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step_2" / "manifest.json").exists():
            assert trainer.poll() is None and time.monotonic() < deadline, "the run ended before its checkpoint"
            time.sleep(0.2)
        started = children(trainer.pid)  # the generator, and multiprocessing's resource tracker
        (generator,) = [pid for pid in started if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(generator, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = trainer.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert took < 30
    assert trainer.returncode == 1
    lines = [line for line in err.decode().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "the generator process" in lines[0] and "died (killed by SIGKILL)" in lines[0]
    step, ckpt = newest_intact(out, warn=quiet)
    assert step >= 2 and (ckpt / "stale_weights.safetensors").exists()
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits once its last holder has
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in started)


def test_generator_options_are_checked_in_one_line():
    from grpolab.config.train import TrainConfig

    with pytest.raises(ConfigError, match="--generator: must be 'auto', 'inline' or 'process'"):
        TrainConfig(generator="thread").validate()
    with pytest.raises(ConfigError, match="--generator-threads: must be >= 0"):
        TrainConfig(generator_threads=-1).validate()
    with pytest.raises(ConfigError, match="--generator-timeout: must be > 0"):
        TrainConfig(generator_timeout=0).validate()
    if importlib.util.find_spec("vllm") is not None:  # vLLM's options are checked only where it is installed
        with pytest.raises(ConfigError, match="--max-staleness: K >= 1 with vllm draws in the generator process"):
            TrainConfig(max_staleness=1, rollout_engine="vllm", generator="inline").validate()
    assert (TrainConfig(max_staleness=1).engine.placement, TrainConfig().engine.placement) == ("process", "inline")
    assert TrainConfig(max_staleness=1, generator="inline").engine.placement == "inline"
