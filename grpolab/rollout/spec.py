"""What every rollout engine is built from: one :class:`EngineSpec`, computed once from the run's rollout options, the
policy and how the trainer computes (:meth:`EngineSpec.of`), and taken by grpolab's sampler
(:class:`grpolab.rollout.engine.HFEngine`), vLLM (:class:`grpolab.rollout.vllm_engine.VLLMEngine`), the generator
process (:class:`grpolab.rollout.generator.ProcessEngine`) and the generator workers
(:class:`grpolab.rollout.remote.pool.WorkerPool`). Only here are the rollout dtype, the sampler's storage dtype,
vLLM's settings and where the engine draws (:class:`Placement`) worked out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Literal

import torch

from grpolab.common.precision import rollout_dtype
from grpolab.config.rollout import EngineSection


@dataclasses.dataclass(frozen=True)
class VLLMSettings:
    """How the engine is started."""

    max_model_len: int = 2048
    """Longest prompt + completion in tokens (at most the model's own limit)."""
    eager: bool = True
    """No compilation: starts in seconds; compiled it samples ~1.2x faster on this CPU after a 1-2 minute start."""
    memory: float = 0.3
    """CUDA: the share of GPU memory vLLM may take (weights and KV cache)."""
    sleep: bool = False
    """CUDA: free the engine's weights and KV cache while the trainer updates (sleep mode)."""
    fp32_head: bool = False
    """The LM head's product in fp32 when the engine runs in bf16 or fp16 (``--fp32-head``; vLLM's ``head_dtype``)."""


def autocast_storage(policy: torch.dtype, dtype: torch.dtype, autocast: bool) -> torch.dtype | None:
    """The dtype grpolab's sampler holds its copy in outside the products: the policy's, when it computes as autocast
    does in another dtype; else None (all in ``dtype``)."""
    return policy if autocast and dtype != policy else None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the engine draws (:attr:`grpolab.config.rollout.EngineSection.placement`) and what that place takes: the
    options of :class:`grpolab.config.rollout.EngineSection` that say it, whose defaults are the section's alone
    (:meth:`of`), and the run's id and this process's rank."""

    where: Literal["inline", "process", "workers"]
    """``inline`` in this process, ``process`` in a generator process of its own, ``workers`` on generator workers."""
    threads: int
    """process: the child's torch threads (--generator-threads; 0: this process's)."""
    timeout: float
    """process, workers: seconds one answer may take (--generator-timeout)."""
    workers: int
    """workers: how many to wait for before the first draw (--generators)."""
    listen: str
    """workers: HOST:PORT to listen on (--generator-listen); rank r of a torchrun job listens on the port plus r."""
    wait: float
    """workers: seconds to wait for a worker when none is live (--generator-wait)."""
    token_file: str
    """workers: the file of the token they must prove they share (--generator-token-file)."""
    run: str
    """workers: the run's id, which a worker may name."""
    rank: int
    """This process's rank (its workers are its own)."""

    @classmethod
    def of(cls, engine: EngineSection, run: str = "run", rank: int = 0) -> Placement:
        """The placement the run's --generator/--generators options ask for."""
        return cls(
            engine.placement, engine.generator_threads, engine.generator_timeout, engine.generators,
            engine.generator_listen, engine.generator_wait, engine.generator_token_file, run, rank,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A rollout engine's settings, whichever engine it is."""

    eos_id: int
    pad_id: int
    dtype: torch.dtype | None = None
    """The dtype it samples in (None: the policy's)."""
    storage: torch.dtype | None = None
    """grpolab's sampler: its copy's dtype outside the products (:func:`autocast_storage`); None: all in ``dtype``."""
    fp32_head: bool = False
    """The LM head's product in fp32 when it samples in bf16 or fp16 (``--fp32-head``)."""
    max_staleness: int = 0
    """--max-staleness K: a step draws with the weights of K updates before."""
    seed: int = 0
    """vLLM's own seed."""
    vllm: VLLMSettings | None = None
    """vLLM's start settings, for ``--rollout-engine vllm``; None: grpolab's sampler."""
    full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """A context inside which every parameter is whole on this process (FSDP gathers its shards there)."""
    placement: Placement = dataclasses.field(default_factory=lambda: Placement.of(EngineSection()))
    """Where it draws (:func:`grpolab.rollout.placement.build_engine` builds the engine of that place)."""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """With a LoRA policy: send the adapter alone and serve it unmerged ('adapter'), or every weight with the adapter
    merged ('merged'); 'auto': adapter where the engine can serve it (--lora-sync)."""

    @classmethod
    def of(
        cls,
        engine: EngineSection,
        seed: int,
        policy,
        full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        fp32_head: bool = False,
        autocast: bool = False,
        run: str = "run",
        rank: int = 0,
    ) -> EngineSpec:
        """The spec the run's ``engine`` options ask for over ``policy``. ``--rollout-dtype auto``: the policy's own
        dtype (a run resolves it to its precision's compute dtype first). ``autocast``: the trainer computes under
        autocast in the engine's dtype, and grpolab's sampler computes as it does (its copy keeps the policy's dtype
        outside the products); vLLM runs its model in its dtype throughout. ``run``, ``rank``: the run's id and this
        process's rank, for generator workers (:class:`Placement`)."""
        param = next(policy.model.parameters())
        dtype = rollout_dtype(engine.rollout_dtype, param.dtype)
        vllm = None
        if engine.rollout_engine == "vllm":
            vllm = VLLMSettings(
                engine.vllm_max_len, not engine.vllm_compile, engine.vllm_memory, engine.vllm_sleep, fp32_head=fp32_head
            )
        return cls(
            eos_id=policy.eos_id,
            pad_id=policy.pad_id,
            dtype=dtype,
            storage=autocast_storage(param.dtype, dtype, autocast),
            fp32_head=fp32_head,
            max_staleness=engine.max_staleness,
            seed=seed,
            vllm=vllm,
            full_weights=full_weights,
            placement=Placement.of(engine, run, rank),
            lora_sync=engine.lora_sync,
        )
