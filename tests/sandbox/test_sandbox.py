"""The code reward's sandbox against programs that attack the machine, and the isolation it falls back to.

Every attack runs through the code reward itself (``grpolab.rewards.rewarder.code_reward``), and once more inside a
training run (``test_the_attack_battery_inside_a_training_run``). For each: its reward is 0 (or the result of
its test), this process lives on, the listener saw no connection, nothing was written outside the program's
own directory, no process of it is left, and it ended within the timeout plus a small margin.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers.marks import needs_bwrap
from helpers.processes import within
from sandbox_attacks import ATTACKS, AttackReward, program

from grpolab.rewards.code import CodeReward, CodeRewardSettings
from grpolab.sandbox import Job, Limits, Sandbox, SandboxError, runner

TIMEOUT = 3.0
MARGIN = 1.5  # process start, teardown and a loaded 2-core machine
LIMITS = Limits(timeout_s=TIMEOUT, cpu_s=3, memory_mb=512)


def survivors(*markers: str) -> list[str]:
    """Processes with one of ``markers`` on their command line: a sandbox's label (its harnesses, and every process
    they forked) or the marker an attack put on the processes it started."""
    left = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmdline for m in markers):
            left.append(f"{entry.name}: {cmdline[:100]}")
    return left


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that records whether anything connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)

    def connections() -> int:
        n = 0
        while True:
            try:
                conn, _ = srv.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    yield srv.getsockname()[1], connections
    srv.close()


@pytest.fixture
def code_reward():
    """A code reward of its own with the tests' limits (bubblewrap); its sandbox is closed afterwards."""
    reward = CodeReward(CodeRewardSettings(limits=LIMITS, workers=2, isolation="bwrap"))
    yield reward
    reward.close()


@pytest.fixture
def sandboxed(code_reward):
    """The code reward's sandbox with the tests' limits (bubblewrap)."""
    code_reward.start()
    return code_reward.sandbox()


# (status the reward counts, reward); the daemon and kill_parent programs end normally, so their test decides.
EXPECTED = {
    "infinite_loop": ("timeout", 0.0),
    "fork_bomb": ("timeout", 0.0),
    "allocate_10gb": ("memory", 0.0),
    "write_10gb_file": ("failed", 0.0),
    "write_run_dir": ("failed", 0.0),
    "write_home_dir": ("failed", 0.0),
    "read_trainer_env": ("failed", 0.0),
    "connect_listener": ("failed", 0.0),
    "kill_parent": ("failed", 0.0),  # EPERM: its parent is the sandbox's init, owned by another user id
    "ignore_sigterm_and_sleep": ("timeout", 0.0),
    "daemon": ("passed", 1.0),
    "print_1gb": ("failed", 0.0),
}


@needs_bwrap
@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.slow
def test_an_attacking_program_harms_nothing(attack, code_reward, sandboxed, listener, tmp_path, monkeypatch):
    port, connections = listener
    marker = f"grpolab-attack-{uuid.uuid4().hex}"
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", "hunter2")
    run = tmp_path / "run"
    run.mkdir()
    before = sorted(p.name for p in Path.home().iterdir())
    completion = f"Here it is:\n```python\n{program(attack, str(run), str(Path.home()), port, marker)}```"

    t0 = time.perf_counter()
    rewards = code_reward(["p"], [completion], [["assert True"]])
    seconds = time.perf_counter() - t0
    counts = code_reward.pop_counts()

    status, reward = EXPECTED[attack]
    assert rewards == [reward]
    assert counts[f"code_{status}"] == 1, counts
    assert seconds < TIMEOUT + MARGIN
    assert connections() == 0
    assert list(run.iterdir()) == []
    assert sorted(p.name for p in Path.home().iterdir()) == before
    time.sleep(0.2)  # the kernel reaps a PID namespace's processes asynchronously
    assert survivors(marker, sandboxed.label) == []


@pytest.mark.slow
def test_the_attacks_would_succeed_without_the_sandbox(listener, tmp_path, monkeypatch):
    """Controls: unsandboxed, the same programs read the secret, reach the listener and write the run directory."""
    port, connections = listener
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", "hunter2")
    for attack in ("read_trainer_env", "connect_listener", "write_run_dir"):
        code = program(attack, str(tmp_path), port=port)
        assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0, attack
    assert connections() == 1
    assert (tmp_path / "pwned.txt").read_text() == "pwned"


