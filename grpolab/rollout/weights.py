"""The weights a rollout engine samples with, and how they follow the trainer's.

Both engines may hold their own copy of the policy: vLLM always (``grpolab.rollout.vllm_engine``), grpolab's sampler
when it samples in another dtype than the trainer's (``--rollout-dtype``) or when its linear layers are packed for
the CPU's matrix kernels (:mod:`grpolab.models.packed_linear`). Either copy is refreshed from the trainer's weights
at every weight sync, cast to the engine's dtype; the trainer keeps its own weights and dtype.

:func:`served_weights` is what every copy is made from: the policy's weights under transformers' names, a LoRA
adapter folded into its layer.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from grpolab.models.attention import NAME as ATTENTION_NAME
from grpolab.models.attention import (
    ROUNDING,
    attention_rounding,
    register_grouped_sdpa,
    upcast_dtype,
    use_grouped_sdpa,
)
from grpolab.models.decode_cache import SlabCache, model_cache
from grpolab.models.fused_decode import CastInput, FusedDecoder, fused_supported
from grpolab.models.packed_linear import PackedLinear, PlainLinear, packing_available, worth_packing
from grpolab.rollout.lora_merge import LoraFactors, lora_layers, merge_lora, unplain


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def served_weights(model: nn.Module, unmerged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights an engine serves, under transformers' names: with LoRA, each adapted layer's base weight plus
    the adapter's delta (a new tensor; the training weights are not touched). A tied weight is given under each
    of its names: vLLM's loader needs ``lm_head.weight`` even for a tied model. ``unmerged`` (with the layers
    :func:`lora_layers` describes): each adapted layer's base weight as it is, and its factors beside it under the
    names :class:`LoraFactors` gives (what a generator merges itself,
    :func:`grpolab.rollout.lora_merge.merged_served`)."""
    base = base_model(model)
    modules = dict(base.named_modules())
    for name, tensor in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue  # the adapter's own factors: folded into their layer's weight below
        if ".base_layer." in name:  # a LoRA-wrapped layer: name.base_layer.weight -> name.weight
            layer, _, leaf = name.partition(".base_layer.")
            if leaf == "weight" and unmerged:
                lora = modules[layer]
                (adapter,) = lora.active_adapters
                yield f"{layer}.lora_A", lora.lora_A[adapter].weight.detach()
                yield f"{layer}.lora_B", lora.lora_B[adapter].weight.detach()
            elif leaf == "weight":
                tensor = _merged(modules[layer], tensor)
            name = f"{layer}.{leaf}"
        yield name, tensor.detach()


def _merged(lora, weight: torch.Tensor) -> torch.Tensor:
    """``weight + sum of the active adapters' deltas`` as a new tensor (:func:`merge_lora` for a plain LoRA linear
    layer, peft's own ``get_delta_weight`` for the others)."""
    merged, owned = weight.detach(), False
    for adapter in lora.active_adapters:
        if adapter not in lora.lora_A:
            continue
        if unplain(lora, adapter) is None:
            a, b = lora.lora_A[adapter].weight, lora.lora_B[adapter].weight
            merged = merge_lora(merged, a, b, lora.scaling[adapter], lora.fan_in_fan_out)
        else:
            merged = merged if owned else merged.clone()
            merged += lora.get_delta_weight(adapter).to(merged.dtype)
        owned = True
    return merged if owned else merged.clone()


def product_weights(model: nn.Module, fp32_head: bool = False) -> set[str]:
    """The served weights (transformers' names) a sampler's copy reads only as a matrix product's operand, each cast
    to its products' dtype as it loads (:class:`SamplerWeights`, the fused decoder): every linear layer's weight,
    the LM head's too unless ``fp32_head`` keeps it in its own dtype, less a tensor also served under another name
    (a tied embedding, which the copy keeps in its storage dtype). A sampler that computes as autocast does takes
    these in the products' dtype, bit for bit what it would cast them to."""
    base = base_model(model)
    head = _head_name(base)
    linear = {
        f"{name.replace('.base_layer', '')}.weight"
        for name, m in base.named_modules()
        if isinstance(m, nn.Linear) and ".lora_" not in name and not (fp32_head and name == head)
    }
    names: dict[int, set[str]] = {}
    for name, t in base.named_parameters(remove_duplicate=False):
        names.setdefault(t.data_ptr(), set()).add(name.replace(".base_layer", ""))
    shared = {n for group in names.values() if len(group) > 1 and not group <= linear for n in group}
    return linear - shared


