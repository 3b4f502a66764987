"""Where the tests' things are: the repository, tests/ and its data files. Test files sit in subfolders of tests/
(tests/<package>/, tests/e2e/), so they name these from here rather than from their own path."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""tests/: on ``sys.path`` in the tests' processes (conftest.py), so that ``reward_fixtures:NAME`` and the like load."""
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
