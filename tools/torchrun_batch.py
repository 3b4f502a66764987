"""Run several ``grpolab`` commands one after another in each process of one torchrun launch (the tests' and
tools/gpu-check's; ``python tools/torchrun_batch.py COMMANDS.json`` runs them in one plain process the same way).

``python -m torch.distributed.run --standalone --nproc-per-node P tools/torchrun_batch.py COMMANDS.json``, the file a
JSON list of argument lists. Each command runs as ``torchrun -m grpolab ARGS`` runs it (``grpolab.commands.cli.run``
sees WORLD_SIZE and joins the process group), except that the group is kept for the next command, as a script of
Python API calls keeps it: the processes start, and import torch and transformers, once for the whole list instead of
once per command, seconds of CPU per command that the suite would otherwise spend starting interpreters.
A command that fails ends the launch with its exit status (torchrun then stops the other ranks).
"""

import json
import os
import sys

import torch.distributed as dist

from grpolab.commands.cli import run
from grpolab.common import distributed

leave = distributed.shutdown


def stay(synchronize: bool = False) -> None:
    """What the CLI's ``shutdown`` does at a command's end, without leaving the group: wait for every rank."""
    if synchronize and dist.is_initialized():
        dist.barrier()


def main() -> None:
    distributed.shutdown = stay
    for args in json.loads(open(sys.argv[1]).read()):
        print(f"=== grpolab {' '.join(args)}", flush=True)
        try:
            run(args)
        except SystemExit as e:
            if e.code not in (0, None):
                print(f"=== failed: exit status {e.code}", file=sys.stderr, flush=True)
                raise
    leave(synchronize=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as grpolab.commands.cli.main ends a torchrun worker


if __name__ == "__main__":  # a generator process (spawned) imports this module again as __mp_main__: not to run it
    main()
