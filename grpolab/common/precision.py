"""The precision a run trains in (``--precision``): the weights' dtype, the dtype their products are computed in,
and what keeps a low-precision update from rounding itself away.

Named as Lightning names them:

=============  ==================================  =====================================  ==========================
precision      weights and optimizer state         forward and backward                   what the update needs
=============  ==================================  =====================================  ==========================
``32-true``    fp32                                fp32                                   nothing
``bf16-mixed`` fp32 (master weights)               bf16 under ``torch.autocast``           nothing: fp32 masters
``16-mixed``   fp32 (master weights)               fp16 under ``torch.autocast``           a gradient scaler (CUDA)
``bf16-true``  bf16                                bf16                                   Kahan summation (or none)
``64-true``    fp64                                fp64                                   nothing (exactness checks)
=============  ==================================  =====================================  ==========================

Why fp32 masters: a bf16 weight does not move for a change smaller than half its spacing, about 2^-9 of its size,
and Adam moves a weight by about the learning rate a step; at GRPO's 1e-6 almost no bf16 weight moves at all
(docs/precision.md measures it). ``bf16-true`` keeps the weights in bf16 and compensates: torch-optimi's AdamW with
Kahan summation keeps each update's rounded-off part in a bf16 buffer and adds it back at the next step, so the
weight's exact value is ``weight + compensation``.

The log-probs, entropies and the loss are computed in fp32 from the head's output in every precision
(``grpolab.models.logprobs``): PyTorch's CPU autocast, unlike CUDA's, does not keep ``log_softmax`` in fp32.
``fp32_head``: the LM head's product itself in fp32 (ScaleRL; MiniMax-M1 Sec. 3.2): outside autocast, on fp32
inputs and weights.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from grpolab.common.errors import ConfigError
from grpolab.common.machine import machine

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")
COMPENSATIONS = ("kahan", "none")

_PARAM = {
    "32-true": torch.float32,
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
    "64-true": torch.float64,
}
_COMPUTE = {**_PARAM, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class PrecisionError(ConfigError):
    """A precision this device cannot run; the message says why and what to use (a ConfigError: one line)."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """A resolved ``--precision`` (never ``auto``) and its two companions."""

    name: str = "32-true"
    compensation: str = "kahan"
    """``bf16-true``'s optimizer: ``kahan`` (torch-optimi's AdamW with Kahan summation) or ``none`` (plain AdamW on
    bf16 weights: the update rounds away; kept to measure what that does). Read only under ``bf16-true``."""
    fp32_head: bool = False
    """The LM head's product in fp32 (trainer and grpolab's sampler)."""

    def __post_init__(self):
        if self.name not in _PARAM:
            raise PrecisionError(
                f"--precision must be one of {', '.join(PRECISIONS[1:])} once resolved, got {self.name!r}"
            )
        if self.compensation not in COMPENSATIONS:
            raise PrecisionError(f"--compensation must be one of {', '.join(COMPENSATIONS)}, got {self.compensation!r}")

    @property
    def param_dtype(self) -> torch.dtype:
        """The weights' (and the optimizer state's) dtype."""
        return _PARAM[self.name]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward's products: what a sampler that computes alike samples in."""
        return _COMPUTE[self.name]

    @property
    def head_fp32(self) -> bool:
        """Whether the LM head's product runs in fp32 where the rest computes in less (``fp32_head`` under a bf16 or
        fp16 precision; fp32 and fp64 heads already are)."""
        return self.fp32_head and self.compute_dtype in (torch.bfloat16, torch.float16)

    @property
    def mixed(self) -> bool:
        """Whether the forward runs under autocast (its products in :attr:`compute_dtype`, the weights another)."""
        return self.param_dtype != self.compute_dtype

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (fp16's range: a gradient scaler skips the steps that overflow)."""
        return self.compute_dtype == torch.float16

    @property
    def kahan(self) -> bool:
        """Whether the optimizer compensates its rounding (``bf16-true`` with Kahan summation)."""
        return self.name == "bf16-true" and self.compensation == "kahan"

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The context the forward runs in: autocast to :attr:`compute_dtype` under a mixed precision, else nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute_dtype)

    def describe(self, device: torch.device) -> str:
        """One line for the run's log: what is held in which dtype, and what runs the products."""
        name = str(self.param_dtype).removeprefix("torch.")
        text = f"precision {self.name}: weights and optimizer state in {name}"
        if self.mixed:
            text += f", forward and backward under {str(self.compute_dtype).removeprefix('torch.')} autocast"
        if self.compute_dtype == torch.bfloat16:
            text += f" ({bf16_units(device) or no_units_note()})"
        if self.scaled:
            text += ", loss scaled (steps that overflow are skipped and counted)"
        if self.name == "bf16-true":
            text += (
                ", Kahan-compensated AdamW"
                if self.kahan
                else ", plain AdamW (updates under half a bf16 spacing are lost)"
            )
        return text + (", LM head in fp32" if self.head_fp32 else "")


