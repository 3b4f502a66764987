"""A command's start (grpolab.common.startup): the libraries imported with the garbage collector paused, what exists
then frozen once per process, and the collector as it was afterwards."""

from __future__ import annotations

import gc
import sys

from grpolab.common.startup import collector_paused, import_libraries


def test_the_collector_is_paused_inside_and_as_it_was_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_the_libraries_are_imported_with_the_collector_paused_and_frozen_once(tmp_path, monkeypatch):
    (tmp_path / "grpolab_startup_probe.py").write_text(
        "import gc\nPAUSED = not gc.isenabled()\nMADE = [[] for _ in range(1000)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "grpolab_startup_probe", raising=False)
    before = gc.get_freeze_count()
    import_libraries(("grpolab_startup_probe",))
    try:
        assert sys.modules["grpolab_startup_probe"].PAUSED and gc.isenabled()
        frozen = gc.get_freeze_count()
        assert frozen >= before + 1000  # the module's objects are frozen: no collection walks them again
        made_since = [[] for _ in range(100)]  # a second freeze would take these too
        import_libraries(("grpolab_startup_probe",))  # imported already: nothing is frozen a second time
        # (frozen objects freed meanwhile, by this or another thread, only lower the count)
        assert gc.get_freeze_count() < frozen + len(made_since)
    finally:
        sys.modules.pop("grpolab_startup_probe", None)
