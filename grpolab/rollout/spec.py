"""What every rollout engine is built from: one :class:`EngineSpec`, computed once from the run's rollout options, the
policy and how the trainer computes (:meth:`EngineSpec.of`), and taken by grpolab's sampler
(:class:`grpolab.rollout.engine.HFEngine`), vLLM (:class:`grpolab.rollout.vllm_engine.VLLMEngine`), the generator
process (:class:`grpolab.rollout.generator.ProcessEngine`) and the generator workers
(:class:`grpolab.rollout.remote.pool.WorkerPool`). Only here are the rollout dtype, the sampler's storage dtype and
vLLM's settings worked out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

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
    lag: int = 0
    """--max-staleness K: a step draws with the weights of K updates before."""
    seed: int = 0
    """vLLM's own seed."""
    vllm: VLLMSettings | None = None
    """vLLM's start settings, for ``--rollout-engine vllm``; None: grpolab's sampler."""
    full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """A context inside which every parameter is whole on this process (FSDP gathers its shards there)."""

    @classmethod
    def of(
        cls,
        engine: EngineSection,
        seed: int,
        policy,
        full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        fp32_head: bool = False,
        autocast: bool = False,
    ) -> EngineSpec:
        """The spec the run's ``engine`` options ask for over ``policy``. ``--rollout-dtype auto``: the policy's own
        dtype (a run resolves it to its precision's compute dtype first). ``autocast``: the trainer computes under
        autocast in the engine's dtype, and grpolab's sampler computes as it does (its copy keeps the policy's dtype
        outside the products); vLLM runs its model in its dtype throughout."""
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
            lag=engine.max_staleness,
            seed=seed,
            vllm=vllm,
            full_weights=full_weights,
        )
