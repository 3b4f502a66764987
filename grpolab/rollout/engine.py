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
them, pushed at each ``weights_changed``. :func:`grpolab.rollout.placement.build_engine` makes the one an
:class:`EngineSpec` asks for, where its placement says it draws.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Protocol

import torch

from grpolab.models.decode_cache import slab_reason
from grpolab.models.head import fp32_head
from grpolab.rollout.sampler import Sampled, SamplingSettings, sample_with_stats
from grpolab.rollout.spec import EngineSpec
from grpolab.rollout.weights import SamplerWeights

__all__ = ["EngineSpec", "HFEngine", "RolloutEngine", "SamplingSettings"]


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
    """grpolab's sampler (:func:`grpolab.rollout.sampler.sample_with_stats`) on the policy's transformers model, as
    ``spec`` says (:class:`grpolab.rollout.spec.EngineSpec`).

    In a dtype other than the policy's, or on the CPU where oneDNN's packed linear layers run, it samples with a copy
    of the weights (:class:`grpolab.rollout.weights.SamplerWeights`) that :meth:`weights_changed` refreshes; else with
    the live weights, in eval mode (put back in the mode it was in afterwards), whole inside ``spec.full_weights``
    (``grpolab.training.forward.TrainModule.full_weights``). ``pack``: allow the packed copy; ``always_copy``: a copy
    even where the live weights would do (a generator's replica).

    A model whose own cache the slab does not hold (:func:`grpolab.models.decode_cache.slab_reason`: sliding-window or
    recurrent layers) decodes with that cache, without the fused decoder: said once, as the engine is built.
    """

    def __init__(self, model: torch.nn.Module, spec: EngineSpec, *, pack: bool = True, always_copy: bool = False):
        self.model, self.eos_id, self.pad_id, self.full_weights = model, spec.eos_id, spec.pad_id, spec.full_weights
        dtype = spec.dtype or next(model.parameters()).dtype
        self.fp32_head = spec.fp32_head and dtype in (torch.bfloat16, torch.float16)
        head = torch.float32 if self.fp32_head else None
        self.weights = SamplerWeights(
            model, dtype, pack, spec.full_weights, max_staleness=spec.max_staleness, always_copy=always_copy,
            head_dtype=head, storage=spec.storage,
        )  # fmt: skip
        if (reason := slab_reason(model)) is not None:
            warnings.warn(_cache_notice(model, reason), stacklevel=2)

    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        """One completion per prompt from grpolab's sampler (:func:`grpolab.rollout.sampler.sample_with_stats`): on
        the engine's copy of the weights, or on the live ones in eval mode (the model's mode put back afterwards).

        Args:
            prompts (list[list[int]]): N prompts' token ids, unpadded: B prompts, each repeated G times, N = B*G.
            keys (list[tuple[int, ...]]): [N] rollout keys; ``keys[n]`` seeds row n, whatever the other rows are.
            settings (SamplingSettings): ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
                ``repetition_penalty``, ``ignore_eos`` (no row stops at EOS) and ``prompt_width`` (the prompts are
                left-padded to at least it), for every row.
            media (Sequence[Media | None] | None): [N] each prompt's images (:class:`grpolab.vision.media.Media` or
                None), or None for text prompts.

        Returns:
            Sampled: on the model's device: ``batch`` (``prompt_ids``, ``prompt_mask`` [N, P], P the longest prompt
                or ``prompt_width``; ``completion_ids``, ``completion_mask`` [N, T], T the longest completion, at most
                ``max_new_tokens``; ``media``), ``logprobs`` [N, T] each sampled token's log-prob under the
                distribution it was drawn from (at the temperature, greedy's at 1; top-p, top-k, min-p and the
                penalty applied: :mod:`grpolab.models.sampling_rules`) and ``entropy`` [N, T] the entropy of the
                model's distribution at the temperature, before them, in nats; 0 on padding.
        """
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
            top_k=settings.top_k,
            min_p=settings.min_p,
            repetition_penalty=settings.repetition_penalty,
        )

    def weights_changed(self) -> None:
        """Refresh the sampler's copy of the weights (nothing to do when it samples from the live ones); with
        ``max_staleness`` K, to the weights of K syncs before (:class:`grpolab.rollout.weights.SamplerWeights`)."""
        self.weights.sync()

    def current_weights(self) -> contextlib.AbstractContextManager:
        """Inside the block, draw with the policy's current weights (a lagged engine's evaluation)."""
        return self.weights.current()

    def weights_version(self) -> int | None:
        """With a staleness K >= 1: the number of the weight sync whose weights it draws with (0: the starting ones);
        else None."""
        return self.weights.version if self.weights.max_staleness else None

    def held_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """With a staleness K >= 1: the weights in flight, for a checkpoint (:meth:`SamplerWeights.held_state`)."""
        return self.weights.held_state()

    def restore_held(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`held_state`'s weights."""
        self.weights.restore_held(counts, tensors)


def _cache_notice(model: torch.nn.Module, reason: str) -> str:
    """The one line that says a model samples with its own cache rather than grpolab's slab and fused decoder."""
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    return (
        f"{name}: {reason}, which grpolab's slab cache and fused decoder do not hold; the sampler decodes with "
        "the model's own cache (transformers' DynamicCache), without their speed-up"
    )
