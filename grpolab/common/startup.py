"""A command's start: torch and transformers imported with Python's garbage collector paused.

Importing torch and transformers' model classes makes over half a million objects that the collector tracks, most of
them living as long as the process (after ``import grpolab.training.recipe``: 379,000 alive; 569,000 frozen by
:func:`import_libraries`, which collects nothing first). CPython 3.11 runs its collector by allocation counts, so the
import triggers full collections that walk every object made so far, again and again. Measured with
``gc.callbacks`` around ``import grpolab.training.recipe`` (one process, AVX512-BF16 Xeon): 7 full collections took
9.1 s of the import's 25.3 s of CPU; with the libraries imported first through :func:`import_libraries`, the
collections took 0.06 s and the import 11.4 s, and the process's peak memory rose 3 MB (the import's garbage, kept
frozen). Every ``grpolab`` process pays the import: each command, each torchrun rank, each generator worker, each
test worker. The collector is on again once the import is done, for the run itself.

Written here: no library offers it; Python's own ``gc`` module is the whole of it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import sys
from collections.abc import Iterator

__all__ = ["LIBRARIES", "collector_paused", "import_libraries"]

LIBRARIES = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")
"""What every command that loads a model imports first (the rest of grpolab's modules are small beside them)."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Inside the block Python's cyclic garbage collector does not run (reference counting still frees what it
    can); after it, the collector is as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def import_libraries(names: tuple[str, ...] = LIBRARIES) -> None:
    """Import ``names`` with the collector paused (:func:`collector_paused`), then freeze what exists: the modules,
    classes and functions live as long as the process, and a frozen object is never walked again by a collection
    (without the freeze, the first collections after the import walk all of them, and the gain is lost: measured).
    They are unfrozen at exit, so that the interpreter's own teardown collects them as it would have. Already
    imported names cost nothing, and a process freezes once for them: a second command in the same process
    (tools/torchrun_batch.py, a test calling the command line) leaves the collector to its objects."""
    if all(name in sys.modules for name in names):
        return
    with collector_paused():
        for name in names:
            importlib.import_module(name)
        gc.freeze()  # before the collector is back: its first collection would walk every object the import made
    atexit.register(gc.unfreeze)
