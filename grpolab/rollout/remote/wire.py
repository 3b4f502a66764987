"""Frames on a generator worker's connection: plain data as JSON, tensors as raw bytes, never pickle.

A frame::

    b"GRPL"          4 bytes: the magic
    header length    4 bytes, big-endian, at most ``MAX_HEADER``
    header           a UTF-8 JSON object; its "tensors" entry, [[dtype, [d0, d1, ...]], ...], describes the payload
    payload          each tensor's bytes in that order (C-contiguous, the machine's byte order: both ends are
                     little-endian x86-64 or aarch64, and the handshake checks it)

:func:`recv_frame` checks the magic, the header's length, that it is a JSON object, every dtype against
:data:`DTYPES` and every shape, and that the payload's total size is within its limit, all before it reads one byte
of the payload; anything else is a :class:`WireError`, and the connection is not read further. A connection that
sends nothing is cut by the socket's timeout. So a stranger can neither run code (JSON builds no objects), nor make
the trainer allocate more than the limits, nor block it past the timeout.

Written by hand: torch.distributed's RPC and its object collectives pickle, and the rest of a message's life (its
tags, the draws' versions) is grpolab's own bookkeeping (:mod:`grpolab.rollout.generator`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import sys

import torch

from grpolab.common.errors import GeneratorError

__all__ = [
    "DTYPES",
    "MAX_HEADER",
    "PROTOCOL",
    "WireError",
    "answer_challenge",
    "challenge",
    "check_answer",
    "recv_frame",
    "send_frame",
]

MAGIC = b"GRPL"
PROTOCOL = 2
"""The protocol's version: a worker and a trainer of another version refuse each other in the handshake (2: weight
syncs as deltas)."""
MAX_HEADER = 1 << 20
"""A header's largest size in bytes (1 MiB: a draw's prompts and keys as JSON, 64 rows of 4k tokens, fit)."""
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
}
"""The tensor dtypes a frame may carry."""
_LENGTH = struct.Struct(">I")


class WireError(GeneratorError):
    """A malformed frame, or a peer that is not a grpolab generator of this run."""


def send_frame(sock: socket.socket, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    """Send ``header`` (JSON-serialisable, no "tensors" key) and ``tensors`` as one frame."""
    tensors = [t.detach().cpu().contiguous() for t in tensors]
    for t in tensors:
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise WireError(f"a frame cannot carry {t.dtype}")
    head = dict(header, tensors=[[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors])
    blob = json.dumps(head, separators=(",", ":")).encode()
    if len(blob) > MAX_HEADER:
        raise WireError(f"a header of {len(blob)} bytes is over the limit of {MAX_HEADER}")
    sock.sendall(MAGIC + _LENGTH.pack(len(blob)) + blob)
    for t in tensors:
        if t.numel():
            # bf16 has no numpy dtype: its bytes go through an int16 view of the same storage
            raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            sock.sendall(memoryview(raw.numpy()).cast("B"))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection ({got} of {n} bytes read)")
        got += k
    return buf


def recv_frame(sock: socket.socket, max_payload: int) -> tuple[dict, list[torch.Tensor]]:
    """One frame: its header (without "tensors") and its tensors. At most ``max_payload`` bytes of tensors."""
    prefix = bytes(_recv_exact(sock, 8))
    if prefix[:4] != MAGIC:
        raise WireError(f"not a grpolab frame (it starts {prefix[:4]!r})")
    (length,) = _LENGTH.unpack(prefix[4:])
    if length > MAX_HEADER:
        raise WireError(f"a header of {length} bytes is over the limit of {MAX_HEADER}")
    try:
        header = json.loads(bytes(_recv_exact(sock, length)).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"a header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WireError("a header that is not a JSON object")
    described = header.pop("tensors", [])
    shapes: list[tuple[torch.dtype, list[int]]] = []
    total = 0
    try:
        for name, shape in described:
            if name not in DTYPES or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
                raise ValueError
            dtype = DTYPES[name]
            numel = 1
            for d in shape:
                numel *= d
            total += numel * dtype.itemsize
            shapes.append((dtype, shape))
    except (TypeError, ValueError):
        raise WireError(f"a payload described as {str(described)[:200]}") from None
    if total > max_payload:
        raise WireError(f"a payload of {total} bytes is over the limit of {max_payload}")
    tensors = []
    for dtype, shape in shapes:
        raw = _recv_exact(sock, _numel(shape) * dtype.itemsize)
        if dtype == torch.bfloat16:
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16) if raw else torch.empty(0, dtype=dtype)
        else:
            t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors.append(t.reshape(shape))
    return header, tensors


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------- the handshake
def _mac(token: bytes, nonce: str, run: str) -> str:
    return hmac.new(token, f"{nonce}:{run}".encode(), hashlib.sha256).hexdigest()


def challenge(run: str) -> dict:
    """The trainer's first frame to a new connection: the protocol, its run id, and a fresh nonce to answer."""
    return {
        "kind": "challenge",
        "protocol": PROTOCOL,
        "run": run,
        "nonce": secrets.token_hex(16),
        "order": sys.byteorder,
    }


def answer_challenge(frame: dict, token: bytes, run: str | None, about: dict) -> dict:
    """The worker's answer to :func:`challenge`'s frame: an HMAC of the nonce and the run id under the shared
    ``token`` (b"" when none is set: a trainer listening on localhost only), and ``about`` (its device, engine,
    dtype, threads). ``run``: the run the worker was told to join (None: whichever it reaches)."""
    if frame.get("kind") != "challenge":
        raise WireError(f"the trainer's first frame is {frame.get('kind')!r}, not a challenge")
    if frame.get("protocol") != PROTOCOL:
        raise WireError(f"the trainer speaks protocol {frame.get('protocol')!r}, this worker {PROTOCOL}")
    if frame.get("order") != sys.byteorder:
        raise WireError(f"the trainer is {frame.get('order')}-endian, this worker {sys.byteorder}-endian")
    if run is not None and frame.get("run") != run:
        raise WireError(f"the trainer runs {frame.get('run')!r}, not {run!r}")
    mac = _mac(token, str(frame.get("nonce")), str(frame.get("run")))
    return {"kind": "hello", "protocol": PROTOCOL, "run": frame.get("run"), "mac": mac, "about": about}


def check_answer(sent: dict, frame: dict, token: bytes) -> dict:
    """The trainer's check of a worker's answer to ``sent`` (:func:`challenge`'s frame); returns what the worker
    says about itself, or raises :class:`WireError` saying why it is refused."""
    if frame.get("kind") != "hello":
        raise WireError(f"a first frame of kind {frame.get('kind')!r}, not a hello")
    if frame.get("protocol") != PROTOCOL:
        raise WireError(f"protocol {frame.get('protocol')!r}, not {PROTOCOL}")
    if frame.get("run") != sent["run"]:
        raise WireError(f"run id {frame.get('run')!r}, not this run's")
    if not hmac.compare_digest(str(frame.get("mac")), _mac(token, sent["nonce"], sent["run"])):
        raise WireError("a token that does not match this trainer's")
    about = frame.get("about")
    return about if isinstance(about, dict) else {}
