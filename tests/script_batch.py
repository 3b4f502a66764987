"""Run several Python scripts one after another in this one process, each as ``python SCRIPT ARGS`` would (a test
helper).

``python tests/script_batch.py JOBS.json``, the file a JSON list of ``{"script", "argv", "log"}``. Each script runs as
``__main__`` with ``sys.argv`` set and its own directory first on ``sys.path`` (its sibling modules imported afresh);
its output, stdout and stderr together with any traceback, goes to its ``log``, and its exit status to ``log``
+ ``.status``. The process imports torch, transformers and TRL once for the whole list instead of once per script:
seconds of CPU per script that a suite would otherwise spend starting interpreters. A script that fails does not stop
the others.
"""

import contextlib
import json
import runpy
import sys
import traceback
from pathlib import Path


def run(script: str, argv: list[str], log: str) -> int:
    """Run ``script`` with ``argv``, its output to ``log``; its exit status."""
    here = str(Path(script).parent)
    siblings = {p.stem for p in Path(here).glob("*.py")}
    for name in siblings:  # a sibling module of the previous script (task.py) is not this one's
        sys.modules.pop(name, None)
    sys.argv, sys.path[:0] = [script, *argv], [here]
    status = 0
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
    sys.path.remove(here)
    return status


def main() -> None:
    for job in json.loads(Path(sys.argv[1]).read_text()):
        status = run(job["script"], job["argv"], job["log"])
        Path(job["log"] + ".status").write_text(str(status))


if __name__ == "__main__":
    main()
