"""One decode step of a Llama-layout model from fused weights: the sampler's fast path.

transformers' forward runs each decoder layer as some sixty small operations: three projections for the query, key
and value, two for the MLP's gate and up, the rotary embedding, the cache update, the mask's construction and the
module calls around them. At the few rows of a decode step most of them take longer to dispatch than to compute.
:class:`FusedDecoder` runs the same layer as four matrix products (query, key and value in one; the gate and up in
one) around the model's own normalisation, rotary and embedding modules, writing each token's keys and values into a
:class:`grpolab.models.decode_cache.SlabCache`. On SmolLM2, 8 rows, 256 new tokens, 2 threads, with oneDNN-packed
weights: 49.0 ms a token through transformers' forward against 42.3 ms here in fp32, 38.8 against 32.0 ms in bf16,
the same tokens (``benchmarks/decode.py`` measures it beside every run).

Why by hand: transformers fuses nothing at decode time, and ``torch.compile`` of its forward gave 1.13x after a
two-minute compile on this CPU, with oneDNN's packed weights not compiling at all (measured; docs/benchmarks.md).

Which models: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (with its query/key/value biases) whose layers are all
full attention with a SiLU-gated MLP; :func:`fused_supported` says why not otherwise, and the builder checks one
step against the model's own forward before the sampler uses it (``grpolab.rollout.weights``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grpolab.models.attention import attention_rounding
from grpolab.models.decode_cache import SlabCache, slab_reason

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def fused_supported(model: nn.Module) -> str | None:
    """None if ``model``'s layout is one :class:`FusedDecoder` computes, else the reason it is not."""
    name, config = type(model).__name__, getattr(model, "config", None)
    if name not in ARCHITECTURES or config is None:
        return f"{name} is not one of {ARCHITECTURES}"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "its MLP is not a bias-free SiLU gate"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "some of its layers attend through a sliding window"
    if (reason := slab_reason(model)) is not None:  # its steps write into a SlabCache
        return reason
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "grpolab_sdpa"):
        return f"it attends with {config._attn_implementation}, not sdpa"
    return None


