"""What both ends of a generator worker's connection share: the token and addresses, the weight broadcasts' process
group and buckets, the JSON forms of a layout and of sampling settings, and the limits of the handshake."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import socket

import torch

from grpolab.common.distributed import forced_backend
from grpolab.common.errors import ConfigError
from grpolab.rollout.lora_merge import LoraFactors
from grpolab.rollout.sampler import SamplingSettings

log = logging.getLogger("grpolab.generators")

TOKEN_ENV = "GRPOLAB_GENERATOR_TOKEN"
"""The environment variable a shared token is read from (or a file named by --generator-token-file)."""
BUCKET_BYTES = 64 << 20
"""A weight broadcast's bucket: the flat buffer of each dtype goes in pieces of at most this many bytes."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to answer the challenge: a stranger that sends nothing is cut after it."""
RENDEZVOUS_TIMEOUT = 30.0
"""Seconds a worker that said it is ready waits to meet the trainer in their process group (the trainer builds it on
reading "ready"): a worker whose run ended or died meanwhile exits after it."""
SMALL = 1 << 16
"""The payload a handshake frame may carry (none)."""
RESULT_BYTES = 8 << 30
"""The largest answer the trainer reads (a draw's tensors)."""


def read_token(path: str = "") -> bytes:
    """The shared token: the file ``path``'s content (stripped), else $GRPOLAB_GENERATOR_TOKEN, else b"" (a trainer
    that listens on localhost only may go without)."""
    if path:
        return open(path, "rb").read().strip()
    return os.environ.get(TOKEN_ENV, "").encode()


def split_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, ``PORT``) as (host, port)."""
    host, _, port = address.rpartition(":")
    try:
        return host.strip("[]") or default_host, int(port)
    except ValueError:
        raise ConfigError(f"{address!r} is not HOST:PORT") from None


def is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def keepalive(sock: socket.socket) -> None:
    """Notice a peer whose host vanished within about a minute (Linux's TCP keepalive options)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def first_words(error: Exception) -> str:
    """A torch.distributed error's first line without gloo's source location and advice ("Connection closed by
    peer [127.0.0.1]:10901")."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return line.split(". This is typically")[0]


def transport_backend(trainer_device: str, worker_device: str) -> str:
    """NCCL between two CUDA devices, else gloo (through the CPU); ``$GRPOLAB_DIST_BACKEND=gloo``: gloo always (its
    ``nccl`` is this rule: NCCL where both tensors are on CUDA)."""
    if forced_backend() == "gloo":
        return "gloo"
    return "nccl" if str(trainer_device).startswith("cuda") and str(worker_device).startswith("cuda") else "gloo"


def pair_group(store, name: str, rank: int, backend: str, timeout: float):
    """A two-rank process group of its own (the trainer 0, one worker 1) over ``store``: a dead worker breaks only
    its own group, never the trainer's default one (DDP/FSDP2)."""
    import torch.distributed as dist

    prefix = dist.PrefixStore(name + "/", store)
    span = datetime.timedelta(seconds=timeout)
    if backend == "nccl":  # on CUDA (docs/gpu.md says what has run there)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = span
        return dist.ProcessGroupNCCL(prefix, rank, 2, options)
    return dist.ProcessGroupGloo(prefix, rank, 2, span)


def broadcast_piece(group, backend: str, piece: torch.Tensor, device: str) -> None:
    """One tensor (a bucket, or a delta's int32 positions or values) from rank 0 into rank 1's ``piece`` (NCCL
    through a copy on the CUDA ``device``)."""
    if backend == "nccl":
        staged = piece.to(device)
        group.broadcast(staged, 0).wait()
        piece.copy_(staged)
    else:
        group.broadcast(piece, 0).wait()


def weight_buckets(buffers: dict[str, torch.Tensor]) -> list[tuple[str, int, torch.Tensor]]:
    """Each flat buffer in pieces of at most BUCKET_BYTES: ``(buffer, start, piece)``, the buffer's name, the piece's
    first position in it, and the piece (a view: broadcasting into it fills the buffer)."""
    pieces = []
    for name in sorted(buffers):
        flat = buffers[name]
        step = max(1, BUCKET_BYTES // flat.element_size())
        pieces += [(name, i, flat[i : i + step]) for i in range(0, flat.numel(), step)]
    return pieces


def layout_json(layout: dict) -> dict:
    return {n: [str(d).removeprefix("torch."), start, list(shape)] for n, (d, start, shape) in layout.items()}


def layout_of(data: dict) -> dict:
    return {n: (getattr(torch, d), start, torch.Size(shape)) for n, (d, start, shape) in data.items()}


def lora_json(layers: dict[str, LoraFactors]) -> dict:
    """:class:`grpolab.rollout.weights.LoraFactors` by weight name as JSON (a float's repr reads back exactly)."""
    return {n: [f.a, f.b, f.scaling, f.fan_in_fan_out, str(f.dtype).removeprefix("torch.")] for n, f in layers.items()}


def lora_of(data: dict) -> dict[str, LoraFactors]:
    return {n: LoraFactors(a, b, float(s), bool(t), getattr(torch, d)) for n, (a, b, s, t, d) in data.items()}


def settings_json(s: SamplingSettings) -> dict:
    return dataclasses.asdict(s)


# ---------------------------------------------------------------------- the worker
