"""Shared fixtures for the grpolab test suite.

Tiers: unit tests compare against hand-computed values,
statistical tests use fixed seeds and tolerances a wrong implementation fails,
smoke tests run the trainer / CLI end to end on the shipped built-in model.
A test is marked ``slow`` where it is written (``@pytest.mark.slow``, or ``pytestmark`` for a whole module) when it
starts processes (torchrun, the ``grpolab`` command, an engine), loads SmolLM2 or runs long;
``pytest -m "not slow"`` (``make test-fast``) skips them, ``make test`` runs every tier.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Before torch is imported anywhere: idle OpenMP workers must not spin on a shared 2-core CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The vllm engine's KV cache (GiB, whole numbers only): the tests' models are tiny.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# grpolab's cache (the dequantised GGUF checkpoints, the demo's warm starts): empty at the start of each run of the
# suite, never the user's, and shared by the test workers (they inherit it): the first test that loads SmolLM2
# converts its GGUF file, the others read the conversion.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["GRPOLAB_CACHE"] = tempfile.mkdtemp(prefix="grpolab-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GRPOLAB_CACHE"], True)

import subprocess  # noqa: E402

import pytest  # noqa: E402

from grpolab.common.startup import import_libraries  # noqa: E402

import_libraries(("torch",))  # with the collector paused (grpolab.common.startup); transformers in pytest_configure
import torch  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = TESTS_DIR / "fixtures"
# Make helper modules in tests/ (e.g. reward_fixtures) importable as 'module:function'.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

torch.set_num_threads(1)  # small tensors: one thread is fastest and leaves the other core alone


def pytest_configure(config):
    """A process that runs tests (an xdist worker, or pytest without -n) imports transformers' model classes too with
    the collector paused, before its collection imports them; xdist's controller, which only hands out the tests,
    does not import them at all."""
    controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if not controller:
        import_libraries()


def long_files_first(items: list) -> None:
    """Order ``items`` file by file: the files holding a test marked ``long`` first, then the rest by their number of
    tests, most first (pytest-xdist's own order under --dist loadfile, which `make test` turns off with
    --no-loadscope-reorder for this one). A worker takes a whole file at a time; a long test in a file of few tests
    came last, and one worker ran it alone at the suite's end while the other had finished."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(files.values(), key=lambda f: (not any(i.get_closest_marker("long") for i in f), -len(f)))
    items[:] = [item for f in ordered for item in f]


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """The long tests' files first (:func:`long_files_first`). Where tests that load SmolLM2 are selected,
    dequantise its GGUF file into the suite's cache in a background process from the start (one process of the
    session: the first test worker, or the only one). The conversion takes about 10 s of CPU whoever does it;
    done first it runs beside other tests instead of keeping the test workers that need SmolLM2 waiting on its lock.
    Should it fail, the first of those tests converts the file."""
    long_files_first(items)
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not any(i.get_closest_marker("smollm2") for i in items):
        return
    code = (
        "from grpolab.models.loading import SMOLLM2, convert_gguf, resolve_gguf\n"
        "convert_gguf(*resolve_gguf(SMOLLM2, '')[:2])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(proc.kill)  # a session that ends first (-x, Ctrl-C) leaves no converter running


# A test still running after this many seconds has every thread's stack written to a file of its worker's, before
# pytest-timeout (pyproject.toml: 600 s) ends it; the session's summary prints those files. pytest-timeout's own dump
# goes through pytest's capture, which a pytest-xdist worker it ends never hands back: the suite would say only that a
# worker crashed, not where its test hung.
HANG_REPORT_S = 540
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["GRPOLAB_TEST_HANGS"] = tempfile.mkdtemp(prefix="grpolab-test-hangs-")
    atexit.register(shutil.rmtree, os.environ["GRPOLAB_TEST_HANGS"], True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(os.environ["GRPOLAB_TEST_HANGS"]) / f"{worker}.txt", "a") as report:
        report.write(f"{item.nodeid} ran past {HANG_REPORT_S} s:\n")
        report.flush()
        faulthandler.dump_traceback_later(HANG_REPORT_S, exit=False, file=report)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            report.truncate(0)  # it ended in time: nothing to report


def pytest_terminal_summary(terminalreporter):
    """The stacks of any test that ran past HANG_REPORT_S (a worker's file is empty unless one did)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    for path in sorted(Path(os.environ["GRPOLAB_TEST_HANGS"]).glob("*.txt")):
        text = path.read_text()
        if "Thread" in text or "Stack" in text:
            terminalreporter.section(f"a test that hung ({path.stem})")
            terminalreporter.write_line(text[-20000:])


# ---------------------------------------------------------------- the machine a test runs on
# A test whose outcome rests on the hardware (bf16 units, what --precision auto picks, a bf16 sampler copy) is marked
# `hardware` and runs as the machine is, passing on both kinds (`make test` runs the `hardware` tests a second time as
# the other kind), or sets the machine probe (grpolab.common.machine) with `machine_kind` (or GRPOLAB_BF16_UNITS in
# the environment of a process it starts), saying which machine it assumes. Every question about bf16 units that the
# machine's own answer settled while a test's body ran, in its process or a process it started, is counted
# (GRPOLAB_PROBE_LOG); an unmarked test that asked one fails, so that no test assumes the developer's CPU unsaid.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["GRPOLAB_PROBE_BASE"] = os.environ.get("GRPOLAB_BF16_UNITS", "")  # a test that changes it sets it
    os.environ["GRPOLAB_PROBE_LOGS"] = tempfile.mkdtemp(prefix="grpolab-test-probe-")
    atexit.register(shutil.rmtree, os.environ["GRPOLAB_PROBE_LOGS"], True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    log = Path(os.environ["GRPOLAB_PROBE_LOGS"]) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"
    log.write_text("")
    os.environ["GRPOLAB_PROBE_LOG"] = str(log)
    try:
        result = yield
    finally:
        os.environ.pop("GRPOLAB_PROBE_LOG", None)
    if log.read_text().strip() and item.get_closest_marker("hardware") is None:
        pytest.fail(
            "this test asked the machine probe about bf16 units, so its outcome may rest on the CPU it runs on: set "
            "the probe with the machine_kind fixture, or mark it @pytest.mark.hardware and make it pass on both "
            "kinds (docs/testing.md)",
            pytrace=False,
        )
    return result


@pytest.fixture
def machine_kind(monkeypatch):
    """Sets the machine probe for one test: ``machine_kind(bf16=False)`` is a CPU without bf16 units (AVX2 alone),
    ``machine_kind(bf16=True)`` one with AMX and AVX512-BF16; ``cuda=1, cuda_bf16=...`` adds a GPU. The processes the
    test starts get the same answer about bf16 units (GRPOLAB_BF16_UNITS). Returns the
    :class:`grpolab.common.machine.Machine` set; the probe answers as the machine is again after the test."""
    import dataclasses

    from grpolab.common import machine as probe

    def set_kind(bf16: bool, *, cuda: int = 0, cuda_bf16: bool = False):
        units = ("AMX_BF16", "AVX512_BF16") if bf16 else ()
        kind = dataclasses.replace(
            probe.detect(), cpu_bf16=units, isa="AVX512" if bf16 else "AVX2", cuda=cuda,
            cuda_bf16=bool(cuda) and cuda_bf16, set_by="set by a test",
        )  # fmt: skip
        probe.set_machine(kind)
        monkeypatch.setenv(probe.ENV, "1" if bf16 else "0")
        monkeypatch.setenv("GRPOLAB_PROBE_SET", "1")
        return kind

    yield set_kind
    probe.set_machine(None)


@pytest.fixture(scope="session")
def char_tokenizer():
    from grpolab.models.builtin import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(char_tokenizer):
    """A randomly initialised 1-layer Llama (hidden 32), seeded, in eval mode."""
    from helpers.models import tiny_llama

    return tiny_llama(char_tokenizer, seed=1234)


@pytest.fixture(scope="session")
def gpt2_with_dropout(tmp_path_factory, char_tokenizer):
    """A random GPT-2 layout model with dropout 0.1 everywhere (the layout's default), as a local directory
    (heads of 32: the smallest vLLM's CPU attention takes)."""
    from helpers.models import gpt2

    ids = dict(bos_token_id=char_tokenizer.bos_token_id, eos_token_id=char_tokenizer.eos_token_id)
    model = gpt2(len(char_tokenizer), seed=0, dropout=0.1, n_embd=64, **ids)  # 0.1: GPT-2's own default
    path = tmp_path_factory.mktemp("gpt2-dropout")
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return str(path)
