"""Linear layers whose weights are prepacked for oneDNN: the decode step's matrix products on the CPU.

A decode step multiplies a few rows (the live rollouts) by every weight matrix of the model. ATen's ``F.linear``
hands the CPU's BLAS the weight as it is stored, and at a few rows the product is far from the memory's speed:
SmolLM2's 211 weight matrices at 8 rows took 64.8 ms in fp32 and 26.4 ms in bf16 through ``F.linear``, and
23.1 ms and 14.7 ms with the weights reordered once into oneDNN's blocked layout (2 threads, this project's
AVX512-BF16 CPU; ``benchmarks/decode.py`` measures it again beside each run). The sampler's copy of the weights
(``grpolab.rollout.weights``) is rebuilt at every weight sync anyway, so reordering there costs nothing extra per
token (about 0.05 s for SmolLM2's 28 M-parameter head).

Why by hand: PyTorch reaches this kernel only through ``torch.compile``'s freezing, which bakes the weights into
the compiled graph and would recompile at every weight sync. The two operators used here
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``) are the ones freezing emits; where they are
missing or disagree with ``F.linear`` (:func:`packing_available` checks once), the plain layer stays.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from grpolab.common.machine import machine

BATCH_HINT = 8
"""Rows the packed layout is chosen for (any number of rows runs; the layout is tuned for about this many)."""
MIN_ELEMENTS = 2**16
"""The smallest weight worth packing. oneDNN's call costs about 11 us more than ``F.linear``'s, which pays only on
larger matrices: at 8 rows, one thread, 16.6 against 5.9 us for 128 x 128, 23.4 against 18.6 us for 256 x 256,
56.0 against 73.4 us for 512 x 512 (the built-in model's largest is 256 x 128: it keeps ``F.linear``)."""


def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here in ``dtype`` (fp32, or bf16 where the machine probe finds bf16
    units) and matches ``F.linear`` on a small product."""
    if dtype == torch.bfloat16 and not machine().bf16_units("cpu"):
        return False  # without bf16 units oneDNN's bf16 kernels are its reference loops: F.linear is faster
    return _packing_works(dtype)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((24, 40), (3, 40), (24,)))
        got = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT), b, "none", [], ""
        )
    except (RuntimeError, AttributeError):  # an operator this build of PyTorch lacks
        return False
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    return bool(torch.allclose(got.float(), nn.functional.linear(x, w, b).float(), rtol=tol, atol=tol))


def worth_packing(layer: nn.Module) -> bool:
    """Whether ``layer`` is an ``nn.Linear`` at least :data:`MIN_ELEMENTS` large."""
    return isinstance(layer, nn.Linear) and layer.weight.numel() >= MIN_ELEMENTS


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout (not a parameter: no gradient, not saved).

    ``x`` ``[..., in]`` -> ``[..., out]``, in the weight's dtype."""

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = self.bias = None
        if weight is not None:
            self.load(weight, bias)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Repacks the layer from ``weight`` ``[out, in]`` and ``bias`` ``[out]`` (already in the layer's dtype)."""
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # an input in another dtype (an fp32 residual stream into bf16 products) is cast, as autocast casts it
        return torch.ops.mkldnn._linear_pointwise(x.to(self.weight.dtype), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class PlainLinear(nn.Module):
    """``y = x W^T + b`` through ``F.linear``, with :class:`PackedLinear`'s ``load``: where packing does not run
    (another device or dtype), a fused product keeps the plain layout."""

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copies ``weight`` and ``bias`` (never a view of the policy's own: the copy moves only when it is loaded)."""
        self.weight = weight.detach().clone(memory_format=torch.contiguous_format)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)  # cast as PackedLinear does
