"""--nproc 0: how many processes a run starts on this machine (grpolab.training.launch.auto_processes)."""

from __future__ import annotations

import pytest

from grpolab.config.train import TrainConfig
from grpolab.training.launch import AUTO_MIN_STEPS, auto_processes


def _auto(small: bool = True, cores: int = 2, accelerator: bool = False, **over) -> tuple[int, str]:
    return auto_processes(TrainConfig(**over).resolved(), small, cores=cores, accelerator=accelerator)


def test_the_builtin_model_on_a_cpu_takes_one_process_per_core():
    assert _auto()[0] == 2  # the defaults: 500 steps, 16 prompts, one thread
    assert _auto(cores=4)[0] == 4
    assert _auto(device="cpu", accelerator=True)[0] == 2  # a GPU present, the CPU asked for


def test_the_count_divides_the_prompts_and_passes_the_config_checks():
    assert _auto(cores=3)[0] == 2  # 16 prompts do not split over 3 processes: 2 do
    assert _auto(cores=4, prompts_per_step=6)[0] == 3
    n, why = _auto(cores=2, prompts_per_step=5)
    assert n == 1 and "--prompts-per-step 5" in why
    assert _auto(cores=4, minibatches=64)[0] == 2  # 4 processes' 32 rollouts each form no 64 minibatches
    assert _auto(cores=4, fsdp=True, probe_every=5)[0] == 1  # FSDP refuses the probe on several processes


@pytest.mark.parametrize(
    "over,why",
    [
        (dict(small=False), "larger"),
        (dict(accelerator=True), "device"),
        (dict(device="cuda"), "device"),
        (dict(threads=2), "--threads 2"),
        (dict(threads=0), "--threads 0"),
        (dict(steps=AUTO_MIN_STEPS - 1), "starts faster"),
        (dict(rollout_engine="vllm"), "outside"),
        (dict(max_staleness=1), "outside"),
        (dict(generators=1), "outside"),
        (dict(cores=1), "one core"),
    ],
)
def test_anything_else_runs_on_one_process_and_says_why(over, why):
    n, reason = _auto(**over)
    assert n == 1 and why in reason


def test_a_given_count_is_kept():
    assert _auto(nproc=1) == (1, "--nproc")
    assert _auto(nproc=3, small=False) == (3, "--nproc")
    assert _auto(steps=AUTO_MIN_STEPS)[0] == 2


class _Relaunched(Exception):
    pass


@pytest.fixture
def relaunch(monkeypatch):
    """Two cores, no GPU, and the relaunch under torchrun recorded instead of replacing this process."""
    import os

    from grpolab.commands.demo import CHOSEN, STARTED
    from grpolab.training import launch

    calls = []

    def record(nproc, argv):
        calls.append((nproc, argv))
        raise _Relaunched

    monkeypatch.setattr(launch, "relaunch_under_torchrun", record)
    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(launch, "has_accelerator", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yield calls
    for name in (CHOSEN, STARTED):  # what the demo hands its relaunched processes
        os.environ.pop(name, None)


def test_train_and_demo_relaunch_on_every_core_and_say_so(relaunch, tmp_path, capsys):
    from grpolab.commands.train_commands import cmd_demo, cmd_train

    out = str(tmp_path / "r")
    with pytest.raises(_Relaunched):
        cmd_train(["--out", out])
    with pytest.raises(_Relaunched):
        cmd_demo(["--out", out, "--seed", "1"])
    assert relaunch == [(2, ["train", "--out", out]), (2, ["demo", "--out", out, "--seed", "1"])]
    assert capsys.readouterr().err.count("--nproc 0: 2 processes, one per core (2 cores) (--nproc 1 runs one)") == 2
