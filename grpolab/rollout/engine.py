"""Rollout engines: what turns prompts into sampled completions for the trainer's collector.

The collector (``grpolab.rollout.collect``) decides *which* rollouts a step needs and scores them; an
engine only generates them. It is given token ids, one rollout key per row and the sampling
settings, and returns the completions with what the sampler saw at each token (its log-prob
and the entropy of its distribution). After each optimizer step the trainer calls
:meth:`RolloutEngine.weights_changed`, so an engine that keeps its own copy of the weights
can refresh it.

Contract (what the trainer's reproducibility rests on): row n's completion depends only on the
prompt, the policy's weights and ``keys[n]``, never on the other rows of the call, so a rollout
is the same whichever batch or process produced it.

:class:`HFEngine` is grpolab's own sampler (``grpolab.rollout.sampler``) over the policy's live
transformers weights, or over a copy of them in the rollout dtype (``grpolab.rollout.weights``; on the CPU with
its linear layers packed for oneDNN), refreshed at each ``weights_changed``. :class:`grpolab.rollout.vllm_engine.VLLMEngine` is vLLM on a copy of
them, pushed at each ``weights_changed``. :func:`build_engine` makes the one ``--rollout-engine`` names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

from grpolab.common.precision import rollout_dtype
from grpolab.config.rollout import EngineSection
from grpolab.models.head import fp32_head
from grpolab.rollout.sampler import Sampled, SamplingSettings, sample_with_stats
from grpolab.rollout.weights import SamplerWeights

__all__ = ["HFEngine", "RolloutEngine", "SamplingSettings", "build_engine", "greedy_texts"]


class RolloutEngine(Protocol):
    """Generates rollouts for the collector."""

    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        """One completion per prompt (a group repeats its prompt G times); ``keys[n]`` seeds row n. ``media``:
        ``[N]`` each prompt's images (:class:`grpolab.vision.media.Media` or None), or None for text prompts.

        Returns the batch ``[N, ...]`` with the sampler's log-probs and entropies ``[N, T]`` (0 on padding)."""
        ...

    def weights_changed(self) -> None:
        """The policy's weights were updated: generate from the new ones from now on."""
        ...


class HFEngine:
    """grpolab's sampler (:func:`grpolab.rollout.sampler.sample_with_stats`) on the policy's transformers model.

    ``dtype``: the dtype it samples in (default: the policy's). In another dtype, or on the CPU where oneDNN's
    packed linear layers run, it samples with a copy of the weights (:class:`grpolab.rollout.weights.SamplerWeights`)
    that :meth:`weights_changed` refreshes; else with the live weights. ``pack``: allow the packed copy.
    ``full_weights``: a context inside which every parameter is whole on this process (FSDP gathers its
    shards there; ``grpolab.training.forward.TrainModule.full_weights``). The live model samples in eval mode
    and is put back in the mode it was in afterwards. ``fp32_head``: the LM head's product in fp32 when the engine
    samples in bf16 or fp16 (``--fp32-head``). ``storage``: the copy's dtype outside its products, for a copy that
    computes as a mixed-precision trainer's autocast does (:class:`grpolab.rollout.weights.SamplerWeights`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_id: int,
        pad_id: int,
        full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        dtype: torch.dtype | None = None,
        pack: bool = True,
        lag: int = 0,
        always_copy: bool = False,
        fp32_head: bool = False,
        storage: torch.dtype | None = None,
    ):
        self.model, self.eos_id, self.pad_id, self.full_weights = model, eos_id, pad_id, full_weights
        dtype = dtype or next(model.parameters()).dtype
        self.fp32_head = fp32_head and dtype in (torch.bfloat16, torch.float16)
        head = torch.float32 if self.fp32_head else None
        self.weights = SamplerWeights(
            model, dtype, pack, full_weights, lag=lag, always_copy=always_copy, head_dtype=head, storage=storage
        )

    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        if self.weights.copied:  # a copy of its own: always whole, always in eval mode
            return self._sample(self.weights.model, prompts, keys, settings, self.weights.decoder, media)
        was_training = self.model.training
        self.model.eval()
        with self.full_weights(), fp32_head(self.model, self.fp32_head):
            out = self._sample(self.model, prompts, keys, settings, media=media)
        self.model.train(was_training)
        return out

    def _sample(self, model, prompts, keys, settings: SamplingSettings, decoder=None, media=None) -> Sampled:
        return sample_with_stats(
            model,
            prompts,
            keys,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            eos_id=-1 if settings.ignore_eos else self.eos_id,  # no token is -1: no row stops early
            pad_id=self.pad_id,
            decoder=decoder,
            prompt_width=settings.prompt_width,
            media=media,
        )

    def weights_changed(self) -> None:
        """Refresh the sampler's copy of the weights (nothing to do when it samples from the live ones); with
        ``lag`` K, to the weights of K syncs before (:class:`grpolab.rollout.weights.SamplerWeights`)."""
        self.weights.sync()

    def current_weights(self) -> contextlib.AbstractContextManager:
        """Inside the block, draw with the policy's current weights (a lagged engine's evaluation)."""
        return self.weights.current()

    def weights_version(self) -> int | None:
        """With a lag: the number of the weight sync whose weights it draws with (0: the starting ones); else None."""
        return self.weights.version if self.weights.lag else None

    def lag_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """With a lag: the weights in flight, for a checkpoint (:meth:`SamplerWeights.lag_state`)."""
        return self.weights.lag_state()

    def restore_lag(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`lag_state`'s weights."""
        self.weights.restore_lag(counts, tensors)


