"""Generator workers (``grpolab generator``, ``--generators N``): a run drawn on N workers over gloo on localhost is
the run drawn in the trainer's process, bit for bit, for any N and with --max-staleness; a worker lost mid-run,
one that joins late and a stranger's connection leave it so; with none left the run stops in one line; a worker
never outlives its trainer. The workers are processes: every test but the configuration's is in the slow tier."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers.processes import free_port, start_worker, within
from helpers.runs import assert_identical_runs, metrics_by_step, quiet, rollouts_of, small_cfg

from grpolab.config.train import ConfigError

OPTIONS = dict(steps=4, log_rollouts=True, warmup_steps=0, save_every=2)


def stop(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        if w.poll() is None:
            w.kill()
        w.wait(timeout=30)


def worker_run(tmp_path, name: str, n: int, K: int, **over):
    """A run of OPTIONS (and ``over``) drawn on ``n`` workers (processes) at --max-staleness K; the workers' exit
    codes."""
    from grpolab.training.recipe import train

    port = free_port()
    workers = [start_worker(port) for _ in range(n)]
    try:
        where = dict(generators=n, generator_listen=f"127.0.0.1:{port}")
        cfg = small_cfg(tmp_path / name, max_staleness=K, **where, **{**OPTIONS, **over})
        return train(cfg, log=quiet), [w.wait(timeout=60) for w in workers]  # told to stop at the end
    finally:
        stop(workers)


@pytest.mark.slow
@pytest.mark.parametrize("K", [1])  # K = 0 too when run by hand (docs/distributed.md); 1 has more to get right
def test_one_worker_draws_the_run_the_trainer_draws_itself_bit_for_bit_and_resumes_it(tmp_path, K):
    """Steps 1-3 on one worker, then --resume from step 2's checkpoint (a version in flight at K = 1) on a new
    worker to step 4: the trainer's own run of 4 steps, bit for bit."""
    import shutil

    from grpolab.training.recipe import train

    inline = train(small_cfg(tmp_path / "inline", max_staleness=K, generator="inline", **OPTIONS), log=quiet)
    cut, codes = worker_run(tmp_path, "workers", 1, K, steps=3)  # saved at 2 and 3 (the last)
    shutil.rmtree(cut / "checkpoints" / "step_3")
    run, resumed_codes = worker_run(tmp_path, "workers", 1, K, resume=True)
    assert codes == resumed_codes == [0]
    assert_identical_runs(inline, run, step=4)
    assert metrics_by_step(run)[4]["generators/rows_worker1"] > 0
    events = [json.loads(line) for line in (run / "generators.jsonl").read_text().splitlines()]
    assert {e["step"] for e in events if e["kind"] == "draw"} == {1, 2, 3, 4}  # step 3's were cut and redrawn
    assert sum(e["rows"] for e in events if e["kind"] == "draw" and e["step"] == 4) >= 16


@pytest.mark.slow
def test_three_workers_draw_the_trainers_tokens_and_its_log_probs_to_the_cpus_rounding(tmp_path):
    """Split three ways, every row's tokens are the trainer's own, and so is the update (on-policy, fp32: no
    correction reads the sampler's log-probs); the sampler's log-probs and entropies differ in their last bits only
    (this CPU's matrix kernels compute a row otherwise in a batch of fewer than 4 rows, and the decode loop's batch
    shrinks as rows end: docs/distributed.md), which the engine/* and policy/entropy metrics show."""
    from safetensors.torch import load_file

    from grpolab.training.recipe import train

    inline = train(small_cfg(tmp_path / "inline", generator="inline", **OPTIONS), log=quiet)
    run, codes = worker_run(tmp_path, "workers", 3, 0)
    assert codes == [0, 0, 0]
    assert rollouts_of(run) == rollouts_of(inline)
    sampler_side = ("engine/", "policy/entropy", "generators/")
    a, b = metrics_by_step(inline), metrics_by_step(run)
    for step in a:
        assert {k: v for k, v in a[step].items() if not k.startswith(sampler_side)} == {
            k: v for k, v in b[step].items() if not k.startswith(sampler_side)
        }
        assert b[step].get("policy/entropy", 0) == pytest.approx(a[step].get("policy/entropy", 0), rel=1e-6)
    wa, wb = (load_file(str(r / "checkpoints" / "step_4" / "model.safetensors")) for r in (inline, run))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [b[4][f"generators/rows_worker{i}"] > 0 for i in (1, 2, 3)] == [True] * 3
    events = [json.loads(line) for line in (run / "generators.jsonl").read_text().splitlines()]
    sent = [(e["worker"], e["version"], e["base"]) for e in events if e["kind"] == "weights"]  # K = 0: the delta's
    assert sorted(sent) == [(w, v, v - 1 if v else None) for w in (1, 2, 3) for v in range(5)]  # base held till sent


