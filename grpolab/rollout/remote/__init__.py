"""Generator workers: rollout engines in processes of their own, on this machine or others, joined over TCP.

A worker (``grpolab generator --connect HOST:PORT``, :func:`run_worker`) connects to a trainer started with
``--generators N``, which listens on ``--generator-listen`` (:class:`WorkerPool`). The worker keeps its own device,
engine (hf or vllm), rollout dtype and threads; the trainer keeps everything else (the collector, rewards,
environments, the update).

One side of the wire per file: ``worker.py`` (the worker), ``pool.py`` (the trainer's engine), with the trainer's
parts beside it: ``listener.py`` (where workers join), ``handle.py`` (one joined worker), ``versions.py`` (the weight
versions held), ``parts.py`` (a draw split and merged), ``books.py`` (counts and events); ``wire.py`` (the frames and
the handshake) and ``common.py`` (what both sides share). The child loop every worker runs is
:mod:`grpolab.rollout.replica`'s, the generator process's.

The connection: after the handshake (:mod:`grpolab.rollout.remote.wire`: the protocol, the run id, an HMAC of a nonce
under the shared token), the trainer sends the model's class name, its config as JSON and its buffers; the worker
builds a replica, says it is ready, and both ends join a process group of their own (``torch.distributed``, gloo on
a CPU, NCCL between CUDA devices: two ranks, the trainer rank 0), over which every weight version is broadcast in
buckets of ``BUCKET_BYTES``, in the rollout dtype: the first a worker takes whole, each later one as the delta from
the version it holds (:mod:`grpolab.rollout.delta`: per bucket the positions that changed and their values, or the
whole bucket where that is smaller), a LoRA policy's adapter unmerged beside its base (``--lora-sync``). Draws, their
answers and the sync notices (a sync's header says, per bucket, whole or how many positions) are frames on the TCP
connection. Weights are sent after the optimizer step, outside FSDP2's gather (:meth:`WorkerPool.weights_changed`
runs after ``full_weights`` has closed), so they never interleave with the trainer's own collectives.

Every rollout is drawn from its own key with a named weight version (the generator process's bookkeeping,
:mod:`grpolab.rollout.generator`, whose child loop each worker runs). A call's rows are split into N contiguous
parts (N = --generators), each padded to the whole call's prompt width and drawn as one batch by some live worker,
so the run does not depend on which workers are live, lost or late. With N = 1 it is the trainer's own engine's bit
for bit; with N > 1 the tokens are, and the log-probs to the last bits (docs/distributed.md: this CPU's matrix
kernels compute a row otherwise in a batch of fewer than 4 rows).

Faults: a worker that dies, closes its connection or gives no answer within ``--generator-timeout`` is dropped
(``generators/lost``) and its parts are drawn again by the next live worker from the same keys (``generators/
redrawn``). A worker that joins late gets the versions a later draw may still ask for (the newest K + 1) before it
draws, the oldest whole. With no worker left the trainer waits ``--generator-wait`` seconds for one to join, then
stops with one :class:`grpolab.common.errors.GeneratorError`. A worker exits when its connection closes (the trainer
ended or died: the kernel closes a dead process's sockets, and TCP keepalive notices a vanished host).
"""
