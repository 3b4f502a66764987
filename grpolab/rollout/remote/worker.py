"""A generator worker's side (``grpolab generator --connect HOST:PORT``): join a trainer, build the replica it
describes, meet it in a process group of their own, then draw what it asks with the weight versions it broadcasts
(the generator process's child loop, :mod:`grpolab.rollout.replica`), until the connection closes."""

from __future__ import annotations

import dataclasses
import datetime
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch

from grpolab.common.errors import GeneratorError
from grpolab.rollout.delta import Change, Span, apply, span_of
from grpolab.rollout.remote.common import (
    HANDSHAKE_TIMEOUT,
    RENDEZVOUS_TIMEOUT,
    RESULT_BYTES,
    SMALL,
    broadcast_piece,
    first_words,
    keepalive,
    layout_of,
    lora_of,
    pair_group,
    read_token,
    split_address,
    weight_buckets,
)
from grpolab.rollout.remote.wire import WireError, answer_challenge, recv_frame, send_frame
from grpolab.rollout.replica import STOP_MID_ANSWER, GeneratorSpec, ReplicaGenerator, SharedWeights
from grpolab.rollout.sampler import SamplingSettings
from grpolab.rollout.spec import VLLMSettings


@dataclasses.dataclass
class WorkerOptions:
    """A worker's own flags (``grpolab generator --help``)."""

    connect: str
    run: str | None = None
    device: str = "cpu"
    rollout_dtype: str = "auto"
    threads: int = 1
    engine: str = "hf"
    token_file: str = ""
    retry: float = 60.0
    """Seconds to keep trying to connect (a worker may start before its trainer listens)."""


def _connect(options: WorkerOptions) -> socket.socket:
    host, port = split_address(options.connect)
    deadline = time.monotonic() + options.retry
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise GeneratorError(f"no trainer answered at {host}:{port} in {options.retry:g} s ({e})") from None
            time.sleep(0.5)
    keepalive(sock)
    return sock


def run_worker(options: WorkerOptions, say: Callable[[str], None] = print) -> int:
    """Join the trainer at ``options.connect`` and draw what it asks until it stops us or goes away. Returns 0
    when told to stop or when the trainer closed the connection, 1 when a weight broadcast failed."""
    from grpolab.common.rng import set_threads

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    set_threads(options.threads)
    sock = _connect(options)
    try:
        welcome, generator, slot, group = _join(sock, options)
        name = f"worker {welcome['id']}"
        say(f"grpolab generator: {name} of run {welcome['run']!r} ({options.engine}, {generator.spec.dtype}, "
            f"{options.device})")  # fmt: skip
        return _serve(sock, generator, slot, group, welcome["backend"], options.device, name, say)
    except TimeoutError:
        say("grpolab generator: the trainer took no answer, or sent part of a frame, within --generator-timeout; "
            "exiting")  # fmt: skip
        return 1
    except (ConnectionError, OSError) as e:
        say(f"grpolab generator: the trainer closed the connection ({e.__class__.__name__}); exiting")
        return 0
    finally:
        sock.close()


def _join(sock: socket.socket, options: WorkerOptions):
    """The handshake, the welcome, the replica and its engine, the pair group: (welcome, generator, slot, group)."""
    import torch.distributed as dist

    frame, _ = recv_frame(sock, SMALL)
    about = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": options.device,
        "engine": options.engine,
        "rollout_dtype": options.rollout_dtype,
        "threads": options.threads,
    }
    send_frame(sock, answer_challenge(frame, read_token(options.token_file), options.run, about))
    welcome, buffers = recv_frame(sock, RESULT_BYTES)
    if welcome.get("kind") == "refused":
        raise WireError(f"the trainer refused this worker: {welcome.get('why')}")
    if welcome.get("kind") != "welcome":
        raise WireError(f"the trainer answered {welcome.get('kind')!r}, not a welcome")
    # from here a frame half-read, or an answer the trainer does not take, fails within the run's --generator-timeout
    # (the trainer reads every frame on a thread of its own: a write waits only on a trainer that is stopped or gone)
    sock.settimeout(welcome["timeout"])
    spec = worker_spec(welcome, dict(zip(welcome["buffers"], buffers)), options)
    slot = SharedWeights.of_layout(layout_of(welcome["layout"]))
    generator = ReplicaGenerator(spec, slot, slot.buffers)
    generator.forget()  # the trainer sends the versions it needs, the first whole
    send_frame(sock, {"kind": "ready"})
    host, _ = split_address(options.connect)
    span = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT)
    met = threading.Event()
    threading.Thread(target=_exit_if_closed, args=(sock, met), name="grpolab-rendezvous-watch", daemon=True).start()
    store = dist.TCPStore(host, welcome["store_port"], is_master=False, timeout=span)
    group = pair_group(store, welcome["group"], 1, welcome["backend"], welcome["timeout"])
    met.set()
    return welcome, generator, slot, group


def _exit_if_closed(sock: socket.socket, met: threading.Event) -> None:
    """While the worker waits to meet the trainer in their process group (torch.distributed's waits cannot be
    interrupted), end the process if the trainer closes the connection: its run ended or it died."""
    while not met.is_set():
        ready, _, _ = select.select([sock], [], [], 0.2)
        if not ready:
            continue
        try:
            closed = sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            closed = True
        if closed and not met.is_set():
            print("grpolab generator: the trainer closed the connection before the weights' group formed; exiting")
            os._exit(1)
        met.wait(0.2)  # a frame waits for the serving loop


