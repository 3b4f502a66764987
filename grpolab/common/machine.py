"""What this machine computes with: the one place grpolab asks about the hardware.

Every choice that depends on the hardware reads :func:`machine`: what ``--precision auto`` picks, what a bf16
precision costs and says, whether the sampler's copy packs bf16 weights for oneDNN, the drop-in's ``bf16=True``, a
reward model's dtype on a GPU. Nothing else asks torch what the CPU or the GPU can do.

What it answers:

- ``arch``: the processor's architecture (``x86_64``, ``aarch64``);
- ``isa``: the instruction set ATen's CPU kernels dispatch to (``AVX512``, ``AVX2``, ``DEFAULT``; on aarch64
  ``SVE256`` and the like), as ``torch.backends.cpu.get_cpu_capability()`` reports it;
- ``cpu_bf16``: the CPU's bf16 units that oneDNN computes bf16 products with (``AMX_BF16``, ``AVX512_BF16``; on
  aarch64 the flags torch reports there), empty where it has none: there PyTorch still computes bf16, converting
  each product's operands to fp32 and back, at a cost (docs/precision.md measures it);
- ``cuda``: how many CUDA devices there are, and ``cuda_bf16``, whether they compute bf16.

Tests and rehearsals set it. ``GRPOLAB_BF16_UNITS=0`` hides the CPU's bf16 units (the branch a CPU without them
takes), ``=1`` claims them (the branch a CPU with AVX512-BF16 or AMX takes). With ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2`` beside ``GRPOLAB_BF16_UNITS=0``, a CPU with AVX512 and bf16 units computes as one with
AVX2 alone (docs/testing.md). In-process, :func:`set_machine` replaces the answer (the suite's ``machine_kind``
fixture).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform

import torch

ENV = "GRPOLAB_BF16_UNITS"
"""The environment variable that sets the probe's answer about the CPU's bf16 units (0: none, 1: present)."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """The hardware a process runs on, as torch reports it (or as a test set it)."""

    arch: str
    """``platform.machine()``: x86_64, aarch64, arm64."""
    isa: str
    """The instruction set ATen's CPU kernels dispatch to: AVX512, AVX2, DEFAULT, SVE256, ..."""
    cpu_bf16: tuple[str, ...]
    """The CPU's bf16 units oneDNN uses (AMX_BF16, AVX512_BF16, or what aarch64 reports); () where it has none."""
    cuda: int = 0
    """How many CUDA devices torch sees (counted without initialising CUDA: a process that forks stays able to)."""
    cuda_bf16: bool | None = None
    """Whether the CUDA devices compute bf16 (Ampere and later); None: torch is asked when a question needs it (that
    initialises CUDA in this process)."""
    set_by: str = ""
    """Who set the answer about bf16 units where torch did not give it: ``GRPOLAB_BF16_UNITS=0``, a test."""
    held_to: str = ""
    """The instruction sets the environment holds torch's kernels to (``ATEN_CPU_CAPABILITY``,
    ``ONEDNN_MAX_CPU_ISA``: ``tools/as-cpu avx2``), '' where none: an emulated kind of CPU. Libraries that read the
    CPU's own flags (vLLM's CPU kernels) are not held back, and may fail under it."""

    def bf16_units(self, device: torch.device | str) -> str:
        """What computes bf16 products on ``device``, in words ('' where nothing does natively)."""
        _consulted()
        device = torch.device(device)
        if device.type == "cuda":
            bf16 = torch.cuda.is_bf16_supported() if self.cuda_bf16 is None else self.cuda_bf16
            if not bf16:
                return ""
            return torch.cuda.get_device_name(device) if self.cuda_bf16 is None else "CUDA with bf16"
        if device.type != "cpu" or not self.cpu_bf16:
            return ""
        return f"CPU with {', '.join(self.cpu_bf16)}"

    def gpu(self) -> bool:
        """Whether a CUDA device is there (not counted as a question about bf16: the suite runs without one)."""
        return bool(self.cuda)

    def describe(self) -> str:
        """One line: the architecture, ATen's ISA, the bf16 units and the GPUs (``grpolab doctor`` and logs)."""
        units = ", ".join(self.cpu_bf16) if self.cpu_bf16 else "no bf16 units"
        text = f"{self.arch}, ATen {self.isa}, {units}" + (f" ({self.set_by})" if self.set_by else "")
        text += f", held to {self.held_to}" if self.held_to else ""
        if self.cuda:
            text += f"; {self.cuda} CUDA device{'s' if self.cuda > 1 else ''}"
            text += {None: "", True: " with bf16", False: " without bf16"}[self.cuda_bf16]
        return text


def detect() -> Machine:
    """What torch reports of this process's machine, with ``GRPOLAB_BF16_UNITS`` applied (uncached)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    units: tuple[str, ...] = ()
    # oneDNN's own answer: it honours ONEDNN_MAX_CPU_ISA, which the flags of the CPU do not
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        units = tuple(k.upper() for k in sorted(caps) if "bf16" in k and caps[k] is True) or ("bf16 units",)
    set_by = ""
    given = os.environ.get(ENV, "").strip()
    if given in ("0", "1"):
        units = () if given == "0" else (units or ("bf16 units",))
        set_by = f"{ENV}={given}"
    elif given:
        raise ValueError(f"{ENV} must be 0 (no bf16 units) or 1 (bf16 units), got {given!r}")
    cuda = torch.cuda.device_count()
    return Machine(
        arch=platform.machine() or "unknown",
        isa=torch.backends.cpu.get_cpu_capability(),
        cpu_bf16=units,
        cuda=cuda,
        cuda_bf16=None if cuda else False,
        set_by=set_by,
        held_to=" ".join(
            f"{k}={os.environ[k]}"
            for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if os.environ.get(k)
        ),
    )


_SET: list[Machine] = []


@functools.cache
def _detected() -> Machine:
    return detect()


def machine() -> Machine:
    """This process's machine: :func:`detect`'s answer, read once, or what :func:`set_machine` put in its place."""
    return _SET[-1] if _SET else _detected()


def set_machine(probe: Machine | None) -> None:
    """Answer :func:`machine` with ``probe`` from now on (None: torch's own answer again)."""
    _SET.clear()
    if probe is not None:
        _SET.append(probe)


# The suite checks that a test whose outcome rests on the hardware says so (tests/conftest.py). A question about bf16
# units that torch's own answer settled is written to the file GRPOLAB_PROBE_LOG names while a test runs: the test's
# own process and the processes it starts alike. One a test settled (set_machine; GRPOLAB_PROBE_SET, or a
# GRPOLAB_BF16_UNITS other than the suite's own, GRPOLAB_PROBE_BASE, in a process it started) is not: that test said
# which machine it assumes.


def _consulted() -> None:
    log = os.environ.get("GRPOLAB_PROBE_LOG")
    base = os.environ.get("GRPOLAB_PROBE_BASE", os.environ.get(ENV, ""))
    if not log or _SET or os.environ.get("GRPOLAB_PROBE_SET") or os.environ.get(ENV, "") != base:
        return
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
