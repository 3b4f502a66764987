"""How the update's forward and backward passes run: on one process, data-parallel (DDP), or sharded (FSDP2).

The module that DDP or ``fully_shard`` wraps is :class:`LogProbs`, the training forward
itself (completion log-probs of a batch), not the Hugging Face model: every
gradient-carrying forward must pass through the wrapper's hooks, and the chunked LM-head
path of :func:`grpolab.models.logprobs.completion_logprobs` calls the decoder and the head
separately, which a wrapper around the model's ``forward`` would not see.

Gradients: DDP and FSDP2 both *average* over ranks. Each rank's loss is its share of the
global loss (global normalisers), so the driver scales it by the number of ranks
(:attr:`TrainModule.loss_scale`) to make the average the global sum.

Precision (``grpolab.common.precision``): the forward runs under the precision's autocast and, with ``--fp32-head``,
its LM head in fp32 (:mod:`grpolab.models.head`), inside the wrapper, so every forward through it (the policy's, the
reference's) computes alike and the backward follows. Under a mixed precision the weights are fp32 masters, so DDP
reduces fp32 gradients; FSDP2 is told to reduce in fp32 too (its ``MixedPrecisionPolicy``), which also upcasts the
bf16 gradients of bf16-true for the reduction. FSDP2 gathers the weights in their own dtype and autocast casts each
product's, as on one process: gathering bf16 copies instead would halve the all-gather's bytes but round the norms'
and the head's weights, which one process does not do.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from grpolab.common.batch import Batch
from grpolab.common.distributed import SINGLE, World
from grpolab.common.precision import Precision
from grpolab.models.head import fp32_head
from grpolab.models.logprobs import completion_divergence, completion_hidden, completion_logprobs
from grpolab.models.sampling_rules import NO_RULES, SamplingRules
from grpolab.models.shared_prefix import unsupported_reason


class LogProbs(nn.Module):
    """``[N, T]`` log-probs of a batch's completion tokens under ``model``, as a module.

    ``shared_prefix``: rows with the same prompt share one prompt pass (grpolab.models.shared_prefix).
    ``packed``: the rows run as one padding-free sequence (grpolab.models.logprobs).
    ``precision``: the autocast and head the forward runs under (the module docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        temperature: float = 1.0,
        shared_prefix: bool = False,
        packed: bool = False,
        precision: Precision | None = None,
    ):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.shared_prefix = shared_prefix
        self.packed = packed
        self.precision = precision or Precision()

    def forward(
        self,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        media=None,
        entropy: bool = False,
        rules: SamplingRules = NO_RULES,
        teacher: tuple | None = None,
    ) -> torch.Tensor:
        """``[N, T]`` log-probs; ``media``: the rows' images (:class:`grpolab.common.batch.Batch`); ``entropy``:
        ``[N, T, 2]``, each position's log-prob and entropy; ``rules`` on (top-p < 1, top-k, min-p, a repetition
        penalty): one more column, the sampling distribution's offset, the log nucleus mass for top-p alone
        (:func:`grpolab.models.logprobs.completion_logprobs`). ``teacher``: ``(hidden [M, d_t], head, beta)``, a
        teacher's hidden states at the M real completion tokens: ``[N, T, 2]``, each token's log-prob and the
        divergence from the teacher there (:func:`grpolab.models.logprobs.completion_divergence`)."""
        batch = Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, media)
        with self.precision.autocast(prompt_ids.device), fp32_head(self.model, self.precision.head_fp32):
            if teacher is not None:
                hidden, head, beta = teacher
                return completion_divergence(
                    self.model, batch, hidden, head, beta, self.temperature, packed=self.packed
                )
            return completion_logprobs(
                self.model,
                batch,
                self.temperature,
                shared_prefix=self.shared_prefix,
                packed=self.packed,
                entropy=entropy,
                rules=rules,
            )


