"""Reward functions used by the tests, importable as ``reward_fixtures:NAME``
(conftest.py puts tests/ on sys.path)."""

from __future__ import annotations


def always_raises(completions, records):
    """A broken reward function: raises on every call."""
    raise RuntimeError("reward server unavailable")


def constant_tenth(completions, records):
    """The same reward, 0.1, for every completion: no rollout is better than another."""
    return [0.1 for _ in completions]
