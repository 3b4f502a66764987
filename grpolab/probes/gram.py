"""The Gram matrix of per-rollout score vectors, Psi_ij = <psi_i, psi_j>, without R gradients.

psi_i = grad_theta sum_t w_it log pi(o_it | ...) is rollout i's score vector, with the
loss's per-token weights w (e.g. 1/|o_i| for GRPO's length normalisation). Every
estimator of the GRPO family is a weighted sum of the psi_i, so Psi serves both the
spectrum probe (K = diag(A) Psi diag(A)) and the estimator-MSE probe.

How it is computed (``score_gram``): one forward and one backward pass over the R
rollouts. Rows of a batch never interact, so the gradient reaching any activation of
row i comes from rollout i's loss alone. Forward hooks keep each layer's input a_i,
tensor hooks receive its output gradient b_i as the backward pass reaches it, and the
layer's R x R contribution is added and the activations freed:

- ``nn.Linear`` W (q x p), per-rollout gradient B_i^T A_i (A_i: T x p, B_i: T x q):
  either the 'ghost' form <grad_i, grad_j> = sum_{t,s} (a_it . a_js)(b_it . b_js)
  (Goodfellow 2015; Li et al. 2021), cost (R T)^2 (p + q), or the per-rollout q x p
  gradients contracted directly, cost R T p q + R^2 p q; ghost when R T (p + q) < p q.
  A bias adds sum_t b_it.
- ``nn.Embedding`` E (V x d): per-rollout gradient rows scatter-added from b_it at the
  token ids x_it.
- Norm gains (RMSNorm, LayerNorm): per-rollout gradient sum_t b_it * xhat_it with xhat
  the normalised input, recomputed from the saved input.
- A parameter used by two modules (tied input/output embeddings): its per-rollout
  gradient is the sum of both uses, so both contributions are materialised, summed,
  and only then contracted (the cross terms are included).

Parameters are frozen during the pass, so no ``.grad`` is accumulated; the backward
pass targets the embedding output. Contributions are accumulated in float64 from
products in float32 (float64 for a float64 model), whatever the model's dtype: off-diagonal entries are far smaller
than diagonal ones.

``score_gram_reference`` is the plain path: R backward passes, the gradients stacked,
Psi = G G^T. The tests and ``rank --verify`` compare the two.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import NamedTuple

import torch
from torch import nn

from grpolab.algo.loss import aggregation_weights
from grpolab.common.batch import Batch
from grpolab.models.logprobs import completion_logprobs
from grpolab.vision.families import family_of


def token_weights(
    mask: torch.Tensor, aggregation: str = "seq-mean-token-mean", max_len: int | None = None
) -> torch.Tensor:
    """Per-token weights ``[R, T]`` that make psi_i the score of rollout i as the loss weighs it: the loss's own
    aggregation weights (:func:`grpolab.algo.loss.aggregation_weights`) at the per-rollout scale.

    ``seq-mean-token-mean``: 1/|o_i| (GRPO); ``token-mean`` and ``sum``: 1 (the plain
    trajectory score sum_t grad log pi, [Foundations, Eq. 17]); ``seq-mean-token-sum-norm``:
    1/max_len (Dr. GRPO). The constant factor common to all rollouts (1/N, 1/tokens) is left
    out: it scales Psi and not the spectrum's shape.
    """
    return aggregation_weights(mask, aggregation, max_len=max_len, num_seqs=1, num_tokens=1)


def _weighted_score_sum(model, batch: Batch, weights: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = completion_logprobs(model, batch, temperature, chunk_tokens=0)  # [R, T]; the head once: hooks count its uses
    return (logp * weights.to(logp.dtype)).sum()


def select_params(model: nn.Module, include: str | None) -> dict[int, str]:
    """id(param) -> name of the trainable parameters whose name matches ``include`` (a regex). A vision-language
    model's default is its language model and head (:meth:`grpolab.vision.families.Family.language_scope`)."""
    family = family_of(model)
    if include is None and family is not None:
        include = family.language_scope(model)
    pat = re.compile(include) if include else None
    chosen = {}
    for name, p in model.named_parameters():
        if p.requires_grad and (pat is None or pat.search(name)):
            chosen.setdefault(id(p), name)
    if not chosen:
        raise ValueError(f"no trainable parameter matches {include!r}")
    return chosen


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least: bf16/fp16 activations widened, a float64 model's kept exact."""
    return t if t.dtype == torch.float64 else t.float()


