"""Many processes through torch.distributed: who this process is, its share of the work, reductions.

grpolab has no communication layer of its own. ``torchrun`` starts the processes and sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``; :func:`init` joins the process group;
gradients are reduced by ``DistributedDataParallel`` (or FSDP2's ``fully_shard``) and the few
things the drivers exchange (rewards, metric sums, probe results) go through
``all_reduce`` / ``all_gather_object``. Without torchrun every call here is a no-op on one
process, so the single-process code path is the same code.

Backend: collectives dispatch on the tensor's device, ``gloo`` for CPU tensors and ``nccl``
for CUDA tensors when the build has both (``"cpu:gloo,cuda:nccl"``); on a CPU-only build,
``gloo``.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from grpolab.common.machine import machine

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place among ``size`` processes (``size == 1``: no torch.distributed)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes metrics, samples and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def split(self, n: int) -> range:
        """This rank's contiguous block of ``range(n)``; the first ``n % size`` ranks get one more.

        Blocks in rank order concatenate to ``range(n)``, so gathered per-rank lists
        concatenate back into the single-process order.
        """
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


SINGLE = World()


BACKEND_ENV = "GRPOLAB_DIST_BACKEND"
"""An environment variable that names the backend instead: ``gloo`` for CUDA tensors too (where NCCL refuses two ranks
on one GPU; tools/gpu-check sets it), or ``nccl`` (CUDA tensors by NCCL, CPU tensors by gloo: the default on a GPU;
refused by a torch without NCCL). It applies to generator workers' weight groups as well."""


def forced_backend() -> str:
    """``$GRPOLAB_DIST_BACKEND`` when set (gloo or nccl), else ""."""
    name = os.environ.get(BACKEND_ENV, "")
    if name not in ("", "gloo", "nccl"):
        raise ValueError(f"${BACKEND_ENV} must be gloo or nccl, got {name!r}")
    if name == "nccl" and not dist.is_nccl_available():
        raise ValueError(f"${BACKEND_ENV}=nccl: this torch ({torch.__version__}) has no NCCL")
    return name


def backend(cuda_available: bool | None = None) -> str:
    """The process-group backend: gloo for CPU tensors, plus nccl for CUDA tensors when there is a GPU
    (``$GRPOLAB_DIST_BACKEND`` names one for both instead)."""
    forced = forced_backend()
    if forced:
        return "gloo" if forced == "gloo" else "cpu:gloo,cuda:nccl"
    if cuda_available is None:
        cuda_available = machine().gpu() and dist.is_nccl_available()
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def env_world_size() -> int:
    """The process count torchrun announces in the environment (1 outside a launch)."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


def init(device: str = "auto", timeout_s: float = 1800.0) -> World:
    """Join the process group torchrun describes in the environment; a single process without it.

    ``device`` (the ``--device`` flag): when it resolves to CUDA, this process takes ``cuda:LOCAL_RANK``
    (``cuda:N`` as given) as its current device before the group forms, so NCCL and the object
    collectives use this process's own GPU.
    """
    if env_world_size() == 1:
        return SINGLE
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    from grpolab.common.devices import resolve_device

    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend(), timeout=datetime.timedelta(seconds=timeout_s))
        # A script calling the Python API (grpolab.train under torchrun) keeps the group for its later calls; it is
        # left at exit, as torch asks. The CLI leaves it itself first (launch.processes), which makes this a no-op.
        atexit.register(shutdown)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local_rank)


def shutdown(synchronize: bool = False) -> None:
    """Leave the process group torchrun's launch formed. ``synchronize``: first wait until every rank is leaving too
    (a normal exit). A single process has none of its own (an in-process vLLM engine forms and leaves its own)."""
    if env_world_size() > 1 and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


def gather(obj, world: World) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (any picklable object)."""
    if not world.distributed:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def gather_concat(items: list, world: World) -> list:
    """Each rank's list, concatenated in rank order (with :meth:`World.split`: the single-process order)."""
    return [x for part in gather(items, world) for x in part]


def all_sum(values: list[float], world: World) -> list[float]:
    """Element-wise sum over ranks of a list of floats (float64)."""
    return _reduce_floats(values, dist.ReduceOp.SUM, world)


def all_max_floats(values: list[float], world: World) -> list[float]:
    """Element-wise largest value over ranks of a list of floats (float64), in one reduction."""
    return _reduce_floats(values, dist.ReduceOp.MAX, world)


def _reduce_floats(values: list[float], op, world: World) -> list[float]:
    if not world.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _reduce(value, op, world: World, dtype: torch.dtype = torch.int64):
    """``value`` reduced with ``op`` over ranks, as an int (int64) or a float (float64)."""
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=dtype)
    dist.all_reduce(t, op=op)
    return t.item()


def _reduce_int(value: int, op, world: World) -> int:
    return int(_reduce(value, op, world))


def all_max(value: int, world: World) -> int:
    return _reduce_int(value, dist.ReduceOp.MAX, world)


def all_max_float(value: float, world: World) -> float:
    """The largest ``value`` of any rank (float64)."""
    return float(_reduce(value, dist.ReduceOp.MAX, world, torch.float64))


def all_true(flag: bool, world: World) -> bool:
    """True only if ``flag`` holds on every rank."""
    return bool(_reduce_int(int(flag), dist.ReduceOp.MIN, world))


def on_main(call: Callable[[], T], world: World, failed_elsewhere: Callable[[], Exception]) -> T | None:
    """``call()`` on rank 0 alone (a checkpoint's save), every rank then told whether it succeeded: an error of any
    kind on rank 0 is raised there once the others know, and they raise ``failed_elsewhere()``. So no rank is left
    in its next collective for the group's timeout waiting for one that left. Returns ``call()``'s result on rank 0,
    None on the others."""
    result, error = None, None
    if world.is_main:
        try:
            result = call()
        except Exception as e:  # any kind: the other ranks must hear of it before this one leaves
            error = e
    if not all_true(error is None, world):
        raise error or failed_elsewhere()
    return result


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def gram(local: torch.Tensor, world: World) -> torch.Tensor:
    """``V V^T`` ``[M, M]`` of the row blocks ``local`` ``[m_rank, D]`` that the ranks hold, in rank order.

    Each rank's block is broadcast in turn and every rank forms its rows of the product, which
    are then gathered: a rank holds its own block and one other at a time, never all of V.
    """
    if not world.distributed:
        return local @ local.T
    sizes = gather(local.shape[0], world)
    row = []  # [m_rank, m_s] blocks of this rank's rows
    for src, m in enumerate(sizes):
        buf = local.contiguous() if src == world.rank else local.new_empty((m, local.shape[1]))
        dist.broadcast(buf, src=src)
        row.append(local @ buf.T)
    return torch.cat(gather(torch.cat(row, dim=1), world), dim=0)  # [M, M]