def autocast_storage(policy: torch.dtype, dtype: torch.dtype, autocast: bool) -> torch.dtype | None:
    """The dtype grpolab's sampler holds its copy in outside the products (``HFEngine``'s ``storage``): the policy's,
    when it computes as autocast does in another dtype; else None (all in ``dtype``)."""
    return policy if autocast and dtype != policy else None


def build_engine(
    engine: EngineSection,
    seed: int,
    policy,
    full_weights=contextlib.nullcontext,
    fp32_head: bool = False,
    autocast: bool = False,
) -> RolloutEngine:
    """The rollout engine ``engine.rollout_engine`` names, over ``policy``'s model (``seed``: vLLM's own;
    ``fp32_head``: its LM head in fp32 when it samples in bf16 or fp16). ``--rollout-dtype auto``: the policy's own
    dtype (a run resolves it to its precision's compute dtype first). ``autocast``: the trainer computes under
    autocast in the engine's dtype, and grpolab's sampler computes as it does (its copy keeps the policy's dtype
    outside the products); vLLM runs its model in its dtype throughout."""
    param = next(policy.model.parameters())
    dtype = rollout_dtype(engine.rollout_dtype, param.dtype)
    if engine.rollout_engine == "hf":
        return HFEngine(
            policy.model,
            eos_id=policy.eos_id,
            pad_id=policy.pad_id,
            full_weights=full_weights,
            dtype=dtype,
            lag=engine.max_staleness,
            fp32_head=fp32_head,
            storage=autocast_storage(param.dtype, dtype, autocast),
        )
    from grpolab.rollout.vllm_engine import VLLMEngine, VLLMSettings

    settings = VLLMSettings(
        engine.vllm_max_len, not engine.vllm_compile, engine.vllm_memory, engine.vllm_sleep, fp32_head=fp32_head
    )
    return VLLMEngine(
        policy.model,
        eos_id=policy.eos_id,
        pad_id=policy.pad_id,
        seed=seed,
        settings=settings,
        full_weights=full_weights,
        dtype=dtype,
    )


def greedy_texts(policy, kind: str = "hf", seed: int = 0) -> Callable[[list[list[int]], list[tuple], int], list[str]]:
    """``generate(prompt_ids, keys, max_new_tokens) -> texts``: ``policy``'s greedy completions through the engine
    ``kind`` names (``hf`` or ``vllm``), special tokens removed; what a local LLM judge answers with
    (:mod:`grpolab.rewards.judge`). A row's answer depends only on its prompt (the engines' contract)."""
    engine = build_engine(EngineSection(rollout_engine=kind), seed, policy)

    def generate(prompts: list[list[int]], keys: list[tuple], max_new_tokens: int) -> list[str]:
        got = engine.generate(prompts, keys, SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0))
        return policy.decode(got.batch.completion_ids, got.batch.completion_mask)

    generate.engine = engine
    return generate
