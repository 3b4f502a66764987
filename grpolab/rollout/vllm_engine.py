"""The ``vllm`` rollout engine: vLLM, in this process, on a copy of the policy's weights.

The engine is built from the policy's own model (a GGUF-loaded or LoRA-wrapped one included): its
config is written to a scratch directory, vLLM starts on it with placeholder weights
(``load_format="dummy"``) and the policy's weights are pushed into it, the same way as after
every optimizer step. No checkpoint is read or written.

- **Sync.** :meth:`VLLMEngine.weights_changed` pushes every weight (the tied ``lm_head.weight``
  included, which vLLM needs even for a tied model) with vLLM's ``reload_weights``, then drops the
  engine's prefix cache (its keys and values were computed with the old weights). A LoRA policy's
  adapter is served unmerged where vLLM can (``--lora-sync auto`` or ``adapter``;
  :mod:`grpolab.rollout.lora_serve`): vLLM starts with its LoRA layers, the base weights are pushed
  once, and each step only the adapter, a new version with its own id that every request names.
  Otherwise (``merged``) each adapted layer is pushed as base + the adapter's delta, computed without
  touching the training weights. :meth:`VLLMEngine.pop_metrics` says what the syncs sent and took.
- **Seeds.** Row n is sampled with ``SamplingParams(seed=...)`` derived from its rollout key, so
  its tokens do not depend on the other rows of the call, nor on the process that samples it.
  What holds bit for bit and what does not is measured in ``docs/vllm.md``.
- **Log-probs.** The engine returns the log-prob of each sampled token under the distribution it
  sampled from (``logprobs_mode="processed_logprobs"``: after the repetition penalty, temperature,
  min-p, top-k and top-p, in the order ``grpolab.models.sampling_rules`` gives), the denominator of
  the engine correction (``grpolab.algo.engine_correction``).
- **No entropy.** vLLM does not return the entropy of its distribution: ``policy/entropy`` is not
  logged and ``--top-entropy-quantile`` needs the ``hf`` engine.
- **One engine per process and architecture.** Starting vLLM costs seconds (eager) to minutes
  (compiled), so engines with the same model shape and settings in one process share one
  ``vllm.LLM``; each engine pushes its own weights when the shared one last held another's.

CUDA: ``gpu_memory_utilization`` (``--vllm-memory``) and sleep mode (``--vllm-sleep``: the engine
frees its weights and KV cache during the update): CUDA's (docs/gpu.md says what has run there). On
the CPU, the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 2 here: 46,000 tokens of
SmolLM2, a step of 32 x 8 rollouts of up to 128 tokens held at once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from grpolab.common.batch import Batch, left_pad
from grpolab.common.rng import rng_state, set_rng_state
from grpolab.config.fields import bad
from grpolab.config.rollout import VLLM_INSTALL_HINT
from grpolab.rollout.lora_serve import (
    AdapterShape,
    AdapterVersions,
    adapter_shape,
    base_weights,
    tensor_bytes,
    why_not_served,
)
from grpolab.rollout.sampler import Sampled, SamplingSettings
from grpolab.rollout.spec import EngineSpec, VLLMSettings
from grpolab.rollout.weights import base_model, served_weights
from grpolab.vision.media import text_only


def _import_vllm():
    """vLLM in this process: its engine core in-process, quiet unless the user asked otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in the trainer's process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on the CPU (the default is a share of RAM)
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "grpolab-vllm-cache"))
    try:
        with warnings.catch_warnings():  # its import warns about torch APIs it uses, nothing a user can act on
            warnings.simplefilter("ignore", FutureWarning)
            import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_INSTALL_HINT} ({e})") from None
    return vllm