def next_frame(sock: socket.socket) -> tuple[dict, list[torch.Tensor]]:
    """The trainer's next frame. Between frames a worker is idle, for as long as the trainer trains (its wait ends
    when the connection does: the kernel closes a dead trainer's socket, TCP keepalive notices a vanished host);
    once a frame has begun, the rest of it comes within the socket's timeout (--generator-timeout)."""
    while not select.select([sock], [], [], 1.0)[0]:
        pass
    return recv_frame(sock, RESULT_BYTES)


class _StopsMidFrame:
    """Tests only (``$GRPOLAB_TEST_STOP_MID_ANSWER`` = "drawn"): a socket whose first write sends a frame's magic and
    length, then stops this process (SIGSTOP) before the rest: the trainer must meet its deadline on a frame cut
    there."""

    def __init__(self, sock: socket.socket):
        self.sock, self.cut = sock, False

    def sendall(self, data) -> None:
        if not self.cut:
            self.cut = True
            self.sock.sendall(bytes(data[:8]))
            os.kill(os.getpid(), signal.SIGSTOP)
            data = data[8:]
        self.sock.sendall(data)


def _serve(sock, generator, slot, group, backend: str, device: str, name: str, say) -> int:
    """Answer the trainer's frames in order: weight syncs (their buckets by broadcast), draws, stop."""
    pieces = weight_buckets(slot.buffers)
    writer = sock
    if os.environ.pop(STOP_MID_ANSWER, None) == "drawn":
        writer = _StopsMidFrame(sock)
    while True:
        header, _ = next_frame(sock)
        kind, tag = header.get("kind"), header.get("tag", 0)
        if kind == "stop":
            return 0
        if kind == "sync":
            t0 = time.time()
            try:
                spans = receive_version(group, backend, device, pieces, header["pieces"])
            except RuntimeError as e:
                say(f"grpolab generator: {name}: a weight broadcast failed ({first_words(e)}); exiting")
                return 1
            generator.handle(("sync", tag, header["version"], header["keep_from"], spans, header["merged"]))
            send_frame(sock, {"kind": "synced", "tag": tag, "span": [t0, time.time()]})
        elif kind == "draw":
            keys = [tuple(k) for k in header["keys"]]
            draw = (header["version"], header["prompts"], keys, SamplingSettings(**header["settings"]), None)  # text
            _, _, (out, span, digest) = generator.handle(("draw", tag, *draw, header["digest"]))
            stats = [out.logprobs, out.entropy]  # an engine may give none (vLLM: no entropies)
            answer = {"kind": "drawn", "tag": tag, "span": list(span), "digest": digest}
            answer["absent"] = [i for i, t in enumerate(stats) if t is None]
            send_frame(writer, answer, [*out.batch.tensors, *(t for t in stats if t is not None)])
        else:
            raise WireError(f"a message of kind {kind!r}")


def receive_version(group, backend: str, device: str, pieces: list, counts: list[int]) -> list[Span] | None:
    """A weight version into the buffers ``pieces`` (:func:`grpolab.rollout.remote.common.weight_buckets`'s), which
    hold the version before: per bucket, ``counts`` says whole (-1: the bucket is broadcast) or how many positions
    changed (their int32 indices, then their values, are broadcast and written in). Returns the spans that changed
    (:class:`grpolab.rollout.delta.Span`), or None when every bucket came whole."""
    if len(counts) != len(pieces):
        raise WireError(f"a weight sync of {len(counts)} buckets; this worker's weights are {len(pieces)}")
    spans = []
    for (buffer, start, piece), count in zip(pieces, counts):
        if count < 0:
            broadcast_piece(group, backend, piece, device)
            spans.append(Span(buffer, start, start + piece.numel(), None))
        elif count:
            indices, values = torch.empty(count, dtype=torch.int32), torch.empty(count, dtype=piece.dtype)
            broadcast_piece(group, backend, indices, device)
            broadcast_piece(group, backend, values, device)
            change = Change(indices, values, count, piece.numel())
            if int(indices.min()) < 0 or int(indices.max()) >= piece.numel():
                raise WireError(f"a weight delta's positions outside its bucket of {piece.numel()}")
            apply(piece, change)
            spans.append(span_of(buffer, start, change))
    return None if all(c < 0 for c in counts) else spans


def worker_spec(welcome: dict, buffers: dict[str, torch.Tensor], options: WorkerOptions) -> GeneratorSpec:
    """The replica's :class:`GeneratorSpec` from the trainer's welcome: its model class (a transformers class, by
    name: nothing from the network runs as code), config (JSON), buffers and dtypes; device, threads and engine
    the worker's own."""
    import transformers

    model_class = getattr(transformers, welcome["model_class"], None)
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise WireError(f"{welcome['model_class']!r} is not a transformers model class")
    config = transformers.AutoConfig.for_model(**welcome["config"])
    if welcome.get("attention"):
        config._attn_implementation = welcome["attention"]
    param_dtype = getattr(torch, welcome["param_dtype"])
    dtype = (
        getattr(torch, welcome["dtype"]) if options.rollout_dtype == "auto" else getattr(torch, options.rollout_dtype)
    )
    vllm = None
    if options.engine == "vllm":
        vllm = VLLMSettings(2048, True, 0.3, False, fp32_head=welcome["fp32_head"])
    storage = getattr(torch, welcome["storage"]) if welcome.get("storage") and dtype != param_dtype else None
    return GeneratorSpec(
        model_class,
        config,
        buffers,
        param_dtype,
        dtype,
        welcome["eos_id"],
        welcome["pad_id"],
        options.device,
        options.threads,
        always_copy=welcome["always_copy"],
        trainable=welcome["trainable"],
        vllm=vllm,
        seed=welcome["seed"],
        fp32_head=welcome["fp32_head"],
        storage=storage,
        lora=lora_of(welcome["lora"]),
    )


# ---------------------------------------------------------------------- the trainer's side
