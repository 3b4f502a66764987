"""A key/value cache for sampling that is allocated once and written in place: no copy per new token.

transformers' ``DynamicCache`` grows each layer's keys and values by concatenation, so every new token copies the
whole cache of every layer, and the copy grows with the completion. Here each layer's keys and values live in one
buffer ``[N, H_kv, P + T - 1, d]``, allocated when the prompts have been prefilled (P prompt positions, T new
tokens: the last token needs no forward). A decode step writes its token's keys and values at column L and
attention reads the view ``[:n, :, :L + 1]`` of the buffer: a strided view, which PyTorch's attention kernels take
as it is (measured: the same time as a contiguous tensor at 128 to 1,088 cached tokens, fp32).

Rows that finish are dropped by moving the last live rows into their slots (:meth:`SlabCache.drop`): only the
moved rows' caches are copied, and the live rows stay a prefix ``[:n]`` of the buffer, so every later step reads
views again. The order of the live rows changes; the sampler keeps the map from slot to row.

Why by hand: transformers' ``StaticCache`` preallocates too, but it returns the whole buffer to attention, which then
attends over every preallocated column under a mask (measured slower than the growing cache at these lengths), and
it has no way to drop finished rows. Only the plain full-attention layer is handled: a model whose own cache
(:func:`model_cache`, what transformers' ``generate`` builds from its config) has any other kind of layer (a sliding
window as in Gemma2, Cohere2 and GPT-OSS; a recurrent state as in Mamba and NemotronH) is sampled with that cache
instead (:func:`slab_reason`, :func:`slab_supported`).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class SlabLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer ``[N, H_kv, capacity, d]``; the first ``n`` rows and
    ``length`` columns are live."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buffer_k, self.buffer_v = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.length, self.n = length, keys.shape[0]
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:  # what transformers reads as "the cache so far": a view, never a copy
        return self.buffer_k[: self.n, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:  # DynamicLayer.__init__ sets None; the buffer is the storage
        pass

    @property
    def values(self) -> torch.Tensor:
        return self.buffer_v[: self.n, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the step's keys and values ``[n, H_kv, q, d]`` at the next ``q`` columns (cast to the buffer's
        dtype) and returns every live column as views ``[n, H_kv, length, d]``."""
        q, L = key_states.shape[-2], self.length
        if L + q > self.buffer_k.shape[2]:
            raise RuntimeError(f"decode cache full: {L} + {q} columns, room for {self.buffer_k.shape[2]}")
        self.buffer_k[: self.n, :, L : L + q].copy_(key_states)
        self.buffer_v[: self.n, :, L : L + q].copy_(value_states)
        self.length = L + q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.buffer_k.shape[2]


class SlabCache(Cache):
    """Every layer's :class:`SlabLayer`; ``n`` live rows, ``length`` live columns, shared by all layers."""

    def __init__(self, layers: list[SlabLayer]):
        super().__init__(layers=layers)

    @classmethod
    def from_prefill(
        cls,
        prefill: Cache,
        rows: torch.Tensor,
        capacity: int,
        dtype: torch.dtype | None = None,
        rounding: torch.dtype | None = None,
    ) -> SlabCache:
        """The slab of N rows whose row i starts as row ``rows[i]`` of ``prefill``'s keys and values (the distinct
        prompts' caches ``[U, H_kv, P, d]``; ``rows`` ``[N]`` in 0..U-1), with room for ``capacity`` columns in all.
        ``dtype``: the buffers' (default: the prefill's). ``rounding``: the prefill's keys and values rounded to that
        dtype's precision as they are copied (a copy whose attention rounds as autocast's,
        ``grpolab.models.attention``)."""
        layers = []
        for layer in prefill.layers:
            k, v = layer.keys, layer.values  # [U, H_kv, P, d]
            U, H, P, d = k.shape
            shape = (rows.shape[0], H, capacity, d)
            buf_k = torch.empty(shape, dtype=dtype or k.dtype, device=k.device)  # untouched columns: never read
            buf_v = torch.empty((*shape[:3], v.shape[-1]), dtype=dtype or v.dtype, device=v.device)
            buf_k[:, :, :P] = k[rows] if rounding is None else k[rows].to(rounding)
            buf_v[:, :, :P] = v[rows] if rounding is None else v[rows].to(rounding)
            layers.append(SlabLayer(buf_k, buf_v, P))
        return cls(layers)

    @property
    def n(self) -> int:
        return self.layers[0].n

    def drop(self, done: torch.Tensor) -> torch.Tensor:
        """Drops the live rows where ``done`` ``[n]`` (bool) is true. The kept rows become slots ``0..n' - 1``: those
        already there stay, the last kept ones move into the holes (only their caches are copied). Returns ``order``
        ``[n']``: new slot j holds what old slot ``order[j]`` held (index every per-row tensor with it)."""
        n = self.n
        kept = (~done).nonzero().squeeze(1)  # [n'] ascending
        m = kept.numel()
        order = torch.arange(m, device=done.device)
        holes = done[:m].nonzero().squeeze(1)  # slots < n' that finished
        movers = kept[kept >= m]  # kept rows beyond the new end, as many as the holes
        order[holes] = movers
        if holes.numel():
            for layer in self.layers:
                L = layer.length
                layer.buffer_k[holes, :, :L] = layer.buffer_k[movers, :, :L]  # [h, H_kv, L, d]
                layer.buffer_v[holes, :, :L] = layer.buffer_v[movers, :, :L]
        for layer in self.layers:
            layer.n = m
        assert m <= n
        return order


def slab_supported(prefill: Cache) -> bool:
    """Whether a prefill's cache is made of plain full-attention layers only, the kind a :class:`SlabCache` holds
    (a model that wrote nothing into it, or other kinds of layer, samples with transformers' own cache)."""
    layers = getattr(prefill, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)


def model_cache(model) -> DynamicCache:
    """An empty cache of the kind transformers' own ``generate`` gives ``model`` (a transformers model, or a peft
    wrapper of one): ``DynamicCache(config=...)``, one layer per decoder layer as the config's layer types say (full
    attention, a sliding window, a recurrent state). A bare ``DynamicCache()`` would make every layer full attention,
    which a hybrid model's recurrent layers cannot write into."""
    return DynamicCache(config=model.config)


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache under: ``cache_params`` for Mamba's family (which has no
    ``past_key_values``), else ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's forward takes **kwargs
    params = inspect.signature(base.forward).parameters
    return "cache_params" if "cache_params" in params and "past_key_values" not in params else "past_key_values"


def slab_reason(model) -> str | None:
    """None if a :class:`SlabCache` holds ``model``'s cache exactly: every layer of its own cache
    (:func:`model_cache`) is a plain full-attention ``DynamicLayer``, whose keys and values the slab stores as they
    are. Else why not, naming the other kinds (``DynamicSlidingWindowLayer`` keeps only the window's keys, a
    ``LinearAttentionLayer`` a recurrent state, not keys)."""
    others = sorted({type(layer).__name__ for layer in model_cache(model).layers if type(layer) is not DynamicLayer})
    return f"its cache has {', '.join(others)} layers" if others else None