@needs_bwrap
def test_the_program_sees_no_home_no_etc_and_a_read_only_usr(sandboxed):
    interpreter = Path(sys.base_prefix)  # shown read-only; its parents exist inside, empty but for it
    hidden = [str(p) for p in Path.home().iterdir() if p not in interpreter.parents and p != interpreter]
    tests = (
        f"import os\nassert not any(os.path.exists(p) for p in {hidden!r})",
        "import os\nassert not os.path.exists('/etc/passwd')",
        "import os\nassert not os.access('/usr/bin', os.W_OK)",
        "import os\nassert os.getcwd() == '/sandbox' and os.listdir('.') == ['output.log']",
        "import os\nassert set(os.environ) <= {'PATH', 'HOME', 'LANG'}",
    )
    (out,) = sandboxed.run([Job("x = 1\n", tests=tests)])
    assert (out.status, out.passed) == ("passed", len(tests)), out.error


@needs_bwrap
def test_runs_of_a_pool_are_returned_in_order_and_reuse_no_directory(sandboxed):
    jobs = [Job(f"open('f', 'a').write('{i}')\nv = open('f').read()", tests=(f"assert v == '{i}'",)) for i in range(6)]
    outs = sandboxed.run(jobs)
    assert [o.status for o in outs] == ["passed"] * 6  # each saw a fresh, empty directory


@needs_bwrap
@pytest.mark.slow
def test_partial_credit_survives_a_timeout(sandboxed):
    tests = ("assert f(1) == 2", "assert f(2) == 3", "while True: pass", "assert f(3) == 4")
    (out,) = sandboxed.run([Job("def f(x):\n    return x + 1\n", tests=tests)])
    assert (out.status, out.passed, out.total) == ("timeout", 2, 4)


def test_unshare_isolation_has_no_network_and_no_survivors(listener, tmp_path):
    if not runner.available("unshare", os.path.realpath(sys.executable)):
        pytest.skip("unshare cannot make namespaces here")
    port, connections = listener
    marker = f"grpolab-attack-{uuid.uuid4().hex}"
    sandbox = Sandbox(LIMITS, workers=1, isolation="unshare")
    try:
        assert "filesystem is NOT hidden" in sandbox.describe()
        outs = sandbox.run(
            [
                Job(program("connect_listener", port=port), tests=("assert True",)),
                Job(program("daemon", marker=marker), tests=("assert True",)),
                Job(program("kill_parent"), tests=("assert True",)),
                Job("def f(x):\n    return 2 * x\n", tests=("assert f(2) == 4", "assert f(3) == 5")),
            ]
        )
    finally:
        sandbox.close()
    assert [o.status for o in outs[:2]] == ["failed", "passed"]
    # The harness is the PID namespace's init: its parent is outside it (getppid() = 0) and a kill from inside
    # does not reach it. What matters: this process, the runner, is alive to read the outcome.
    assert outs[2].status in ("crashed", "failed", "passed")
    assert (outs[3].passed, outs[3].total) == (1, 2)
    assert connections() == 0
    time.sleep(0.2)
    assert survivors(marker, sandbox.label) == []


def test_no_namespaces_refuses_unless_allowed(monkeypatch):
    monkeypatch.setattr(runner, "available", lambda isolation, python: False)
    with pytest.raises(SandboxError, match="--code-allow-network"):
        Sandbox(LIMITS, workers=1)
    sandbox = Sandbox(LIMITS, workers=1, allow_network=True)
    try:
        assert "NO namespaces" in sandbox.describe()
        (out,) = sandbox.run([Job(program("kill_parent"), tests=("assert True",))])
        assert out.status in ("crashed", "passed")  # it killed the interposed process, never this one
    finally:
        sandbox.close()


def test_a_command_of_the_users_own_runs_the_harness(tmp_path):
    """--sandbox-command: here a plain interpreter in the directory given as {dir}."""
    sandbox = Sandbox(LIMITS, workers=1, command=f"env -C {{dir}} {sys.executable} -I")
    try:
        assert "the command" in sandbox.describe()
        (out,) = sandbox.run([Job("def f(x):\n    return x\n", tests=("assert f(1) == 1", "assert f(1) == 2"))])
    finally:
        sandbox.close()
    assert (out.status, out.passed, out.total) == ("failed", 1, 2)


def test_a_payload_over_the_pipes_64_kib_to_a_harness_that_never_starts_is_a_timeout_on_the_clock():
    """The job (a 300 KiB program) is written to the harness's stdin on a thread of its own while the wall-clock
    timeout runs: a harness that never reads it (here a command that only sleeps) is killed at the timeout, which
    ends the write, instead of the write waiting for ever on a full pipe."""
    sandbox = Sandbox(Limits(timeout_s=2, cpu_s=3, memory_mb=512), workers=1, command="sh -c 'sleep 60' --")
    try:
        job = Job("x = 1\n" + "# padding\n" * 30000, tests=("assert x == 1",))
        t0 = time.monotonic()
        (out,) = within(30, lambda: sandbox.run([job]))
        assert out.status == "timeout" and time.monotonic() - t0 < 15
    finally:
        sandbox.close()


