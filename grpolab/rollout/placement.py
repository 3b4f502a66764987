"""Where a rollout engine draws, and the one function that builds it: :func:`build_engine` makes the engine an
:class:`grpolab.rollout.spec.EngineSpec` asks for, in this process (grpolab's sampler, :class:`HFEngine`, or vLLM), in
a generator process of its own (:class:`grpolab.rollout.generator.ProcessEngine`) or on generator workers
(:class:`grpolab.rollout.remote.pool.WorkerPool`), as its :class:`grpolab.rollout.spec.Placement` says. Apart from
the engines themselves, so that none of them imports another's module to be built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpolab.config.rollout import EngineSection
from grpolab.rollout.engine import HFEngine, RolloutEngine
from grpolab.rollout.sampler import SamplingSettings
from grpolab.rollout.spec import EngineSpec


def build_engine(spec: EngineSpec, model: torch.nn.Module, say: Callable[[str], None] = print) -> RolloutEngine:
    """The rollout engine ``spec`` asks for over ``model`` (the policy's), where ``spec.placement`` says it draws:
    in this process (grpolab's sampler, or vLLM where ``spec.vllm`` is set), in a generator process of its own
    (:class:`grpolab.rollout.generator.ProcessEngine`) or on generator workers
    (:class:`grpolab.rollout.remote.pool.WorkerPool`, which tell ``say`` who joins and leaves; vLLM tells it why a LoRA
    adapter is merged under ``--lora-sync auto``)."""
    place = spec.placement
    if place.where == "process":
        from grpolab.rollout.generator import ProcessEngine

        return ProcessEngine(model, spec, threads=place.threads or torch.get_num_threads(), timeout=place.timeout)
    if place.where == "workers":
        from grpolab.rollout.remote.pool import worker_pool

        return worker_pool(model, spec, say)
    if spec.vllm is None:
        return HFEngine(model, spec)
    from grpolab.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, spec, say)


def greedy_texts(policy, kind: str = "hf", seed: int = 0) -> Callable[[list[list[int]], list[tuple], int], list[str]]:
    """``generate(prompt_ids, keys, max_new_tokens) -> texts``: ``policy``'s greedy completions through the engine
    ``kind`` names (``hf`` or ``vllm``), special tokens removed; what a local LLM judge answers with
    (:mod:`grpolab.rewards.judge`). A row's answer depends only on its prompt (the engines' contract)."""
    engine = build_engine(EngineSpec.of(EngineSection(rollout_engine=kind), seed, policy), policy.model)

    def generate(prompts: list[list[int]], keys: list[tuple], max_new_tokens: int) -> list[str]:
        got = engine.generate(prompts, keys, SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0))
        return policy.decode(got.batch.completion_ids, got.batch.completion_mask)

    generate.engine = engine
    return generate