def bf16_units(device: torch.device) -> str:
    """What computes bf16 products on ``device``, in words ('' where nothing does natively): the machine probe's
    answer (:mod:`grpolab.common.machine`)."""
    return machine().bf16_units(device)


NO_UNITS_COST = 16
"""How many times 32-true's time a bf16 precision takes on a CPU without bf16 units, at the least: SmolLM2-135M's
forward and backward of 2 rows of 32 tokens under bf16-mixed, 15.7x 32-true's (bf16-true 16.0x), on a CPU with AVX512
held to AVX2 (``tools/as-cpu avx2 python benchmarks/bf16_cost.py --rows 2 --prompt 16 --completion 16``); one
256 x 576 x 1536 product alone, 40x. docs/precision.md has the figures."""


def no_units_note() -> str:
    """The line a bf16 run on a CPU without bf16 units gets: that it runs, how, and at what cost."""
    return (
        f"no bf16 units on this CPU: PyTorch converts each bf16 product's operands to fp32 and rounds the result to "
        f"bf16, the forward and backward {NO_UNITS_COST:g}x or more the time of --precision 32-true's"
    )


def auto_precision(device: torch.device, builtin: bool = False, given_dtype: torch.dtype | None = None) -> str:
    """What ``--precision auto`` is on ``device``: ``bf16-mixed`` on a CUDA device with bf16 (fp32 otherwise), and on
    the CPU ``32-true`` (docs/precision.md gives the measurements behind it). ``builtin``: the built-in 0.5 M-parameter
    model, fp32 everywhere (too small to gain). ``given_dtype``: a model object's own dtype, which auto keeps: an fp64
    one trains in ``64-true`` (exactness checks), a bf16 one in ``bf16-true`` (with Kahan summation) where the device
    computes bf16; an explicit precision converts the object in place."""
    if given_dtype == torch.float64:
        return "64-true"
    if given_dtype == torch.bfloat16 and bf16_units(device):
        return "bf16-true"
    if builtin:
        return "32-true"
    if device.type == "cuda":
        return "bf16-mixed" if bf16_units(device) else "32-true"
    return "32-true"


def resolve_precision(
    choice: str,
    device: torch.device,
    *,
    compensation: str = "kahan",
    fp32_head: bool = False,
    builtin: bool = False,
    given_dtype: torch.dtype | None = None,
) -> Precision:
    """``--precision`` on ``device``: ``auto`` resolved (:func:`auto_precision`), and a choice the device cannot run
    refused with a :class:`PrecisionError` (fp16 off CUDA; bf16 on a GPU without it). bf16 on a CPU without bf16
    units runs: PyTorch computes it through fp32 conversions, which :meth:`Precision.describe` says with its cost."""
    name = auto_precision(device, builtin, given_dtype) if choice == "auto" else choice
    precision = Precision(name, compensation, fp32_head)
    check_supported(precision, device)
    return precision


def machine_precision(machine, device: torch.device, model: str, given=None) -> Precision:
    """The precision a command's machine section asks for (``grpolab.config.run.MachineSection``: its --precision,
    --compensation and --fp32-head, the --dtype alias folded in) on ``device`` for ``model`` (``given``: the objects
    given to the Python API, where ``model`` may name one: its own dtype counts under auto)."""
    machine = machine.folded()
    live = given.lookup(model, "--model") if given is not None else None
    return resolve_precision(
        machine.precision,
        device,
        compensation=machine.compensation,
        fp32_head=machine.fp32_head,
        builtin=model == "builtin",
        given_dtype=next(live[0].parameters()).dtype if live is not None else None,
    )


def check_supported(precision: Precision, device: torch.device) -> None:
    """Refuse, in one line, a precision ``device`` cannot run. A CPU without bf16 units runs bf16 (slowly, said by
    :meth:`Precision.describe`): a laptop rehearses a GPU's bf16-mixed run with the same numerics."""
    low = {precision.param_dtype, precision.compute_dtype} - {torch.float32, torch.float64}
    if torch.float16 in low and device.type != "cuda":
        raise PrecisionError(
            f"--precision {precision.name}: fp16 with loss scaling runs on CUDA devices only (this run is on "
            f"{device.type}); use bf16-mixed or 32-true"
        )
    if torch.bfloat16 in low and device.type == "cuda" and not bf16_units(device):
        raise PrecisionError(f"--precision {precision.name}: this GPU does not support bf16; use 32-true or 16-mixed")


def rollout_dtype(choice: str, compute: torch.dtype) -> torch.dtype:
    """``--rollout-dtype``: the dtype the rollout engine samples in, for a trainer whose products compute in
    ``compute`` (:attr:`Precision.compute_dtype`). float32, bfloat16, float64: that dtype. auto: ``compute``, so that
    sampler and trainer compute alike (bf16 under bf16-mixed, fp32 under 32-true)."""
    if choice == "auto":
        return compute
    dtype = getattr(torch, choice, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"--rollout-dtype must be auto, float32, bfloat16 or float64, got {choice!r}")
    return dtype
