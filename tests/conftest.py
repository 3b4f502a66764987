"""Shared fixtures for the grpolab test suite.

Tiers: unit tests compare against hand-computed values,
statistical tests use fixed seeds and tolerances a wrong implementation fails,
smoke tests run the trainer / CLI end to end on the shipped built-in model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before torch is imported anywhere: idle OpenMP workers must not spin on a shared 2-core CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