def sent_lora(model: nn.Module, lora_sync: str, dtype: torch.dtype | None = None) -> tuple[dict[str, LoraFactors], str]:
    """The adapted layers a generator process or worker is sent unmerged under ``--lora-sync`` (``auto`` and
    ``adapter``: every LoRA layer, when :func:`lora_layers` can describe them all; ``merged``: none), their merged
    weights served in ``dtype``; and, when a LoRA policy's weights go merged after all, why ("" otherwise)."""
    if lora_sync == "merged":
        return {}, ""
    layers = lora_layers(base_model(model).named_modules(), dtype)
    if isinstance(layers, str):
        return {}, f"--lora-sync {lora_sync}: the LoRA weights go merged ({layers}: the generator cannot merge them)"
    return layers, ""


class SamplerWeights:
    """The model grpolab's sampler runs: the policy's own, or a copy in ``dtype`` refreshed at :meth:`sync`.

    A copy is made when ``dtype`` is not the policy's, or when ``pack``, the CPU's oneDNN kernels run in ``dtype``
    (:func:`grpolab.models.packed_linear.packing_available`) and the model has linear layers large enough to gain
    from them: then each such layer of the copy is a :class:`PackedLinear`. A copy of a Llama-layout model also gets
    a :class:`grpolab.models.fused_decode.FusedDecoder` (:attr:`decoder`) for its decode steps, checked against the
    policy's own forward first (:attr:`note` says why there is none). Otherwise the sampler runs the policy's live
    weights, as before any of this (and a sync does nothing). A copy attends with
    :func:`grpolab.models.attention.grouped_sdpa_forward`, which takes a decode cache of another dtype (fp32 under
    bf16 on the CPU).

    ``full_weights``: a context inside which every parameter is whole on this process (FSDP). ``fuse``: allow the
    fused decoder; ``always_copy``: make a copy even where the live weights would do (tests compare the two).
    ``head_dtype`` (``--fp32-head``): the copy's LM head in this dtype, on inputs cast to it; the live weights'
    head is the caller's (:func:`grpolab.models.head.fp32_head`). ``storage``: the copy's dtype outside its linear
    layers when it is not ``dtype``; the copy then computes as autocast does for a bf16-mixed trainer: embeddings,
    norms and the residual stream in ``storage`` (fp32), every linear layer's product in ``dtype`` on its input cast
    to it, and attention on queries, keys and values rounded to ``dtype`` (``grpolab.models.attention``), so that
    sampler and trainer differ by their kernels alone.

    ``max_staleness`` K >= 1 (``--max-staleness``): the copy (always one) is refreshed K syncs late. Each
    :meth:`sync` keeps a snapshot of the policy's weights and loads the one taken K syncs before, so after the s-th
    sync the copy holds the weights of sync s - K (the starting ones while s <= K: :func:`held_version`): the
    rollouts of step t are drawn with the weights after step t - K - 1, exactly those. :attr:`version` is the number of the sync whose weights the copy holds
    (0: the starting weights); :meth:`current` loads the policy's current weights for the time of a block (a
    held-out evaluation) and puts the stale ones back after it.
    """

    def __init__(
        self,
        policy: nn.Module,
        dtype: torch.dtype,
        pack: bool = True,
        full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        fuse: bool = True,
        always_copy: bool = False,
        max_staleness: int = 0,
        head_dtype: torch.dtype | None = None,
        storage: torch.dtype | None = None,
    ):
        self.policy, self.dtype, self.full_weights = policy, dtype, full_weights
        self.head_dtype = None if head_dtype == dtype else head_dtype
        self.storage = storage or dtype
        self.mixed = self.storage != dtype
        self.max_staleness, self.version, self.syncs = max_staleness, 0, 0
        self._pending: collections.deque[tuple[int, dict[str, torch.Tensor]]] = collections.deque()
        self._serving: dict[str, torch.Tensor] | None = None  # K >= 1: the weights the copy holds
        param = next(policy.parameters())
        self.pack = (
            pack
            and param.device.type == "cpu"
            and packing_available(dtype)
            and any(worth_packing(m) for m in base_model(policy).modules())
        )
        self.copied = always_copy or max_staleness > 0 or self.pack or dtype != param.dtype or self.mixed
        self.decoder: FusedDecoder | None = None
        self.note: str | None = None
        """Why the copy has no fused decoder (None when it has one, or there is no copy)."""
        self.model = policy
        if not self.copied:
            return
        with self._served() as served:
            self.note = fused_supported(base_model(policy)) if fuse else "fusion off"
            if self.note is None:
                self.model, self.decoder, self._targets = self._build_fused(served)
                self.note = _check(self.policy, self.model, self.decoder, self.full_weights, dtype)
                if self.note:
                    self.decoder = None
            if self.decoder is None:
                self.model, self._targets = self._build_packed(served)
            if max_staleness:
                self._serving = snapshot(served)

    @contextlib.contextmanager
    def _served(self) -> Iterator[dict[str, torch.Tensor]]:
        """The policy's served weights, valid inside the block (under FSDP they are views of the gathered shards,
        released when it ends)."""
        with torch.no_grad(), self.full_weights():
            yield dict(served_weights(self.policy))

    def _build_packed(self, served: dict) -> tuple[nn.Module, dict]:
        """A copy whose large linear layers are :class:`PackedLinear` (when packing runs here), and, per served
        weight, what loads a new value of it."""
        model = self._copy_skeleton()
        params = dict(model.named_parameters(remove_duplicate=False))
        targets = {name: _copier(params[name], self.storage) for name in served if name in params}
        head = _head_name(model)
        for name, module in list(model.named_modules()):
            if (
                not isinstance(module, nn.Linear)
                or f"{name}.weight" not in served
                or (self.head_dtype and name == head)
            ):
                continue
            if self.pack and worth_packing(module):
                layer = PackedLinear()
            elif self.mixed:  # every product in the compute dtype, as under autocast
                layer = PlainLinear()
            else:
                continue
            _replace(model, name, layer)
            targets[f"{name}.weight"] = _repacker(layer, f"{name}.bias", self.dtype)
            targets.pop(f"{name}.bias", None)  # loaded with its weight
        if self.head_dtype is not None and head is not None:  # --fp32-head: the head alone in its own dtype
            inner = PackedLinear() if self.pack and packing_available(self.head_dtype) else PlainLinear()
            _replace(model, head, CastInput(inner, self.head_dtype))
            targets[f"{head}.weight"] = _repacker(inner, f"{head}.bias", self.head_dtype)
            targets.pop(f"{head}.bias", None)
        _load(targets, served)
        return model, targets

    def _build_fused(self, served: dict) -> tuple[nn.Module, FusedDecoder, dict]:
        """A copy whose projections are the fused decoder's products; its other parameters (embedding, norms) are
        loaded by the returned targets, the products by :meth:`FusedDecoder.load`."""
        model = self._copy_skeleton()
        decoder = FusedDecoder(model, PackedLinear if self.pack else PlainLinear, self.head_dtype)
        decoder.attach()
        params = dict(model.named_parameters(remove_duplicate=False))
        targets = {name: _copier(params[name], self.storage) for name in served if name in params}
        decoder.load(served, self.dtype)
        left = set(served) - set(targets) - decoder.read
        if left:
            raise ValueError(f"the sampler's copy of the model has no place for {sorted(left)[:3]}")
        _load(targets, served)
        return model, decoder, targets

    def _copy_skeleton(self) -> nn.Module:
        """The copy's model in :attr:`storage`, its parameters not yet filled; a mixed copy's attention rounds to the
        products' dtype."""
        model = _skeleton(base_model(self.policy), self.storage, next(self.policy.parameters()).device)
        if self.mixed:  # on the language model's own config too: a vision-language model's attention reads that one
            for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
                setattr(config, ROUNDING, str(self.dtype).removeprefix("torch."))
        return model

    def sync(self) -> None:
        """Refresh the copy from the policy's current weights (nothing to do without a copy); with a staleness K >= 1,
        keep them and load those of K syncs before."""
        if not self.copied:
            return
        self.syncs += 1
        if not self.max_staleness:
            with self._served() as served:
                self._load_served(served)
            return
        with self._served() as served:
            self._pending.append((self.syncs, snapshot(served)))
        if len(self._pending) > self.max_staleness:
            self.version, self._serving = self._pending.popleft()
            self._load_served(self._serving)

    @property
    def held(self) -> dict[str, torch.Tensor] | None:
        """With a staleness K >= 1: the served weights the copy holds now (under transformers' names), those of sync
        :attr:`version`; None without one."""
        return self._serving

    def held_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """With a staleness K >= 1: what a checkpoint keeps of it (:func:`held_state`), so that a resumed run draws
        what the uninterrupted one would."""
        return held_state(self.version, self.syncs, self._serving or {}, list(self._pending))

    def restore_held(self, counts: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`held_state`'s weights and counts, and load the held weights into the copy."""
        self.version, self.syncs = counts["version"], counts["syncs"]
        self._serving, pending = restored_held(counts, tensors)
        self._pending = collections.deque(pending)
        self._load_served(self._serving)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The policy's current weights in the copy inside the block, the lagged ones back after it (K = 0: the
        copy holds the current weights already)."""
        if not self.max_staleness:
            yield
            return
        with self._served() as served:
            self._load_served(served)
        try:
            yield
        finally:
            self._load_served(self._serving)

    def _load_served(self, served: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            _load(self._targets, served)
            if self.decoder is not None:
                self.decoder.load(served, self.dtype)


def snapshot(served: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of served weights that later updates of their source do not change. A tied weight (one tensor, or
    views of the same memory, under several names) stays one tensor."""
    copies: dict[tuple, torch.Tensor] = {}
    return {name: copies.setdefault((t.data_ptr(), t.shape, t.dtype), t.detach().clone()) for name, t in served.items()}