def test_a_non_local_listen_address_needs_a_token(tmp_path, monkeypatch):
    from grpolab.training.recipe import build_trainer

    monkeypatch.delenv("GRPOLAB_GENERATOR_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="needs a shared token"):
        build_trainer(small_cfg(tmp_path, generators=1, generator_listen="0.0.0.0:0"), log=quiet)
    with pytest.raises(ConfigError, match="--generators: must be >= 0"):
        small_cfg(tmp_path, generators=-1).validate()
    with pytest.raises(ConfigError, match="leave --generator on auto"):
        small_cfg(tmp_path, generators=1, generator="process").validate()


FLAGS = [
    *("--prompts-per-step", "4", "--group-size", "4", "--eval-questions", "16", "--eval-samples", "2"),
    *("--max-new-tokens", "48", "--threads", "1", "--device", "cpu", "--no-progress", "--log-rollouts"),
    *("--warmup-steps", "0", "--max-staleness", "1"),
    *("--hacking-every", "0", "--honeypots", "none"),  # as small_cfg, which the uninterrupted runs take
]


def start_trainer(out, port: int, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "grpolab", "train", "--out", str(out), "--steps", str(steps), *FLAGS]
    cmd += ["--generators", "2", "--generator-listen", f"127.0.0.1:{port}", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged_steps(out) -> dict[int, dict]:
    import json

    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r for r in rows if "step" in r}


def wait_for(what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what.__doc__ or what}")


@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.slow
def test_lost_late_and_stranger_workers_leave_the_run_as_the_trainer_draws_it(tmp_path):
    from grpolab.training.recipe import train

    port, out = free_port(), tmp_path / "faults"
    whole = [start_worker(port), start_worker(port)]  # the uninterrupted run on 2 workers
    try:
        cfg = small_cfg(tmp_path / "whole", max_staleness=1, generators=2, generator_listen=f"127.0.0.1:{port}")
        uninterrupted = train(cfg.replace(steps=8, log_rollouts=True, warmup_steps=0, save_every=8), log=quiet)
    finally:
        stop(whole)
    port = free_port()
    a, b = start_worker(port), start_worker(port)
    trainer = start_trainer(out, port, 8)
    late = stranger = None
    try:
        wait_for(lambda: 2 in logged_steps(out))
        a.kill()  # SIGKILL, mid-run: its rows go to b
        with socket.create_connection(("127.0.0.1", port)) as s:  # a stranger: garbage, then gone
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        stranger = start_worker(port, "--run", "another-run")  # a worker of another run
        wait_for(lambda: any(r.get("generators/lost") == 1 for r in logged_steps(out).values()))
        b.kill()  # now none is left: the trainer waits for one to join
        late = start_worker(port)
        said, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
    finally:
        stop([w for w in (a, b, late, stranger, trainer) if w is not None])
    assert_identical_runs(uninterrupted, out, step=8)
    rows = logged_steps(out)
    assert rows[8]["generators/lost"] == 2 and rows[8]["generators/refused"] == 2
    assert rows[8]["generators/redrawn"] >= 0
    late_rows = [v for r in rows.values() for k, v in r.items() if k.startswith("generators/rows_worker")]
    assert sum(rows[s].get("generators/rows_worker3", 0) for s in rows) > 0  # the late worker (the third) drew
    assert len(late_rows) >= 8
    assert stranger.returncode != 0 and "not 'another-run'" in stranger.stdout.read()
    assert said.count("refused a connection") == 2 and "lost worker 1" in said and "lost worker 2" in said
    assert "step 1: generators: worker 1: " in said and " · worker 2: " in said  # who drew, how fast
    # the timeline (generators.jsonl) and the report's section drawn from it
    events = [json.loads(line) for line in (out / "generators.jsonl").read_text().splitlines()]
    assert sorted(e["worker"] for e in events if e["kind"] == "lost") == [1, 2]
    assert sum(e["kind"] == "refused" for e in events) == 2 and 3 in {
        e["worker"] for e in events if e["kind"] == "joined"
    }
    for worker in (1, 2, 3):  # each took the first version it was sent whole, then each as the delta from the last
        sent = [e for e in events if e["kind"] == "weights" and e["worker"] == worker]
        assert sent[0]["base"] is None and [e["base"] for e in sent[1:]] == [e["version"] for e in sent[:-1]]
    late = [e for e in events if e["kind"] == "weights" and e["worker"] == 3]
    assert len(late) >= 2 and late[0]["bytes"] == max(e["bytes"] for e in events if e["kind"] == "weights")
    from grpolab.report.page import build_report

    page = build_report(out).read_text()
    assert 'id="generators"' in page and "worker 3" in page and 'alt="generator timeline"' in page


@pytest.mark.slow
def test_a_hung_worker_is_dropped_and_with_none_left_the_run_stops_in_one_line_keeping_its_checkpoint(tmp_path):
    port, out = free_port(), tmp_path / "none"
    workers = [start_worker(port), start_worker(port)]
    trainer = start_trainer(out, port, 50, "--save-every", "1", "--generator-wait", "5", "--generator-timeout", "8")
    try:
        wait_for(lambda: 2 in logged_steps(out))
        workers[0].send_signal(signal.SIGSTOP)  # hangs: alive, connected, silent
        wait_for(lambda: any(r.get("generators/lost") == 1 for r in logged_steps(out).values()))
        workers[1].kill()
        t0 = time.monotonic()
        said, err = trainer.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        stop([*workers, trainer])
    assert trainer.returncode == 1 and took < 30
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no generator worker left (lost 2)" in errors[0]
    lost = [line for line in said.splitlines() if "generators: lost worker" in line]  # the hung one, the killed one
    assert len(lost) == 2 and ("no answer in 8 s (--generator-timeout)" in lost[0] or "timed out" in lost[0].lower())
    from grpolab.models.checkpoint import newest_intact

    step, _ = newest_intact(out)
    assert step >= 2  # the last saved step is whole


@pytest.mark.slow
def test_sigterm_stops_trainer_and_workers_keeping_the_checkpoint_and_a_worker_never_outlives_its_trainer(tmp_path):
    out = tmp_path / "stopped"
    port = free_port()
    workers = [start_worker(port), start_worker(port)]
    trainer = start_trainer(out, port, 50)
    try:
        wait_for(lambda: 1 in logged_steps(out))
        trainer.send_signal(signal.SIGTERM)  # finishes the step, saves, stops; its workers are told to stop
        said, _ = trainer.communicate(timeout=60)
        for w in workers:
            w.wait(timeout=30)
    finally:
        stop([*workers, trainer])
    assert trainer.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in said
    assert [w.returncode for w in workers] == [0, 0]
    from grpolab.models.checkpoint import newest_intact

    stopped_at, _ = newest_intact(out)
    port = free_port()  # resumed on new workers, then the trainer killed outright
    workers = [start_worker(port), start_worker(port)]
    trainer = start_trainer(out, port, 50, "--resume")
    try:
        wait_for(lambda: stopped_at + 1 in logged_steps(out))
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        t0 = time.monotonic()
        for w in workers:
            w.wait(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        stop([*workers, trainer])


EVENTS = [  # two workers over two steps: worker 2 lost in step 2, its part redrawn by worker 1
    {"step": 1, "kind": "joined", "worker": 1, "at": 0.0},
    {"step": 1, "kind": "joined", "worker": 2, "at": 0.1},
    {"step": 1, "kind": "draw", "worker": 1, "start": 1.0, "end": 3.0, "rows": 8, "version": 0},
    {"step": 1, "kind": "draw", "worker": 2, "start": 1.0, "end": 5.0, "rows": 8, "version": 0},
    {"step": 1, "kind": "weights", "worker": 1, "start": 6.0, "end": 6.5, "version": 1},
    {"step": 1, "kind": "weights", "worker": 2, "start": 6.5, "end": 7.0, "version": 1},
    {"step": 2, "kind": "refused", "at": 7.5, "peer": "127.0.0.1:5"},
    {"step": 2, "kind": "lost", "worker": 2, "at": 8.0, "why": "its connection failed"},
    {"step": 2, "kind": "draw", "worker": 1, "start": 7.0, "end": 9.0, "rows": 8, "version": 1},
    {"step": 2, "kind": "draw", "worker": 1, "start": 9.0, "end": 11.0, "rows": 8, "version": 1},
]


def test_the_step_line_says_each_workers_rows_and_rate_while_drawing():
    from grpolab.rollout.worker_events import step_line

    step1 = [e for e in EVENTS if e["step"] == 1]
    assert step_line(step1) == (
        "generators: worker 1: 8 rows in 2.00 s (4.0/s) · worker 2: 8 rows in 4.00 s (2.0/s) · weights 1.00 s"
    )
    step2 = [e for e in EVENTS if e["step"] == 2]
    assert step_line(step2) == "generators: worker 1: 16 rows in 4.00 s (4.0/s) · weights 0.00 s; lost worker 2"
    assert step_line([e for e in EVENTS if e["kind"] != "draw"]) is None


def test_the_reports_generator_section_counts_each_worker_and_draws_the_timeline(tmp_path):
    from grpolab.report.generators import generators_section, worker_table

    table = {r["worker"]: r for r in worker_table(EVENTS)}
    assert table[1] == dict(worker=1, rows=24, draws=3, draw_s=6.0, weights_s=0.5, lost_at=None, rows_per_s=4.0)
    assert table[2] == dict(worker=2, rows=8, draws=1, draw_s=4.0, weights_s=0.5, lost_at=2, rows_per_s=2.0)
    assert generators_section(tmp_path) == ""  # a run without workers has no section
    lines = [json.dumps(e) for e in EVENTS]
    (tmp_path / "generators.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "kind": "dr')  # cut by a kill
    html = generators_section(tmp_path)
    assert "<td class='l'>worker 2</td><td>8</td><td>1</td>" in html and "1 connection(s) refused" in html
    assert 'alt="generator timeline" src="data:image/png;base64,' in html


def test_under_torchrun_a_rank_whose_peer_stopped_says_so_in_one_line(monkeypatch):
    from grpolab.commands.cli import _peer_gone

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:60621. This is typically caused by a remote worker crashing. Check the logs ... GLHF!"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _peer_gone(gloo) == "Connection closed by peer [127.0.0.1]:60621"
    assert _peer_gone(RuntimeError("shape mismatch")) is None  # any other error keeps its traceback
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _peer_gone(gloo) is None  # one process: no peer to blame


def test_a_worker_that_samples_with_other_kernels_is_named():
    import torch

    from grpolab.rollout.remote.handle import other_kernels

    same = {"engine": "hf", "device": "cpu", "rollout_dtype": "auto"}
    assert other_kernels(same, "cpu", torch.float32) == ""
    assert other_kernels({**same, "rollout_dtype": "float32"}, "cpu", torch.float32) == ""
    other = {"engine": "vllm", "device": "cuda:1", "rollout_dtype": "bfloat16"}
    assert other_kernels(other, "cpu", torch.float32) == "with vllm, on cuda:1, in bfloat16"
    assert other_kernels({**same, "device": "cuda:1"}, "cuda:0", torch.float32) == ""  # another GPU, same kernels


def one_worker_trainer(tmp_path, port: int, **over):
    """A trainer (in this process) at --max-staleness 1 whose draws run on one worker at ``port``, joined."""
    from grpolab.training.recipe import build_trainer

    where = dict(generators=1, generator_listen=f"127.0.0.1:{port}", max_staleness=1, warmup_steps=0)
    return build_trainer(small_cfg(tmp_path, **{**where, **over}), log=quiet)


@pytest.mark.slow
def test_a_worker_stopped_mid_frame_is_dropped_after_the_timeout_and_the_run_stops_in_one_error(tmp_path, monkeypatch):
    """The worker writes its first answer's magic and length, then stops itself (SIGSTOP) before the rest: the
    trainer reads frames whole on a thread of its own, so the worker is lost after --generator-timeout (3 s), and
    with none left the run stops after --generator-wait (2 s), instead of a read blocked for ever."""
    from grpolab.common.errors import GeneratorError
    from grpolab.rollout.replica import STOP_MID_ANSWER

    port = free_port()
    monkeypatch.setenv(STOP_MID_ANSWER, "drawn")  # read by the worker only: the trainer's engine is the pool
    worker = start_worker(port)
    monkeypatch.delenv(STOP_MID_ANSWER)
    trainer = None
    try:
        trainer = one_worker_trainer(tmp_path, port, generator_timeout=3, generator_wait=2)
        t0 = time.monotonic()
        with pytest.raises(GeneratorError, match=r"no generator worker left \(lost 1\)"):
            within(60, lambda: trainer.step(1))
        assert time.monotonic() - t0 < 30
        assert trainer.sampling_stage.engine.counts["lost"] == 1 and worker.poll() is None  # still there, stopped
    finally:
        if trainer is not None:
            trainer.close()
        stop([worker])


@pytest.mark.slow
def test_a_workers_answer_bigger_than_the_socket_buffers_is_read_while_the_weights_are_broadcast(tmp_path):
    """At K = 1 the worker draws a step ahead (3,000 rows of 100 + 20 tokens: 6 MB, more than the connection buffers)
    and writes it while the trainer broadcasts the next weights: the trainer's reader takes the answer meanwhile, so
    the worker reaches the broadcast, and the answer is the draw its request gets. (A trainer that read only after
    the broadcast would wait in it for the group's timeout, and lose the worker.)"""
    from grpolab.rollout.engine import SamplingSettings

    port = free_port()
    worker = start_worker(port)
    trainer = None
    try:
        trainer = one_worker_trainer(tmp_path, port, generator_timeout=150)
        engine = trainer.sampling_stage.engine
        n, settings = 3000, SamplingSettings(20, 1.0, 1.0, ignore_eos=True)
        prompts, keys = [[1, *(5 + i % 90 for i in range(99))] for _ in range(n)], [(11, i) for i in range(n)]
        assert engine.prefetch(prompts, keys, settings)  # drawn with version 0, for the step after the update
        within(240, engine.weights_changed)  # version 1 broadcast while the worker draws and answers
        out = within(60, lambda: engine.generate(prompts, keys, settings))  # version 0: the draw ahead
        tensors = [*out.batch.tensors, out.logprobs, out.entropy]
        assert sum(t.numel() * t.element_size() for t in tensors) > 4 << 20
        assert engine.prefetches == {"used": 1, "dropped": 0}
        assert engine.counts == {"lost": 0, "redrawn": 0, "refused": 0, "stale": 0} and engine.syncs == 1
        trainer.close()
        assert worker.wait(timeout=30) == 0  # told to stop
    finally:
        if trainer is not None:
            trainer.close()
        stop([worker])


def sent_digest(trainer, dtype, mixed: bool = False) -> str:
    """The checksum of the policy's served weights now, as a worker is sent them (floating ones in ``dtype``; with
    ``mixed``, only those read in products, the rest in the policy's own)."""
    from grpolab.rollout.replica import weights_digest
    from grpolab.rollout.weights import product_weights, served_weights

    model = trainer.policy.model
    cast = product_weights(model) if mixed else {n for n, _ in served_weights(model)}
    served = served_weights(model)
    return weights_digest({n: t.to(dtype) if t.is_floating_point() and n in cast else t for n, t in served})


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_worker_holds_each_version_bit_for_bit_and_closing_the_pool_frees_its_port(tmp_path, machine_kind, lora_rank):
    """Three steps in bf16 rollouts, of every weight (bf16-mixed: the products' weights in bf16, the rest fp32) or of
    a LoRA adapter (sent unmerged: the worker merges it):
    after each, the version the worker holds (a draw with the current weights reports its checksum) is the trainer's
    served weights in bf16, the first sent whole, each after it as the delta from the one before, in fewer bytes
    than whole (with LoRA, the factors alone: the base went once). Then the listening socket is shut down, which
    wakes the thread blocked in accept() (closing it alone does not, on Linux): the thread ends and the port can be
    listened on again at once."""
    from grpolab.rollout.engine import SamplingSettings

    machine_kind(bf16=False)  # the sampler's kernels (the worker's too): the checksums do not depend on them
    port = free_port()
    worker = start_worker(port)
    try:
        # small steps (lr 1e-6): few bf16 weights change, and the deltas are smaller than the whole
        # full fine-tuning under bf16-mixed: the products' weights go in bf16, the norms and embedding in fp32
        precision = "32-true" if lora_rank else "bf16-mixed"
        trainer = one_worker_trainer(
            tmp_path, port, rollout_dtype="bfloat16", lr=1e-6, lora_rank=lora_rank, precision=precision
        )
        engine = trainer.sampling_stage.engine
        engine.digests, rows, events = [], [], []
        for t in range(1, 4):
            result = trainer.step(t)
            rows.append(result.metrics)
            events += [e for e in result.engine_events if e["kind"] == "weights"]
            with engine.current_weights():  # a draw with the newest version: the one this step synced
                engine.generate([[1, 5, 6]], [(7, t)], SamplingSettings(4, 1.0, 1.0, True))
            assert engine.digests[-1] == sent_digest(trainer, torch.bfloat16, mixed=not lora_rank)
        assert [(e["version"], e["base"]) for e in events] == [(0, None), (1, 0), (2, 1), (3, 2)]
        whole = sum(b.numel() * b.element_size() for b in engine.versions.slot.buffers.values())
        assert events[0]["bytes"] == whole and all(0 < e["bytes"] < whole / 2 for e in events[1:])
        assert all(0 < r["generators/sync_delta_frac"] < 1 and r["generators/sync_bytes"] > 0 for r in rows)
        assert rows[1]["generators/sync_bytes"] == events[2]["bytes"]  # step 2: its delta alone
        assert len(engine.versions.lora) == (21 if lora_rank else 0)  # every linear layer adapted, sent unmerged
        accepting = engine.listener.accepting
        trainer.close()
        accepting.join(5)
        assert not accepting.is_alive()
        with socket.create_server(("127.0.0.1", port)):
            pass
        assert worker.wait(timeout=30) == 0  # told to stop
    finally:
        stop([worker])