def _rms_hat(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    xf = _wide(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _is_rmsnorm(module: nn.Module) -> bool:
    return "rmsnorm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), nn.Parameter)


_SKETCH_HASH_BUDGET = 2**30  # bytes of cached buckets + signs (5 bytes per coordinate: ~200 M parameters)
_sketch_hashes: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _sketch_hash(name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket ``[n]`` (int32) and sign ``[n]`` (int8) of a parameter's coordinates, drawn from a
    generator keyed by its name. Drawing 2 x 135 M random integers takes seconds and a probe
    sketches the same parameters once per prompt, so they are kept while they fit the budget."""
    key = (name, n, k, seed)
    if key in _sketch_hashes:
        return _sketch_hashes[key]
    gen = torch.Generator().manual_seed((seed * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(name))) % 2**63)
    bucket = torch.randint(0, k, (n,), generator=gen).to(torch.int32)
    sign = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(torch.int8)
    if (sum(b.numel() for b, _ in _sketch_hashes.values()) + n) * 5 <= _SKETCH_HASH_BUDGET:
        _sketch_hashes[key] = (bucket, sign)
    return bucket, sign


def count_sketch(g: torch.Tensor, name: str, k: int, seed: int) -> torch.Tensor:
    """Project per-rollout gradients ``[R, n]`` to ``[R, k]`` with a CountSketch: coordinate j
    goes to bucket h(j) with sign s(j), both drawn from a generator keyed by the parameter
    name, so every call (and every rollout) uses the same projection. E<Sa, Sb> = <a, b>;
    the entry's standard deviation is at most sqrt(2/k) ||a|| ||b||. Costs O(R n), unlike a
    dense Gaussian projection's O(n k)."""
    bucket, sign = _sketch_hash(name, g.shape[1], k, seed)  # drawn on the CPU: the same on every device
    bucket, sign = bucket.to(g.device), sign.to(g.device)
    if g.shape[0] == 1:  # one vector (a leave-one-out gradient): the 1-D kernel, the same sums 5x faster on a CPU
        out = torch.zeros(k, dtype=torch.float32, device=g.device)
        return out.index_add_(0, bucket, g[0].float() * sign)[None]
    out = torch.zeros(g.shape[0], k, dtype=torch.float32, device=g.device)
    out.index_add_(1, bucket, g.float() * sign)
    return out


class _Factors(NamedTuple):
    """One use of a weight W (q x p), its per-rollout gradients kept factored:
    G_i = sum over rows n of rollout i of left_n right_n^T.

    ``nn.Linear``: left = output gradient b ``[N, q]``, right = input a ``[N, p]``. ``nn.Embedding``
    (W: V x d): left is the one-hot of the token id (kept as ``ids`` ``[N]``, ``left`` None),
    right = output gradient ``[N, d]``. ``rollout`` ``[N]``: the rollout of each row.
    """

    rollout: torch.Tensor
    right: torch.Tensor
    left: torch.Tensor | None
    ids: torch.Tensor | None


def _rows(R: int, L: int, device) -> torch.Tensor:
    return torch.arange(R, device=device).repeat_interleave(L)  # [R L]


def _factor_cross(f: _Factors, g: _Factors, R: int) -> torch.Tensor:
    """``[R, R]`` float64: <G_i(f), G_j(g)> = sum_{n in i, m in j} (left_n . left_m)(right_n . right_m)
    (Goodfellow 2015's 'ghost' form; a one-hot left makes left_n . left_m a gather or an equality)."""
    if f.left is not None and g.left is not None:
        ll = f.left @ g.left.T
    elif f.left is not None:
        ll = f.left[:, g.ids]  # [Nf, Ng]: f's left at g's token ids
    elif g.left is not None:
        ll = g.left[:, f.ids].T
    else:
        ll = (f.ids[:, None] == g.ids[None, :]).to(f.right.dtype)
    prod = (ll * (f.right @ g.right.T)).double()  # [Nf, Ng]
    by_i = torch.zeros(R, prod.shape[1], dtype=torch.float64, device=prod.device).index_add_(0, f.rollout, prod)
    return torch.zeros(R, R, dtype=torch.float64, device=prod.device).index_add_(1, g.rollout, by_i)


def _materialise(f: _Factors, R: int, q: int) -> torch.Tensor:
    """The per-rollout gradients ``[R, q, p]`` of one use."""
    p = f.right.shape[1]
    if f.left is None:  # embedding rows scatter-added at their token ids
        g = torch.zeros(R, q, p, dtype=f.right.dtype, device=f.right.device)
        g.index_put_((f.rollout, f.ids), f.right, accumulate=True)
        return g
    # a Linear's rows come in R equal blocks, rollout by rollout (_linear_contribution): one batched product
    return torch.einsum("rlq,rlp->rqp", f.left.view(R, -1, q), f.right.view(R, -1, p))


def _costs(fs: list[_Factors], R: int, q: int, p: int) -> tuple[float, float]:
    """Multiply-adds of the factored (ghost) and the materialised path for a weight's uses."""
    ghost = sum(
        a.rollout.numel() * b.rollout.numel() * (p + (q if a.left is not None and b.left is not None else 1))
        for a in fs
        for b in fs
    )
    mat = R * q * p * (2 if len(fs) > 1 else 1) + sum(
        f.rollout.numel() * p * (q if f.left is not None else 1) for f in fs
    )
    return ghost, mat


class _GramAccumulator:
    """Adds each layer's R x R contribution as its output gradient arrives (or, with a
    sketch, each layer's sketched per-rollout gradient)."""

    def __init__(self, R: int, chosen: dict[int, str], uses: dict[int, int], sketch_dim: int = 0, sketch_seed: int = 0):
        self.R = R
        self.psi = torch.zeros(R, R, dtype=torch.float64)
        self.chosen = chosen
        self.uses = uses  # id(param) -> number of modules using it
        self.pending: dict[int, list] = {}  # shared params: the uses seen so far (_Factors or [R, ...] gradients)
        self.covered: set[int] = set()
        self.sketch_dim, self.sketch_seed = sketch_dim, sketch_seed
        self.sketch = torch.zeros(R, sketch_dim, dtype=torch.float32) if sketch_dim else None

    def result(self) -> torch.Tensor:
        if self.sketch is not None:
            s = self.sketch.double()
            return s @ s.T
        return self.psi

    def _all_uses(self, param: nn.Parameter, item) -> list | None:
        """Every use of ``param`` once the last has arrived (None before): a shared weight's
        per-rollout gradient is the sum over its uses, so the cross terms count too."""
        pid = id(param)
        if self.uses[pid] == 1:
            return [item]
        self.pending.setdefault(pid, []).append(item)
        return self.pending.pop(pid) if len(self.pending[pid]) == self.uses[pid] else None

    def add_factors(self, param: nn.Parameter, f: _Factors) -> None:
        """One use of a weight (q x p) in factored form; the ghost contraction when it is cheaper
        than forming the R per-rollout q x p gradients (and there is no sketch), else those."""
        items = self._all_uses(param, f)
        if items is None:
            return
        q, p = param.shape
        fs = [x for x in items if isinstance(x, _Factors)]
        ghost, mat = _costs(fs, self.R, q, p)
        if self.sketch is None and len(fs) == len(items) and ghost < mat:
            self.add_gram(param, sum(_factor_cross(a, b, self.R) for a in fs for b in fs))
        else:
            self._add_rows(param, self._summed(items, q))

    def _summed(self, items: list, q: int) -> torch.Tensor:
        grads = [_materialise(x, self.R, q) if isinstance(x, _Factors) else x for x in items]
        return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)

    def add_per_rollout(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        """grads ``[R, ...]``: per-rollout gradients of ``param``."""
        items = self._all_uses(param, grads)
        if items is not None:
            self._add_rows(param, self._summed(items, param.shape[0]))

    def _add_rows(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        pid = id(param)
        self.covered.add(pid)
        g = _wide(grads.reshape(grads.shape[0], -1))
        if self.sketch is not None:
            self.sketch += count_sketch(g, self.chosen[pid], self.sketch_dim, self.sketch_seed).cpu()
        else:
            self.psi += (g @ g.T).double().cpu()  # [R, R] sums kept on the CPU, whatever the model's device

    def add_gram(self, param: nn.Parameter, gram: torch.Tensor) -> None:
        self.covered.add(id(param))
        self.psi += gram.double().cpu()

    def check_complete(self) -> None:
        """Raise unless every chosen parameter was covered and every shared one got all its uses."""
        missing = [name for pid, name in self.chosen.items() if pid not in self.covered]
        if missing:
            shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
            raise NotImplementedError(
                f"score_gram has no per-rollout rule for {len(missing)} parameter(s): {shown}; "
                "use score_gram_reference or restrict with include="
            )
        if self.pending:
            raise RuntimeError("a shared parameter received fewer contributions than it has uses")


@contextlib.contextmanager
def _frozen(model: nn.Module):
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


def _per_rollout_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``[R, ..., d]`` over every axis but the first and last -> ``[R, d]``.

    A norm gain or a bias sees every position of its input: tokens, and for
    per-head norms (Qwen3's q_norm/k_norm, input ``[R, L, heads, head_dim]``) heads too.
    """
    return t.reshape(t.shape[0], -1, t.shape[-1]).sum(dim=1)


def _linear_contribution(acc: _GramAccumulator, module: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> None:
    R = a.shape[0]
    # [R, L, p], [R, L, q]; any extra middle axes are folded into L
    a = _wide(a).reshape(R, -1, a.shape[-1])
    b = _wide(b).reshape(R, -1, b.shape[-1])
    W = module.weight
    if id(W) in acc.chosen:
        L = a.shape[1]
        acc.add_factors(W, _Factors(_rows(R, L, a.device), a.reshape(R * L, -1), b.reshape(R * L, -1), None))
    if module.bias is not None and id(module.bias) in acc.chosen:
        acc.add_per_rollout(module.bias, b.sum(dim=1))  # [R, q]


def _hooked_modules(model: nn.Module) -> list[nn.Module]:
    """The modules with a per-rollout rule (module docstring): Linear, Embedding, LayerNorm, RMSNorm."""
    return [
        m
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or _is_rmsnorm(m) or isinstance(m, nn.LayerNorm)
    ]


def _count_uses(modules: list[nn.Module], chosen: dict[int, str]) -> dict[int, int]:
    """id(param) -> number of ``modules`` using it (2 for tied input/output embeddings)."""
    uses: dict[int, int] = {}
    for m in modules:
        for p in (getattr(m, "weight", None), getattr(m, "bias", None)):
            if isinstance(p, nn.Parameter) and id(p) in chosen:
                uses[id(p)] = uses.get(id(p), 0) + 1
    return uses


class _ScoreHooks:
    """Forward hooks that keep each hooked module's input and route its output gradient to ``acc``.

    An ``nn.Embedding``'s output is replaced by a fresh leaf (collected in ``targets``): the
    backward pass ends there, and the leaf's gradient is the embedding's b. Every other
    module gets a tensor hook on its output that adds the module's contribution once b arrives.
    """

    def __init__(self, acc: _GramAccumulator):
        self.acc = acc
        self.targets: list[torch.Tensor] = []  # the embedding outputs the backward pass targets

    @contextlib.contextmanager
    def installed(self, modules: list[nn.Module]):
        """The forward hooks on ``modules`` for the duration of the block, removed even if it fails."""
        handles = [m.register_forward_hook(self.forward_hook) for m in modules]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def forward_hook(self, mod: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        x = inputs[0]
        if isinstance(mod, nn.Embedding):
            return self._cut_at_embedding(mod, x, output)
        if output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, mod, x.detach()))
        return None

    def _cut_at_embedding(self, mod: nn.Embedding, ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        # The backward pass ends here: the output becomes a leaf whose gradient is b.
        leaf = output.detach().requires_grad_(True)
        leaf.register_hook(functools.partial(self._embedding_grad, mod, ids))
        self.targets.append(leaf)
        return leaf

    def _embedding_grad(self, mod: nn.Embedding, ids: torch.Tensor, b: torch.Tensor) -> None:
        """ids ``[R, L]``, b ``[R, L, d]``: rows of b scatter-added at the token ids (kept factored)."""
        if id(mod.weight) not in self.acc.chosen:
            return
        b = _wide(b)
        if mod.padding_idx is not None:  # nn.Embedding gives its padding row no gradient
            b = b.masked_fill((ids == mod.padding_idx)[..., None], 0.0)
        R, L = self.acc.R, ids.shape[1]
        self.acc.add_factors(mod.weight, _Factors(_rows(R, L, b.device), b.reshape(R * L, -1), None, ids.reshape(-1)))

    def _grad_hook(self, mod: nn.Module, saved: torch.Tensor, b: torch.Tensor) -> None:
        """``mod``'s contribution from its saved input and its output gradient b (the row dim first: R)."""
        if isinstance(mod, nn.Linear):
            _linear_contribution(self.acc, mod, saved, b)
        elif isinstance(mod, nn.LayerNorm):
            self._layernorm_grad(mod, saved, b)
        else:
            self._rmsnorm_grad(mod, saved, b)

    def _layernorm_grad(self, mod: nn.LayerNorm, saved: torch.Tensor, b: torch.Tensor) -> None:
        """y = weight * xhat + bias: the gain's gradient is sum b * xhat, the bias's sum b."""
        xhat = nn.functional.layer_norm(_wide(saved), mod.normalized_shape, eps=mod.eps)
        if mod.weight is not None and id(mod.weight) in self.acc.chosen:
            self.acc.add_per_rollout(mod.weight, _per_rollout_sum(_wide(b) * xhat))
        if mod.bias is not None and id(mod.bias) in self.acc.chosen:
            self.acc.add_per_rollout(mod.bias, _per_rollout_sum(_wide(b)))

    def _rmsnorm_grad(self, mod: nn.Module, saved: torch.Tensor, b: torch.Tensor) -> None:
        """y = weight * xhat: the gain's gradient is sum b * xhat."""
        if id(mod.weight) in self.acc.chosen:
            self.acc.add_per_rollout(mod.weight, _per_rollout_sum(_wide(b) * _rms_hat(mod, saved)))


def score_gram(
    model: nn.Module,
    batch: Batch,
    weights: torch.Tensor,
    *,
    temperature: float = 1.0,
    include: str | None = None,
    sketch_dim: int = 0,
    sketch_seed: int = 0,
) -> torch.Tensor:
    """Psi ``[R, R]`` (float64) for the R rollouts of ``batch`` with per-token ``weights`` ``[R, T]``.

    ``include``: a regex on parameter names restricting psi to those parameters
    (e.g. ``"lora_"`` or ``"layers\\.0\\."``); default all trainable parameters.
    ``sketch_dim``: if > 0, an unbiased CountSketch estimate of Psi from k-dimensional
    projections of the per-rollout gradients (the fallback for models where the exact
    path is too slow; every layer is then materialised per rollout and projected).
    """
    chosen = select_params(model, include)
    R = batch.completion_ids.shape[0]
    modules = _hooked_modules(model)
    acc = _GramAccumulator(R, chosen, _count_uses(modules, chosen), sketch_dim, sketch_seed)
    hooks = _ScoreHooks(acc)
    with hooks.installed(modules), _frozen(model):
        loss = _weighted_score_sum(model, batch, weights, temperature)
        if not hooks.targets:
            raise RuntimeError("score_gram needs a model whose inputs pass through an nn.Embedding")
        # the hooks add every layer's contribution to acc; a vision tower's embeddings outside the graph (frozen) get none
        torch.autograd.grad(loss, hooks.targets, allow_unused=True)
    acc.check_complete()
    return acc.result()


def score_gram_reference(
    model: nn.Module, batch: Batch, weights: torch.Tensor, *, temperature: float = 1.0, include: str | None = None
) -> torch.Tensor:
    """Psi ``[R, R]`` the plain way: one backward pass per rollout, gradients stacked."""
    chosen = select_params(model, include)
    params = [p for p in model.parameters() if id(p) in chosen]
    rows = []
    R = batch.completion_ids.shape[0]
    for i in range(R):
        sub = batch.rows(i, i + 1)
        grads = torch.autograd.grad(
            _weighted_score_sum(model, sub, weights[i : i + 1], temperature), params, allow_unused=True
        )
        rows.append(
            torch.cat(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1).double() for g, p in zip(grads, params)]
            )
        )
    G = torch.stack(rows)  # [R, D]
    return G @ G.T


def gram_relative_error(psi: torch.Tensor, ref: torch.Tensor) -> float:
    """max_ij |Psi_ij - Ref_ij| / sqrt(Ref_ii Ref_jj): each entry's error on the scale of
    the two score norms (a cosine-scale error), so small off-diagonal entries count fully."""
    d = ref.diagonal().clamp(min=0).sqrt()
    scale = (d[:, None] * d[None, :]).clamp(min=torch.finfo(torch.float64).tiny)
    return float(((psi - ref).abs() / scale).max())