def held_version(syncs: int, max_staleness: int) -> int:
    """The weight version a step draws with after ``syncs`` weight syncs under --max-staleness K = ``max_staleness``:
    sync ``syncs - K``, or the starting weights (0) while fewer than K syncs have run. The one rule every engine that
    holds stale weights keeps (grpolab's sampler, the generator process, the workers' pool); a version older than
    it is no longer needed."""
    return max(0, syncs - max_staleness)


def held_state(
    version: int, syncs: int, held: dict[str, torch.Tensor], pending: list[tuple[int, dict[str, torch.Tensor]]]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The form a checkpoint keeps the held versions in, whichever engine held it: the counts (the held weights' sync
    ``version``, the ``syncs`` so far, the pending syncs' numbers) and the tensors, ``held/<name>`` and
    ``<sync>/<name>``."""
    tensors = {f"held/{n}": t for n, t in held.items()}
    for v, served in pending:
        tensors.update({f"{v}/{n}": t for n, t in served.items()})
    return {"version": version, "syncs": syncs, "pending": [v for v, _ in pending]}, tensors


def restored_held(counts: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, list[tuple[int, dict]]]:
    """:func:`held_state`'s form read back: the held weights and the pending ``(sync, weights)`` in order."""

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {n[len(prefix) + 1 :]: t for n, t in tensors.items() if n.startswith(prefix + "/")}

    return part("held"), [(v, part(str(v))) for v in counts["pending"]]


def _load(targets: dict, served: dict) -> None:
    with torch.no_grad():
        for name, load in targets.items():
            load(served[name], served)


def _check(policy: nn.Module, model: nn.Module, decoder: FusedDecoder, full_weights, dtype: torch.dtype) -> str | None:
    """None if a prefill through the copy's forward and one fused decode step give the policy's own last logits
    (to the copy's precision), else what differs. Two rows of four tokens, one left-padded."""
    param = next(policy.parameters())
    vocab = model.config.vocab_size
    ids = torch.tensor([[3, 5, 7, 11], [0, 13, 17, 19]], device=param.device) % vocab  # [2, 4]
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]], device=param.device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), full_weights():
        was = policy.training
        policy.eval()
        want = policy(input_ids=ids, attention_mask=mask, position_ids=position).logits[:, -1].float()  # [2, V]
        policy.train(was)
    with torch.no_grad():
        prefill = model_cache(model)  # the model's own kind (fused_supported: plain full-attention layers)
        model(input_ids=ids[:, :3], attention_mask=mask[:, :3], position_ids=position[:, :3], past_key_values=prefill)
        decoder.forget()
        rows = torch.arange(2, device=param.device)
        cache = SlabCache.from_prefill(prefill, rows, 4, upcast_dtype(model), attention_rounding(model))
        got = decoder.step(ids[:, 3], position[:, 3], mask, cache).float()
    err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3  # the products' dtype
    return None if err <= tol else f"its fused decode step differs from the model's forward by {err:.2g} (relative)"