def _layer_modules(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one: the classes a Hugging Face model lists in ``_no_split_modules``
    (its decoder layers); none for other models (then the whole model is one shard group)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(module: LogProbs) -> LogProbs:
    """FSDP2: shard each decoder layer, then the rest (embeddings, final norm, head) as the root group; gradients
    reduced in fp32 where the weights or the products are in less (the module docstring).

    The device mesh is built on the parameters' device type: left to itself, ``fully_shard``
    would take the machine's accelerator even for a model on the CPU. So FSDP's collectives go
    where the tensors are: gloo for CPU tensors, nccl for CUDA ones (grpolab.common.distributed.backend).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param = next(module.parameters())
    mesh = init_device_mesh(param.device.type, (dist.get_world_size(),))
    low = param.dtype in (torch.bfloat16, torch.float16) or module.precision.mixed
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for layer in _layer_modules(module.model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


# completion_logprobs' keyword for a variant of the update's forward -> its flag, what a model must take, the fallback
_VARIANTS = {
    "shared_prefix": ("--shared-prefix", "a shared prompt cache", "each rollout's prompt is encoded in the update"),
    "packed": ("--packing", "packed rows", "the update pads its rows"),
}


def _supported(model: nn.Module, temperature: float, variant: str, log) -> bool:
    """Whether ``model`` runs the update's forward with ``variant`` on (a keyword of :func:`completion_logprobs`) and
    matches the plain path (grpolab.models.shared_prefix.unsupported_reason); if not, ``log`` says why, one line."""
    reason = unsupported_reason(model, lambda m, b, on: completion_logprobs(m, Batch(*b), temperature, **{variant: on}))
    if reason:
        flag, what, instead = _VARIANTS[variant]
        log(f"notice: {flag}: {type(model).__name__} cannot take {what} ({reason}); {instead} (as with {flag} off)")
    return not reason


class TrainModule:
    """The policy as the update sees it: log-probs, gradient synchronisation, full weights for sampling.

    ``world.size == 1``: the plain model. Otherwise DDP over the replicated model, or with
    ``fsdp`` FSDP2 over a sharded one (parameters, gradients and optimizer state split over ranks).
    """

    def __init__(
        self,
        model: nn.Module,
        temperature: float,
        world: World = SINGLE,
        fsdp: bool = False,
        shared_prefix: bool = False,
        packing: bool = False,
        log=print,
        precision: Precision | None = None,
        images: bool = False,
    ):
        """``shared_prefix``: encode each group's prompt once in the update, if the model can (checked here on a tiny
        batch against the plain path, on the whole model before any wrapper; if not, ``log`` says why, one line).
        ``packing``: run each pass's rows as one padding-free sequence, if the model can (checked the same way); it
        replaces the shared prefix. ``precision``: what the forward computes in (the module docstring). ``images``: the
        rows may carry images (a vision-language policy), which the packed forward does not take: it is off, said in
        one line when asked for."""
        self.world, self.fsdp = world, fsdp and world.distributed
        if images and packing:
            log("notice: --packing takes text rows only; rows with images run padded, each group's prompt encoded "
                "once (the shared prefix)")  # fmt: skip
            packing = False
        if packing:
            packing = _supported(model, temperature, "packed", log)
            shared_prefix = shared_prefix and not packing
        if shared_prefix:
            shared_prefix = _supported(model, temperature, "shared_prefix", log)
        self.module = LogProbs(model, temperature, shared_prefix, packing, precision)
        self._gathered = False  # inside full_weights
        self.wrapped: nn.Module = self.module
        device = next(model.parameters()).device
        if self.fsdp:
            self.wrapped = shard(self.module)
            # FSDP2 sets up its state on the root's first forward. Sampling calls the inner model
            # directly, so do that first forward here (every rank: it is a collective), or a layer
            # would take itself for the root.
            one = torch.ones(1, 1, dtype=torch.long, device=device)
            with torch.no_grad():
                self.wrapped(one, one, one, one)
            # The root stays gathered after a forward (FSDP expects the backward next): reshard it, so
            # that the parameters an optimizer is built from now are the shards, not the gathered copies.
            for m in self._fsdp_groups():
                m.reshard()
        elif world.distributed and any(p.requires_grad for p in model.parameters()):  # a frozen reference needs no DDP
            from torch.nn.parallel import DistributedDataParallel as DDP

            # CPU: no device_ids; CUDA: this process's GPU. Buffers (rotary tables) are equal on every rank: not re-synced.
            ids = [device.index] if device.type == "cuda" else None
            self.wrapped = DDP(self.module, device_ids=ids, forward_sync_buffers=False)

    @property
    def packing(self) -> bool:
        """Whether the update runs each pass's rows packed, without padding (False after a fallback)."""
        return self.module.packed

    @property
    def shared_prefix(self) -> bool:
        """Whether the update encodes each group's prompt once (False after a fallback)."""
        return self.module.shared_prefix

    @property
    def loss_scale(self) -> float:
        """Multiply each rank's loss by this before backward: DDP/FSDP average, the loss is a sum over ranks."""
        return float(self.world.size)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """``[n, T]`` completion log-probs, through the DDP/FSDP wrapper when there is one."""
        return self.wrapped(*batch)

    def scores(self, batch: Batch, entropy: bool = False, rules: SamplingRules = NO_RULES) -> tuple[torch.Tensor, ...]:
        """From one forward through the wrapper: ``[n, T]`` completion log-probs, then (``entropy``) the entropy at
        each completion position, both differentiable (the entropy bonus), then (``rules`` on: top-p < 1, top-k,
        min-p, a repetition penalty) log pi_T - log p_sampling of each token there, no gradient (top-p alone: the
        log mass top-p sampling keeps; :func:`grpolab.models.sampling_rules.sampling_log_offset`)."""
        if not entropy and rules.full_support:
            return (self.logprobs(batch),)
        out = self.wrapped(*batch, entropy=entropy, rules=rules)  # [n, T, k]
        return out.unbind(dim=-1)

    def divergence(self, batch: Batch, teacher: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """From one forward through the wrapper: ``[n, T]`` completion log-probs and the divergence from a teacher at
        each (``teacher``: :meth:`LogProbs.forward`'s), both differentiable."""
        return self.wrapped(*batch, teacher=teacher).unbind(dim=-1)

    @torch.no_grad()
    def hidden(self, batch: Batch) -> torch.Tensor:
        """``[M, d]`` the last hidden states at the batch's M real completion tokens (a teacher's, for a divergence:
        :func:`grpolab.models.logprobs.completion_hidden`), under the forward's precision; no gradient."""
        module = self.module
        with module.precision.autocast(batch.prompt_ids.device):
            return completion_hidden(module.model, batch, packed=module.packed)

    @contextlib.contextmanager
    def sync(self, enabled: bool):
        """Backward passes inside reduce gradients over ranks only if ``enabled`` (the last micro-batch)."""
        if self.fsdp:
            self.wrapped.set_requires_gradient_sync(enabled)
            try:
                yield
            finally:
                self.wrapped.set_requires_gradient_sync(True)
        elif self.world.distributed and not enabled:
            with self.wrapped.no_sync():
                yield
        else:
            yield

    @contextlib.contextmanager
    def full_weights(self):
        """Inside: every parameter whole on every rank, so each rank may run any number of forwards
        (sampling stops when a rank's own rollouts finish). Only FSDP does anything here: all-gather
        every shard group once, keep it gathered through the forwards, reshard at the end. Nested blocks
        gather once: the outermost one reshards."""
        if not self.fsdp or self._gathered:
            yield
            return
        self._gathered = True
        try:
            with self._gather():
                yield
        finally:
            self._gathered = False

    @contextlib.contextmanager
    def _gather(self):
        """Every FSDP group unsharded for the block, resharded after it."""
        groups = self._fsdp_groups()
        for m in groups:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in groups:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    def _fsdp_groups(self) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.wrapped.modules() if isinstance(m, FSDPModule)]

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Global gradient norm (all ranks' shards under FSDP), after clipping to ``max_norm``."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Whole model and optimizer state dicts, gathered from every rank's shards onto rank 0's CPU
        (a collective: every rank calls it; the others get empty dicts). Optimizer state is keyed by
        parameter name, the form :func:`grpolab.models.checkpoint.load_training_state` reads on any process count."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = self.module.model
        state = get_model_state_dict(model, options=opts)
        # A tied parameter (input embedding = LM head) comes back under each of its names; keep the
        # first, as save_pretrained does for an unsharded model, so both checkpoints look alike.
        seen, aliases = set(), []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                aliases.append(name)
            seen.add(id(p))
        for name in aliases:
            state.pop(name, None)
        return state, get_optimizer_state_dict(model, optimizer, options=opts)