class CastInput(nn.Module):
    """``inner(x)`` on ``x`` cast to ``dtype``: a head that computes in another dtype than the layers before it."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype))


class FusedSlice(nn.Module):
    """A slice ``[start, end)`` of a fused product's output features: what one of the fused projections gives
    (the prompt's prefill runs the model's forward, whose projections read the decoder's fused weights this way).

    The projections of one fused product are called on the same input one after another (query, key, value; gate,
    up), so the product is computed once per input: ``shared`` remembers the last input and its output."""

    def __init__(self, shared: _Shared, start: int, end: int):
        super().__init__()
        self.shared, self.start, self.end = shared, start, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)[..., self.start : self.end]


class _Shared(nn.Module):
    """A fused product with a memory of one input: called again on the very same tensor, it returns the output it
    gave (the memory holds the last input and output until the next call)."""

    def __init__(self, product: nn.Module):
        super().__init__()
        self.product = product
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._last is None or self._last[0] is not x:
            self._last = (x, self.product(x))
        return self._last[1]

    def forget(self) -> None:
        self._last = None


class _Layer:
    """One decoder layer: its fused products and the model's own norms."""

    def __init__(self, block: nn.Module, make_linear):
        self.qkv, self.o, self.gate_up, self.down = (make_linear() for _ in range(4))
        self.norm_in, self.norm_post = block.input_layernorm, block.post_attention_layernorm


class FusedDecoder:
    """Decode steps of ``model`` (a copy in the sampler's dtype, whose embedding, norms and rotary module it uses)
    with fused products made by ``make_linear()`` (a module with ``load(weight, bias)``) and filled by :meth:`load`.

    After :meth:`attach`, the model's own projections read the fused weights too (:class:`FusedSlice`), so the
    prompt's prefill through the model's forward and the decode steps here share one copy of every weight.
    """

    def __init__(self, model: nn.Module, make_linear, head_dtype: torch.dtype | None = None):
        """``head_dtype``: the LM head's dtype when it is not the products' (``--fp32-head``: its weight and input in
        fp32)."""
        config = model.config
        self.model = model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        inner = model.get_decoder()
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.rounding = attention_rounding(model)
        """A copy that computes as autocast does: the dtype its attention's inputs and output are rounded to."""
        self.layers = [_Layer(block, make_linear) for block in inner.layers]
        self.head = make_linear()
        self.head_dtype = head_dtype
        self.lm_head = self.head if head_dtype is None else CastInput(self.head, head_dtype)
        """What computes the logits from the final norm's output: the head, on inputs cast to ``head_dtype``."""
        self.read: set[str] = set()
        """The served weights :meth:`load` read (the others are the model's own parameters)."""
        self.shared: list[_Shared] = []
        """The fused products the model's projections read after :meth:`attach`, each with its memory of one input."""

    def load(self, served: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """(Re)fills every fused product from ``served`` (transformers' names, as
        :func:`grpolab.rollout.weights.served_weights` gives them), cast to ``dtype``."""

        self.read: set[str] = set()

        def w(name: str) -> torch.Tensor:
            self.read.add(name)
            return served[name].to(dtype)

        def b(*names: str) -> torch.Tensor | None:
            got = [served.get(n) for n in names]
            self.read.update(n for n, g in zip(names, got) if g is not None)
            if all(g is None for g in got):
                return None
            return torch.cat([g.to(dtype) for g in got])  # a layout with some of the biases is not one we take

        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = [f"{a}{p}_proj" for p in "qkv"]
            layer.qkv.load(torch.cat([w(f"{n}.weight") for n in qkv]), b(*(f"{n}.bias" for n in qkv)))
            layer.o.load(w(f"{a}o_proj.weight"), b(f"{a}o_proj.bias"))
            gate_up = torch.cat([w(f"{m}gate_proj.weight"), w(f"{m}up_proj.weight")])
            layer.gate_up.load(gate_up, None)
            layer.down.load(w(f"{m}down_proj.weight"), None)
        self.read.add("lm_head.weight")
        self.head.load(served["lm_head.weight"].to(self.head_dtype or dtype), None)  # an fp32 head from the masters

    def attach(self) -> None:
        """Points the model's projections at the fused products (see the class docstring)."""
        q, kv, inter = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        for layer, block in zip(self.layers, self.model.get_decoder().layers):
            attn, mlp = block.self_attn, block.mlp
            qkv, gate_up = _Shared(layer.qkv), _Shared(layer.gate_up)
            self.shared += [qkv, gate_up]
            attn.q_proj, attn.k_proj = FusedSlice(qkv, 0, q), FusedSlice(qkv, q, q + kv)
            attn.v_proj, attn.o_proj = FusedSlice(qkv, q + kv, q + 2 * kv), layer.o
            mlp.gate_proj, mlp.up_proj = FusedSlice(gate_up, 0, inter), FusedSlice(gate_up, inter, 2 * inter)
            mlp.down_proj = layer.down
        self.model.lm_head = self.lm_head

    def forget(self) -> None:
        """Drops the projections' memory of the last input (the prefill's activations): call after a prefill."""
        for shared in self.shared:
            shared.forget()

    @torch.no_grad()
    def step(self, tok: torch.Tensor, position: torch.Tensor, mask: torch.Tensor, cache: SlabCache) -> torch.Tensor:
        """Feeds one token per live row: ``tok``, ``position`` ``[n]``, ``mask`` ``[n, L + 1]`` (1 on the keys each
        row attends to: its prompt's real tokens and every token since). Writes the token's keys and values into
        ``cache`` and returns the next token's logits ``[n, V]``."""
        n, H, Hk, d, inter = tok.shape[0], self.heads, self.kv_heads, self.head_dim, self.intermediate
        h = self.embed(tok)  # [n, D]
        cos, sin = self.rotary(h, position[:, None])  # [n, 1, d] each
        keep = mask.bool()[:, None, None, :]  # [n, 1, 1, L + 1]
        for layer, slab in zip(self.layers, cache.layers):
            qkv = layer.qkv(layer.norm_in(h))  # [n, (H + 2 Hk) d]
            qk = _rotate(qkv[:, : (H + Hk) * d].view(n, H + Hk, 1, d), cos, sin)  # queries and keys: one rotation
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + Hk) * d :].view(n, Hk, 1, d)  # [n, H or Hk, 1, d]
            if self.rounding is not None:  # as autocast's attention (grpolab.models.attention)
                q, k, v = q.to(self.rounding), k.to(self.rounding), v.to(self.rounding)
            keys, values = slab.update(k, v)  # [n, Hk, L + 1, d] views
            # An fp32 cache under bf16 weights attends in fp32 (grpolab.models.attention says why)
            out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=keep, enable_gqa=Hk < H)
            out = out if self.rounding is None else out.to(self.rounding)
            h = h + layer.o(out.view(n, H * d).to(h.dtype))  # [n, D]
            gate_up = layer.gate_up(layer.norm_post(h))  # [n, 2 I]
            h = h + layer.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        return self.lm_head(self.norm(h))  # [n, V]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding, as transformers' ``apply_rotary_pos_emb`` computes it: ``x`` ``[n, heads, 1, d]``,
    ``cos``, ``sin`` ``[n, 1, d]``."""
    cos, sin = cos[:, None], sin[:, None]  # [n, 1, 1, d]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