def _head_name(model: nn.Module) -> str | None:
    """The module name of ``model``'s LM head (its output embedding), or None."""
    head = model.get_output_embeddings()
    return next((name for name, m in model.named_modules() if m is head), None)


def _skeleton(base: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A model of ``base``'s class and config in ``dtype``, its parameters not yet filled (the buffers, such as
    rotary tables, copied from ``base``), in eval mode, attending with grpolab's sdpa function."""
    return skeleton(type(base), base.config, dict(base.named_buffers()), dtype, device)


def skeleton(
    model_class: type,
    config,
    buffers: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    grouped: bool = True,
) -> nn.Module:
    """A ``model_class(config)`` in ``dtype`` on ``device``, its parameters not yet filled, its buffers (rotary
    tables) ``buffers``'s, in eval mode and without gradients. ``grouped``: attending with grpolab's sdpa function
    (:func:`grpolab.models.attention.grouped_sdpa_forward`); else with the attention ``config`` names."""
    config = copy.deepcopy(config)  # its own: setting the copy's attention must not touch the policy's
    if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
        register_grouped_sdpa()  # a process that never loaded the policy builds a model naming it
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    model.to_empty(device=device).eval()
    for name, _ in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        # Buffers (rotary tables) are in no checkpoint: the policy's own, in their own dtype (fp32 rotary
        # frequencies stay fp32 under a bf16 copy, as in a model loaded in bf16)
        model.get_submodule(owner)._buffers[leaf] = buffers[name].to(device).clone()
    if grouped:
        use_grouped_sdpa(model, always=True)
    return model.requires_grad_(False)


def _copier(param: torch.Tensor, dtype: torch.dtype):
    """Loads a served tensor into ``param``, cast to ``dtype``."""

    def load(tensor: torch.Tensor, served: dict) -> None:
        param.data.copy_(tensor.to(dtype))

    return load


def _repacker(layer: PackedLinear, bias_name: str, dtype: torch.dtype):
    """Repacks ``layer`` from a served weight (and the served bias of that name, if any), cast to ``dtype``."""

    def load(weight: torch.Tensor, served: dict) -> None:
        bias = served.get(bias_name)
        layer.load(weight.to(dtype), None if bias is None else bias.to(dtype))

    return load


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