@needs_bwrap
@pytest.mark.slow
def test_the_attack_battery_inside_a_training_run(tmp_path, listener, monkeypatch):
    """One training step of the built-in model whose reward runs every attack (twice: groups of 2)."""
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import train

    port, connections = listener
    marker = f"grpolab-attack-{uuid.uuid4().hex}"
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", "hunter2")
    run = tmp_path / "run"
    names = sorted(ATTACKS)
    rows = [
        {"prompt": f"attack {a}", "attack": a, "run": str(run), "port": port, "marker": marker, "tests": ["assert 1"]}
        for a in names
    ]
    data = tmp_path / "attacks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:2]))  # 2 more rows: held out
    cfg = TrainConfig(
        data=str(data),
        eval_data=str(tmp_path / "held.jsonl"),
        reward_fn=("sandbox_attacks:attack_reward",),
        steps=1,
        prompts_per_step=len(names),
        group_size=2,
        micro_batch=len(names) * 2,
        reward_workers=2,
        code_timeout=TIMEOUT,
        code_memory_mb=512,
        sandbox="bwrap",
        eval_every=0,
        max_new_tokens=8,
        out=str(run),
        progress=False,
        threads=1,
        device="cpu",
        log_rollouts=True,
    )
    (tmp_path / "held.jsonl").write_text(json.dumps({**rows[0], "prompt": "held out"}) + "\n")
    t0 = time.perf_counter()
    train(cfg, log=lambda *a: None)
    seconds = time.perf_counter() - t0
    (m,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in line]
    drawn = [json.loads(line)["question"].removeprefix("attack ") for line in (run / "rollouts.jsonl").open()]
    assert len(drawn) == 2 * len(names)  # the sampler draws prompts at random: count what it drew
    assert {s: m[f"reward/code_{s}"] for s in runner.STATUSES} == {
        s: sum(EXPECTED[a][0] == s for a in drawn) for s in runner.STATUSES
    }
    assert m["reward/code_judged_inside"] == len(drawn)  # 'assert 1': judged inside, one test each
    assert m["reward/attack_reward"] == pytest.approx(sum(EXPECTED[a][1] for a in drawn) / len(drawn))
    # each timeout ends within TIMEOUT + MARGIN, 2 at a time: the step's rewards take no more than that allows
    timeouts = sum(EXPECTED[a][0] == "timeout" for a in drawn)
    assert m["time/score_s"] < (timeouts / 2 + 1) * (TIMEOUT + MARGIN)
    assert connections() == 0
    assert not list(run.rglob("pwned*"))
    time.sleep(0.2)
    assert survivors(marker, *AttackReward.labels) == []
    assert seconds < 120


@needs_bwrap
@pytest.mark.slow
def test_the_attack_battery_through_the_code_interpreter_tool(listener, tmp_path, monkeypatch):
    """Every attack as the model-written argument of ``grpolab.sandbox.tool:python``, called as a tool (in the tool
    worker, which runs it in its sandbox): the call answers within the sandbox's timeout, and nothing is harmed."""
    from grpolab.env.tools import ToolRunner

    port, connections = listener
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", "hunter2")
    monkeypatch.setenv("GRPOLAB_TOOL_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("GRPOLAB_TOOL_MEMORY_MB", "512")
    run = tmp_path / "run"
    run.mkdir()
    before = sorted(p.name for p in Path.home().iterdir())
    tools = ToolRunner(["grpolab.sandbox.tool:python"], timeout_s=TIMEOUT + 10, max_chars=2000)
    try:
        assert tools.call("python", {"code": "print(6 * 7)"}).text == "42\n"  # the tool works at all
        for attack in sorted(ATTACKS):
            marker = f"grpolab-attack-{uuid.uuid4().hex}"
            code = program(attack, str(run), str(Path.home()), port, marker)
            t0 = time.perf_counter()
            result = tools.call("python", {"code": code})
            assert not result.error, (attack, result)  # the tool itself returned: the sandbox ended the program
            assert time.perf_counter() - t0 < TIMEOUT + MARGIN + 1.0, attack
            assert "hunter2" not in result.text and len(result.text) < 2100, attack
            assert connections() == 0, attack
            assert list(run.iterdir()) == [], attack
            assert sorted(p.name for p in Path.home().iterdir()) == before, attack
            time.sleep(0.2)  # the kernel reaps a PID namespace's processes asynchronously
            assert survivors(marker) == [], attack
    finally:
        tools.close()