def rollout_seed(key: tuple[int, ...]) -> int:
    """A 63-bit seed for vLLM's per-request generator, a pure function of the rollout key."""
    state = np.random.SeedSequence(list(key)).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def _config_dir(model: torch.nn.Module, dtype: torch.dtype, fp32_head: bool = False) -> str:
    """A scratch directory holding the model's config.json (no weights: vLLM starts on placeholders). ``fp32_head``:
    vLLM's own switch for an fp32 LM head, ``head_dtype`` in the model's config (its logits processor then runs the
    head's product in fp32; otherwise in the model's dtype, its logits cast to fp32 only after it)."""
    base = base_model(model)
    config = base.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF-loaded model's weights are plain tensors by now
    config["architectures"] = [type(base).__name__]
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    if fp32_head and dtype in (torch.bfloat16, torch.float16):
        config["head_dtype"] = "float32"
    directory = tempfile.mkdtemp(prefix="grpolab-vllm-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


class _SharedLLM:
    """One started ``vllm.LLM``, the engine whose weights it holds, and how many adapter versions it was given (each
    version's id: vLLM keeps an adapter by its id)."""

    def __init__(self, llm):
        self.llm, self.owner, self.adapters = llm, None, 0


_STARTED: dict[str, _SharedLLM] = {}


def _start(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    s: VLLMSettings,
    lora: AdapterShape | None,
) -> _SharedLLM:
    """vLLM on the model's architecture, started once per process for each (architecture, settings, LoRA layers);
    ``lora``: with its LoRA layers, to serve such an adapter unmerged."""
    vllm = _import_vllm()
    base = base_model(model)
    limit = getattr(base.config, "max_position_embeddings", s.max_model_len) or s.max_model_len
    max_len = min(s.max_model_len, limit)
    lora_key = dataclasses.asdict(lora) if lora is not None else None
    key = json.dumps([base.config.to_json_string(), str(dtype), str(device), max_len, dataclasses.asdict(s), lora_key])
    if key in _STARTED:
        return _STARTED[key]
    kwargs = lora.start_options() if lora is not None else {}
    if device.type == "cuda":
        kwargs |= {"gpu_memory_utilization": s.memory, "enable_sleep_mode": s.sleep}
    # vLLM reseeds the global generators and replaces torch.set_num_threads while it starts: keep the trainer's.
    set_threads, threads, rng = torch.set_num_threads, torch.get_num_threads(), rng_state()
    try:
        llm = vllm.LLM(
            model=_config_dir(model, dtype, s.fp32_head),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_len,
            enforce_eager=s.eager,
            seed=seed,
            logprobs_mode="processed_logprobs",  # the distribution sampled from: after temperature and top-p
            generation_config="vllm",  # no sampling defaults from a generation_config.json
            enable_prefix_caching=True,
            # A prompt split over two engine steps (chunked prefill) draws a sample that is thrown away and rewinds
            # its generator: unsupported on the CPU ("CPU Generator does not use offset"), and a rollout's tokens
            # would depend on how its batch was chunked. Whole prompts only, as many as the budget holds.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_len, 16384),
            **kwargs,
        )
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        set_rng_state(rng)
    _STARTED[key] = _SharedLLM(llm)
    return _STARTED[key]


def architecture_reason(model: torch.nn.Module) -> str | None:
    """Why vLLM's implementation of the policy's architecture takes no LoRA adapter (GPT-2's), or None."""
    _import_vllm()
    from vllm.model_executor.models import ModelRegistry, supports_lora

    arch = type(base_model(model)).__name__
    registered = ModelRegistry.models.get(arch)
    if registered is None or not supports_lora(registered.load_model_cls()):
        return f"vLLM's {arch} takes no LoRA adapter"
    return None


CPU_LORA = (
    "vLLM's CPU build computes LoRA by copying each token's factors, which costs more generation time than the "
    "adapter-only sync saves (docs/vllm.md; --lora-sync adapter serves it unmerged all the same)"
)
"""Why ``--lora-sync auto`` merges on the CPU: there vLLM's LoRA layers gather a copy of the factors for every token
(``vllm.lora.ops.torch_ops``), most of a step's generation time on SmolLM2 (docs/vllm.md)."""


def lora_serving(model: torch.nn.Module, spec: EngineSpec, device: torch.device, say: Callable[[str], None]):
    """The adapter vLLM serves unmerged (its :class:`AdapterShape`), or None: every weight is pushed, the adapter
    merged in. None without LoRA, with ``--lora-sync merged``, and with ``auto`` where vLLM cannot serve it or is
    slower serving it (on the CPU: :data:`CPU_LORA`); ``say`` is then told why, in one line.

    Raises:
        ConfigError: ``--lora-sync adapter`` where vLLM cannot serve it (the reason in the message).
    """
    shape = adapter_shape(model)
    if shape is None or spec.lora_sync == "merged":
        return None
    reason = why_not_served(model, spec.vllm or VLLMSettings(), device)
    if reason is None and spec.lora_sync == "auto" and device.type == "cpu":
        reason = CPU_LORA
    reason = reason or architecture_reason(model)
    if reason is None:
        return shape
    if spec.lora_sync == "adapter":
        raise bad("lora_sync", f"adapter: vLLM cannot serve this LoRA adapter unmerged: {reason} (auto merges it)")
    say(f"--lora-sync auto: the LoRA adapter is merged into every weight sync to vLLM: {reason}")
    return None


def shutdown() -> None:
    """Stop every engine this process started: their memory is freed and vLLM's process group left (a later
    engine starts afresh)."""
    for shared in _STARTED.values():
        shared.llm.llm_engine.engine_core.shutdown()
    _STARTED.clear()


class VLLMEngine:
    """vLLM sampling from a copy of ``model``'s weights, pushed after every optimizer step.

    ``dtype``: the engine's (``--rollout-dtype``; default: the model's). ``full_weights``: a context inside which
    every parameter is whole on this process (FSDP). ``say``: told, in one line, why a LoRA adapter is merged under
    ``--lora-sync auto`` (:func:`lora_serving`). :attr:`adapter`: the adapter's shape when it is served unmerged,
    else None.
    """

    def __init__(self, model: torch.nn.Module, spec: EngineSpec, say: Callable[[str], None] = print):
        self.model, self.eos_id, self.pad_id, self.full_weights = model, spec.eos_id, spec.pad_id, spec.full_weights
        self.settings = spec.vllm or VLLMSettings()
        param = next(model.parameters())
        self.device = param.device
        self.dtype = spec.dtype or param.dtype  # vLLM casts each weight it is sent to its own dtype as it loads it
        self.adapter = lora_serving(model, spec, param.device, say)
        self._versions = AdapterVersions(model) if self.adapter is not None else None
        self._lora = None  # the LoRARequest of the adapter version every request is served with (unmerged)
        self._shared = _start(model, self.dtype, param.device, spec.seed, self.settings, self.adapter)
        self._asleep = False
        self._sent, self._sync_s = 0, 0.0
        self.sync()

    @property
    def llm(self):
        return self._shared.llm

    # ------------------------------------------------------------------ weights
    def sync(self) -> None:
        """Push the policy's current weights into the engine and drop its cache of old keys and values: every weight
        (a LoRA adapter merged in), or the base weights and then the adapter, served unmerged."""
        t0, llm = time.perf_counter(), self.llm
        if self._asleep:
            llm.wake_up(tags=["weights"])
        with torch.no_grad(), self.full_weights():
            weights = list(served_weights(self.model) if self.adapter is None else base_weights(self.model))
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})  # vLLM drops its adapters
            sent = tensor_bytes(t for _, t in weights)
            if self.adapter is not None:
                sent += self._push_adapter()
        if self._asleep:
            llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        llm.reset_prefix_cache()
        self._shared.owner = self
        self._count(sent, t0)

    def weights_changed(self) -> None:
        """After an optimizer step: the adapter alone when it is served unmerged (the base does not train), else
        every weight."""
        if self.adapter is None or self._shared.owner is not self:
            self.sync()
            return
        t0 = time.perf_counter()
        with torch.no_grad(), self.full_weights():
            sent = self._push_adapter()
        self.llm.reset_prefix_cache()  # a new version's name keeps its prompts' blocks apart already; no old ones kept
        self._count(sent, t0)

    def _push_adapter(self) -> int:
        """Hand vLLM the adapter's current version under a new id, loaded now (not at the next generation) in place
        of the last one (one adapter at a time); the bytes of its factors."""
        from vllm.lora.request import LoRARequest

        sent = self._versions.write(self.model)
        self._shared.adapters += 1
        version = self._shared.adapters
        self._lora = LoRARequest(f"grpolab-policy-{version}", version, self._versions.path)
        self.llm.llm_engine.add_lora(self._lora)
        return sent

    def _count(self, sent: int, t0: float) -> None:
        self._sent += sent
        self._sync_s += time.perf_counter() - t0

    def pop_metrics(self) -> dict[str, float]:
        """The weight syncs since the last call (the start's included in the first): ``vllm/sync_bytes``, the bytes
        of the tensors handed to the engine in the dtype they were handed in (every weight under each of its names;
        unmerged, the base at start and then the adapter's factors), and ``vllm/sync_s``, their seconds."""
        got = {"vllm/sync_bytes": self._sent, "vllm/sync_s": self._sync_s}
        self._sent, self._sync_s = 0, 0.0
        return got

    def _ready(self) -> None:
        """Before the engine computes: it holds this engine's weights (another engine in this process may have
        pushed its own since) and is awake (--vllm-sleep puts it to sleep after each generation)."""
        if self._shared.owner is not self or self._asleep:
            self.sync()

    # ------------------------------------------------------------------ sampling
    def generate(
        self, prompts: list[list[int]], keys: list[tuple[int, ...]], settings: SamplingSettings, media=None
    ) -> Sampled:
        """One completion per prompt from vLLM, row n with its own ``SamplingParams(seed=...)`` from ``keys[n]``.
        The engine first takes this engine's weights if another engine's were pushed since (or it slept); with
        ``--vllm-sleep`` on CUDA it is put to sleep again afterwards.

        Args:
            prompts (list[list[int]]): N prompts' token ids, unpadded: B prompts, each repeated G times, N = B*G.
            keys (list[tuple[int, ...]]): [N] rollout keys; ``keys[n]`` seeds row n's generator (:func:`rollout_seed`;
                unseeded at temperature 0, which is greedy).
            settings (SamplingSettings): ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` (0: off, vLLM's
                own off value), ``min_p``, ``repetition_penalty`` and ``ignore_eos``, for every row; ``prompt_width``
                is not read (vLLM takes each prompt unpadded).
            media (Sequence[Media | None] | None): None, or no row with images: this engine takes text prompts only.

        Returns:
            Sampled: on the policy's device: ``batch`` (``prompt_ids``, ``prompt_mask`` [N, P], P the longest prompt;
                ``completion_ids``, ``completion_mask`` [N, T], T the longest completion, at least 1 and at most
                ``max_new_tokens``; no ``media``), ``logprobs`` [N, T] vLLM's log-prob of each sampled token under
                the distribution it sampled from (its ``processed_logprobs``: after the repetition penalty, the
                temperature, min-p, top-k and top-p, :mod:`grpolab.models.sampling_rules`; 0 on padding), and
                ``entropy`` None (vLLM does not return it).

        Raises:
            NotImplementedError: a row with images (grpolab's own sampler, ``--rollout-engine hf``, draws those).
        """
        text_only(media, "the vllm engine")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._ready()
        params = [
            SamplingParams(
                n=1,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                min_p=settings.min_p,
                repetition_penalty=settings.repetition_penalty,
                max_tokens=settings.max_new_tokens,
                seed=rollout_seed(k) if settings.temperature > 0 else None,
                logprobs=0,  # the sampled token's own log-prob
                stop_token_ids=[] if settings.ignore_eos else [self.eos_id],
                ignore_eos=settings.ignore_eos,
                detokenize=False,
            )
            for k in keys
        ]
        prompts_in = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = self.llm.generate(prompts_in, params, use_tqdm=False, lora_request=self._lora)
        if self.settings.sleep and self.device.type == "cuda":
            self.llm.sleep(level=2)  # the next sync brings the weights back
            self._asleep = True
        return self._sampled(prompts, [o.outputs[0] for o in outs])

    def score(self, batch: Batch) -> torch.Tensor:
        """``[N, T]`` the engine's log-prob of each completion token of ``batch`` at temperature 1 (0 on padding):
        what the engine computes for tokens it did not sample, to compare with the trainer's."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._ready()
        seqs = []
        for pi, pm, ci, cm in zip(*(t.cpu() for t in batch.tensors)):
            seqs.append((pi[pm.bool()].tolist(), ci[cm.bool()].tolist()))
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts_in = [TokensPrompt(prompt_token_ids=p + c) for p, c in seqs]
        outs = self.llm.generate(prompts_in, params, use_tqdm=False, lora_request=self._lora)
        logp = torch.zeros(batch.completion_ids.shape)
        for i, ((p, c), out) in enumerate(zip(seqs, outs)):
            scored = out.prompt_logprobs[len(p) : len(p) + len(c)]  # entry j: log p(token j | tokens < j)
            logp[i, : len(c)] = torch.tensor([lp[t].logprob for lp, t in zip(scored, c)])
        return logp.to(self.device)

    def _sampled(self, prompts: list[list[int]], completions) -> Sampled:
        """The engine's outputs as a :class:`Sampled` batch: prompts left-padded, completions right-padded."""
        N = len(prompts)
        T = max(1, max(len(c.token_ids) for c in completions))
        ids = torch.full((N, T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, T), dtype=torch.long)
        logp = torch.zeros((N, T))
        for i, c in enumerate(completions):
            n = len(c.token_ids)
            ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
            mask[i, :n] = 1
            if c.logprobs is not None:
                logp[i, :n] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)
        batch = Batch(*(t.to(self.device) for t in (prompt_ids, prompt_mask, ids, mask)))
        return Sampled(batch, logp.to(self.device), None)
