"""A weight version as the positions and values that changed since the version the receiver holds: lossless.

A weight sync to a generator process or worker (:mod:`grpolab.rollout.generator`, :mod:`grpolab.rollout.remote`)
sends each stretch of a flat weight buffer (a bucket, or one weight's place in it) either whole or as the int32
positions whose bits changed and their new values, whichever is smaller (:func:`encode`); the receiver writes them
into its copy of the previous version (:func:`apply`) and builds its new version from the previous one plus those
positions (:func:`patched`). Positions are found by comparing bit patterns (floats viewed as integers of their
width), never values, so -0.0 against 0.0 and NaN payloads travel exactly, and the receiver's version is the
sender's bit for bit.

Written here: torch.distributed broadcasts whole tensors, and the deltas of a version are grpolab's bookkeeping.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

INDEX_BYTES = 4
"""A position's bytes on the wire (int32, relative to its stretch's start)."""
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Change(NamedTuple):
    """How one stretch of ``size`` values travels: ``indices`` [C] int32 positions relative to its start whose bits
    changed, and ``values`` [C] their new values (the stretch's dtype); ``indices`` None: whole, ``values``
    [size]. ``changed``: the count of positions whose bits changed (C, also when it travels whole)."""

    indices: torch.Tensor | None
    values: torch.Tensor
    changed: int
    size: int

    @property
    def full(self) -> bool:
        return self.indices is None

    @property
    def nbytes(self) -> int:
        """The bytes that travel: the values, and the positions of a delta."""
        index = 0 if self.indices is None else self.indices.numel() * INDEX_BYTES
        return index + self.values.numel() * self.values.element_size()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns: a view as the signed integer (uint8 for 1 byte) of its element's width."""
    return t.view(_BITS[t.element_size()])


def encode(prev: torch.Tensor, new: torch.Tensor) -> Change:
    """``new`` as a :class:`Change` from ``prev`` (both flat, of one dtype and length): the positions whose bits
    differ and the new values there, or the whole of ``new`` when the delta's bytes (positions and values) would be
    at least its own."""
    if prev.shape != new.shape or prev.dtype != new.dtype or new.dim() != 1:
        raise ValueError(f"a delta between {prev.dtype}{list(prev.shape)} and {new.dtype}{list(new.shape)}")
    if torch.equal(bits(prev), bits(new)):  # a stretch of frozen weights: no mask to build (the common case)
        return Change(torch.empty(0, dtype=torch.int32), new[:0], 0, new.numel())
    differs = bits(prev) != bits(new)  # [n]
    changed, size = int(differs.sum()), new.element_size()
    if changed * (INDEX_BYTES + size) >= new.numel() * size or new.numel() >= 1 << 31:
        return Change(None, new, changed, new.numel())  # counted first: no positions made for a whole stretch
    where = differs.nonzero().flatten()  # [C] increasing
    return Change(where.to(torch.int32), new[where], changed, new.numel())


def whole(new: torch.Tensor, changed: int | None = None) -> Change:
    """``new`` (flat) sent whole; ``changed`` (default: all) of its positions changed."""
    return Change(None, new, new.numel() if changed is None else changed, new.numel())


def apply(buffer: torch.Tensor, change: Change) -> None:
    """Write ``change`` into ``buffer`` (flat: the stretch it was encoded from, holding the previous values)."""
    if change.full:
        buffer.copy_(change.values)
    elif change.values.numel():
        buffer[change.indices] = change.values


class Span(NamedTuple):
    """The stretch ``[start, stop)`` of the flat buffer ``buffer`` (its dtype's name) whose positions ``indices``
    (int32 [C], relative to ``start``, increasing) changed; ``indices`` None: all of it."""

    buffer: str
    start: int
    stop: int
    indices: torch.Tensor | None


def span_of(buffer: str, start: int, change: Change) -> Span:
    """The span a :class:`Change` of the stretch at ``start`` of ``buffer`` covers: all of it when it travels whole,
    else up to its last changed position."""
    if change.full:
        return Span(buffer, start, start + change.values.numel(), None)
    last = int(change.indices[-1]) if change.indices.numel() else -1
    return Span(buffer, start, start + last + 1, change.indices)


def patched(prev: torch.Tensor, new: torch.Tensor, start: int, spans: list[Span]) -> torch.Tensor:
    """One weight's new version from its previous one: ``prev`` (flat, a version's own tensor) itself where
    ``spans`` (of its buffer, sorted by start, not overlapping) change nothing of ``[start, start + n)``; otherwise
    a copy of ``prev`` with the changed positions taken from ``new`` (the buffer's stretch that holds the new
    version), or a copy of ``new`` where a span took all of it or most of it changed. Equal to ``new`` bit for bit
    when the spans name every position at which ``new`` differs from ``prev``."""
    n = prev.numel()
    positions = []
    for i in range(bisect.bisect_right(spans, start, key=lambda s: s.stop), len(spans)):
        span = spans[i]
        if span.start >= start + n:
            break
        if span.indices is None:
            return new.clone()
        reach = (max(0, start - span.start), min(span.stop, start + n) - span.start)  # within the span: int32
        bounds = torch.tensor(reach, dtype=span.indices.dtype)
        lo, hi = torch.searchsorted(span.indices, bounds).tolist()
        positions.append(span.indices[lo:hi].to(torch.int64) + (span.start - start))  # relative to the weight
    count = sum(p.numel() for p in positions)
    if not count:
        return prev
    if 2 * count >= n:  # mostly changed: a copy of the new stretch is the cheaper one
        return new.clone()
    at = torch.cat(positions)
    out = prev.clone()
    out[at] = new[at]
    return out


def patched_weights(
    prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], layout: dict, spans: list[Span]
) -> dict[str, torch.Tensor]:
    """A version by name built from the previous one, ``prev``, and ``spans`` (:func:`patched` for each weight):
    ``new`` the views of the buffers that hold the new version, ``layout`` name -> (dtype, start, shape) in them (a
    tied weight, one place under several names, stays one tensor). A weight that did not change is ``prev``'s own
    tensor (a version is never written in place)."""
    by_buffer: dict[str, list[Span]] = {}
    for span in sorted(spans, key=lambda s: (s.buffer, s.start)):
        by_buffer.setdefault(span.buffer, []).append(span)
    made: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, (dtype, start, shape) in layout.items():
        key = (str(dtype), start)
        if key not in made:
            old = prev[name].view(-1)
            flat = patched(old, new[name].reshape(-1), start, by_buffer.get(str(dtype), []))
            made[key] = prev[name] if flat is old else flat.view(shape)
        out[name] = made[key]
    return out
