"""The weight versions a generator worker may still be asked to draw with (:class:`HeldVersions`), kept on the
trainer's side so that a worker that joins late, or a resumed run, gets them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpolab.rollout.replica import SharedWeights
from grpolab.rollout.weights import held_state, held_version, restored_held, served_weights


class HeldVersions:
    """The newest K + 1 weight versions (K = --max-staleness), each as the flat buffers of one
    :class:`grpolab.rollout.replica.SharedWeights` layout, in ``send_dtype``. ``full_weights``: the context in which
    the policy's weights are whole (FSDP2's gather)."""

    def __init__(self, model: torch.nn.Module, full_weights: Callable, send_dtype: torch.dtype, max_staleness: int):
        self.model, self.full_weights, self.send_dtype = model, full_weights, send_dtype
        self.max_staleness = max_staleness
        served = self.served()
        self.slot = SharedWeights(served, shared=False)
        self.slot.write(served)
        self.held = {0: self.copy()}

    def served(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the workers get them: on the CPU, floating ones in ``send_dtype``."""
        cast: dict[tuple, torch.Tensor] = {}  # a tied weight (the same memory under two names) stays one tensor
        with torch.no_grad(), self.full_weights():
            out = {}
            for n, t in served_weights(self.model):
                key = (t.data_ptr(), t.shape, t.dtype)
                if key not in cast:
                    cast[key] = t.detach().to("cpu", self.send_dtype if t.is_floating_point() else t.dtype)
                out[n] = cast[key]
            return out

    def copy(self) -> dict:
        """The slot's buffers now, by dtype."""
        return {d: b.clone() for d, b in self.slot.buffers.items()}

    def add(self, version: int) -> None:
        """Keep the policy's weights now as ``version``; let go of those no draw may ask for any more."""
        self.slot.write(self.served())
        self.held[version] = self.copy()
        keep_from = held_version(version, self.max_staleness)
        for v in [v for v in self.held if v < keep_from]:
            del self.held[v]

    def named(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s weights by parameter name."""
        return {n: t.clone() for n, t in self.slot.views(self.held[version]).items()}

    def held_state(self, syncs: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a checkpoint keeps of the versions in flight after ``syncs`` weight syncs."""
        held = held_version(syncs, self.max_staleness)
        pending = [(v, self.named(v)) for v in range(held + 1, syncs + 1)]
        return held_state(held, syncs, self.named(held), pending)

    def restore(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """The versions a checkpoint kept (:meth:`held_state`'s)."""
        held, pending = restored_held(counts, tensors)
        self.held = {}
        for version, named in [(counts["version"], held), *pending]:
            self.slot.write(named)
            self.held[version] = self.copy()
