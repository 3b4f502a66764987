"""Where the model and its tensors live: the ``--device`` flag and each process's device (what it computes in:
``grpolab.common.precision``).

Every tensor grpolab creates is created on the model's device (sampling streams, masks,
rewards, advantages), so the CPU and a GPU take one code path; the tests pass the device
explicitly. Under torchrun on CUDA, process ``LOCAL_RANK`` takes ``cuda:LOCAL_RANK``.
"""

from __future__ import annotations

import re

import torch

from grpolab.common.machine import machine


class DeviceError(ValueError):
    """A device that is malformed or not on this machine; the message says which."""


def parse_device(spec: str) -> str:
    """``spec`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; else :class:`DeviceError`."""
    if spec in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", spec or ""):
        return spec
    raise DeviceError(f"must be auto, cpu, cuda or cuda:N, got {spec!r}")


def resolve_device(spec: str, local_rank: int = 0, *, cuda_count: int | None = None) -> torch.device:
    """The device ``spec`` names on this machine, for the process of ``local_rank``.

    ``auto``: ``cuda:local_rank`` when torch sees a GPU, else the CPU. ``cuda``: ``cuda:local_rank``.
    ``cuda:N``: that GPU. A CUDA device torch cannot see is a :class:`DeviceError`.
    ``cuda_count`` overrides ``torch.cuda.device_count()`` (tests).
    """
    parse_device(spec)
    count = machine().cuda if cuda_count is None else cuda_count
    if spec == "cpu" or (spec == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise DeviceError(
            f"{spec}: torch sees no CUDA device here (torch {torch.__version__}, "
            f"{'a CPU-only build' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda}); use cpu or auto"
        )
    index = local_rank if spec in ("auto", "cuda") else int(spec.split(":")[1])
    if index >= count:
        raise DeviceError(f"{spec}: cuda:{index} asked for, but torch sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def prepare_device(device: torch.device) -> None:
    """Process-wide settings for running on ``device``, made when a model is loaded onto it.

    CUDA: PyTorch's cuDNN attention backend is turned off (its flash and memory-efficient backends remain). Sampling
    calls attention at a new shape every token (the cache grows, finished rows leave the batch, prompts change), and
    cuDNN's backend, which PyTorch picks for bf16, builds an execution plan per shape: on an H100 a bf16 step of the
    built-in demo took 1.9 s with it and 0.36 s without, the same rewards (fp32 took 0.31 s; docs/real-model.md).
    """
    if device.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
