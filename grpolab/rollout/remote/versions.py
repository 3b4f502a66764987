"""The weight versions a generator worker may still be asked to draw with (:class:`HeldVersions`), kept on the
trainer's side so that a worker that joins late, or a resumed run, gets them, and each version after the first goes
to a worker as the delta from the one it holds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpolab.rollout.delta import Change, encode, whole
from grpolab.rollout.lora_merge import merged_served
from grpolab.rollout.remote.common import weight_buckets
from grpolab.rollout.replica import SharedWeights
from grpolab.rollout.weights import (
    held_state,
    held_version,
    product_weights,
    restored_held,
    sent_lora,
    served_weights,
)


class HeldVersions:
    """The newest K + 1 weight versions (K = --max-staleness), each as the flat buffers of one
    :class:`grpolab.rollout.replica.SharedWeights` layout, in ``send_dtype``. ``full_weights``: the context in which
    the policy's weights are whole (FSDP2's gather). ``lora_sync`` (--lora-sync): with a LoRA policy sent as its
    adapter (:attr:`lora`), the adapted layers' base weights and factors stay in the trainer's dtypes, and the
    workers merge them (into ``send_dtype``); ``device``: where the trainer merges them (a checkpoint's versions).
    ``product_dtype``: the dtype the sampler computes its products in, when it keeps ``send_dtype`` outside them
    (bf16 products beside fp32 norms and embeddings, as autocast computes): the weights it reads only in products
    (:func:`grpolab.rollout.weights.product_weights`) go in it, half the bytes, and bf16's coarser grid leaves more
    of them unchanged from one version to the next."""

    def __init__(
        self,
        model: torch.nn.Module,
        full_weights: Callable,
        send_dtype: torch.dtype,
        max_staleness: int,
        lora_sync: str = "merged",
        device: str = "cpu",
        product_dtype: torch.dtype | None = None,
        fp32_head: bool = False,
    ):
        self.model, self.full_weights, self.send_dtype = model, full_weights, send_dtype
        self.product_dtype = product_dtype or send_dtype
        self.products = product_weights(model, fp32_head) if product_dtype not in (None, send_dtype) else set()
        self.max_staleness, self.device = max_staleness, device
        self.lora, self.note = sent_lora(model, lora_sync, send_dtype)
        self._parts = set(self.lora) | {n for f in self.lora.values() for n in (f.a, f.b)}  # not cast
        self.merged: set[int] = set()
        """Versions whose buffers hold the LoRA layers merged (a checkpoint's: their factors are zeros)."""
        self._changes: dict[tuple[int, int], list[Change]] = {}
        self._free: list[dict] = []
        served = self.served()
        self.slot = SharedWeights(served, shared=False)
        self.slot.write(served)
        self.held = {0: self.copy()}

    def served(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the workers get them: on the CPU, floating ones in ``send_dtype`` (with
        :attr:`lora`, the adapted layers' base weights and factors in their own, the factors last)."""
        cast: dict[tuple, torch.Tensor] = {}  # a tied weight (the same memory under two names) stays one tensor
        with torch.no_grad(), self.full_weights():
            out = {}
            for n, t in served_weights(self.model, unmerged=bool(self.lora)):
                dtype = self.product_dtype if n in self.products else self.send_dtype
                dtype = dtype if t.is_floating_point() and n not in self._parts else t.dtype
                key = (t.data_ptr(), t.shape, t.dtype, dtype)
                if key not in cast:
                    cast[key] = t.detach().to("cpu", dtype)
                out[n] = cast[key]
        # the factors last: the layout keeps them together at the end of their buffer, in buckets of their own that
        # travel whole (every value moves), not scattered among the frozen base weights as 4-byte positions each
        factors = {n for f in self.lora.values() for n in (f.a, f.b)}
        return {n: t for n, t in out.items() if n not in factors} | {n: out[n] for n in out if n in factors}

    def copy(self) -> dict:
        """The slot's buffers now, by dtype."""
        return {d: b.clone() for d, b in self.slot.buffers.items()}

    def add(self, version: int) -> None:
        """Keep the policy's weights now as ``version``. Those no draw may ask for any more stay until
        :meth:`release`: the workers hold the version before, and take this one as the delta from it."""
        buffers = self._free.pop() if self._free else {d: torch.empty_like(b) for d, b in self.slot.buffers.items()}
        served = self.served()
        with torch.no_grad():
            for name, view in self.slot.views(buffers).items():
                view.copy_(served[name])
        self.held[version] = buffers  # written in place: a released version's buffers, not a copy of the slot's
        self._changes = {}

    @property
    def keep_from(self) -> int:
        """The oldest version a draw may still ask for."""
        return held_version(max(self.held), self.max_staleness)

    def release(self) -> None:
        """Let go of the versions no draw may ask for any more."""
        for v in [v for v in self.held if v < self.keep_from]:
            self._free = [self.held.pop(v)]  # the next version is written into them
            self.merged.discard(v)
        self._changes = {}

    def changes(self, base: int | None, version: int) -> list[Change]:
        """``version``'s buckets (:func:`grpolab.rollout.remote.common.weight_buckets`) as they go to a worker whose
        buffers hold version ``base``: each the delta from it, or whole when that is smaller or ``base`` is None."""
        pieces = weight_buckets(self.held[version])
        if base is None:
            return [whole(piece) for _, _, piece in pieces]
        if (base, version) not in self._changes:  # the same delta for every worker that holds base
            old = weight_buckets(self.held[base])
            self._changes[base, version] = [encode(o, p) for (_, _, o), (_, _, p) in zip(old, pieces)]
        return self._changes[base, version]

    def named(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s weights by parameter name, as served (LoRA's layers merged as the workers merge them)."""
        views = self.slot.views(self.held[version])
        served = merged_served(views, self.lora, self.device, merged=version in self.merged)
        return {n: t.clone() for n, t in served.items()}

    def held_state(self, syncs: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a checkpoint keeps of the versions in flight after ``syncs`` weight syncs."""
        held = held_version(syncs, self.max_staleness)
        pending = [(v, self.named(v)) for v in range(held + 1, syncs + 1)]
        return held_state(held, syncs, self.named(held), pending)

    def restore(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """The versions a checkpoint kept (:meth:`held_state`'s: served, LoRA's layers merged, which a worker then
        takes as they are)."""
        held, pending = restored_held(counts, tensors)
        views = self.slot.views()
        zeros = {n: torch.zeros_like(views[n]) for f in self.lora.values() for n in (f.a, f.b)}
        self.held, self.merged, self._changes = {}, set(), {}
        for version, named in [(counts["version"], held), *pending]:
            self.slot.write({**zeros, **named})
            self.held[version] = self.copy()
            if self.lora:
                self.merged.add(version)
