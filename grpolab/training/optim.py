"""The optimizer a precision needs, its loss scaler, and the exact value of a weight it holds.

- ``32-true``, ``bf16-mixed``, ``16-mixed``, ``64-true``: torch's AdamW on the weights as they are held (fp32 masters
  under the mixed precisions: the update registers whatever the forward computes in).
- ``bf16-true``: torch-optimi's AdamW with Kahan summation (``--compensation kahan``). Each step adds the update to
  a bf16 compensation buffer, adds the buffer to the weight, and keeps in the buffer what the weight's rounding lost,
  so the weight's exact value is ``weight + compensation`` and no update is lost to rounding; the buffer is optimizer
  state (checkpointed with it). ``--compensation none``: torch's AdamW on the bf16 weights, which rounds away any
  change under half a bf16 spacing. A kept library rather than our own: torch-optimi is pure Python over torch's
  foreach kernels (and Triton where it is installed), so it installs on a CPU and on CUDA alike.
- ``16-mixed``: a gradient scaler (``torch.amp.GradScaler``) multiplies the loss before backward and divides the
  gradients after it; a step whose gradients overflow is skipped and the scale halved
  (:meth:`grpolab.training.update.Updater._optimizer_step`).
"""

from __future__ import annotations

import torch

from grpolab.common.precision import Precision


def build_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float, precision: Precision):
    """AdamW over ``params`` for ``precision`` (see the module docstring). torch's defaults otherwise (betas 0.9,
    0.999; eps 1e-8; decoupled weight decay ``lr * weight_decay`` a step), for either implementation."""
    if precision.kahan:
        from optimi import AdamW

        # foreach=None: optimi picks its foreach kernels where they run (and Triton on CUDA when it is installed)
        return AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, kahan_sum=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def build_scaler(precision: Precision, device: torch.device):
    """The loss scaler of a precision that needs one (fp16), else None. torch's own: under FSDP2 its check for
    overflow runs on the gradients' DTensors, which agree across ranks on whether any shard overflowed."""
    return torch.amp.GradScaler(device.type) if precision.scaled else None


def exact_weights(optimizer, param: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The first ``n`` (all: None) of ``param``'s entries, flattened, at their exact value in fp32: the weight itself,
    plus (Kahan summation) the compensation the optimizer holds for it, what the weight's rounding has not yet taken
    in. A DTensor gives this rank's shard."""
    local = param.to_local() if hasattr(param, "to_local") else param
    value = local.detach().reshape(-1)[:n].float()
    comp = optimizer.state.get(param, {}).get("kahan_comp") if optimizer is not None else None
    if comp is not None and comp.numel() > 1:  # optimi keeps a 1-element placeholder for fp32 weights
        comp = comp.to_local() if hasattr(comp, "to_local") else comp
        value = value + comp.detach().reshape(-1)[:n].float()
    return value
