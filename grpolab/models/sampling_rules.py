"""The distribution a completion token is sampled from: the model's logits through a repetition penalty, the
temperature, min-p, top-k and top-p, in vLLM's order, so that grpolab's sampler, vLLM and the trainer's replay of a
rollout (``grpolab.models.logprobs``) all mean the same distribution.

vLLM 0.32's order (``vllm/v1/sample/sampler.py``: ``Sampler.forward``, then ``Sampler.sample``; the penalty in
``ops/penalties.py``, min-p in ``logits_processor/builtin.py``'s ``MinPLogitsProcessor``, top-k and top-p in
``ops/topk_topp_sampler.py``'s ``apply_top_k_top_p_pytorch``), per position, from the logits z ``[V]``:

1. repetition penalty rho (CTRL's): each token seen before the position, in the prompt or in the completion so far,
   has its logit divided by rho where it is > 0 and multiplied by rho where it is <= 0 (the other tokens keep theirs);
2. temperature T: z / T. T = 0 is greedy: the argmax of step 1's logits, whose log-probs are step 1's at T = 1 (vLLM
   turns top-p, top-k and min-p off at T = 0, and applies the penalty still);
3. min-p: the tokens whose probability softmax(z / T) is below min_p times the largest one are dropped;
4. top-k: the tokens whose logit is below the k-th largest of those left are dropped (ties at the k-th value are all
   kept, as vLLM keeps them);
5. top-p: of the distribution renormalised over the tokens left, the smallest prefix, most probable first, whose mass
   reaches top_p is kept: a token stays when the mass before it is < top_p (the most probable always stays).

The sampling distribution is the softmax of step 2's logits over the tokens kept. Each rule off (top_k 0, top_p 1,
min_p 0, rho 1) changes nothing. vLLM computes in float32, grpolab in float64: the two differ where a token sits on a
boundary to float32 rounding, which the engine correction measures.
"""

from __future__ import annotations

import dataclasses

import torch

from grpolab.config.rollout import GenerationSection

OFFSET_BUDGET = 2**24
"""Elements (logits and the penalty's history ids) held at once while :func:`sampling_log_offset` runs over many
positions: the positions go through in chunks of this size."""


@dataclasses.dataclass(frozen=True)
class SamplingRules:
    """What shapes the sampling distribution besides the temperature (the module docstring's steps 1, 3-5)."""

    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th kept); 0: off."""
    top_p: float = 1.0
    """Keep the smallest most-likely-first prefix of mass >= top_p; 1: off."""
    min_p: float = 0.0
    """Drop the tokens less likely than min_p x the most likely one; 0: off."""
    repetition_penalty: float = 1.0
    """Divide the positive logits of the tokens seen before (prompt and completion), multiply the others; 1: off."""

    @classmethod
    def of(cls, generation: GenerationSection) -> SamplingRules:
        """The rules of a run's ``generation`` options."""
        g = generation
        return cls(g.top_k, g.top_p, g.min_p, g.repetition_penalty)

    @property
    def nucleus_only(self) -> bool:
        """No rule but top-p (perhaps off too): the path grpolab took before the others existed
        (:func:`grpolab.models.logprobs.nucleus_log_mass`)."""
        return self.top_k == 0 and self.min_p == 0.0 and self.repetition_penalty == 1.0

    @property
    def full_support(self) -> bool:
        """Every rule off: the sampler samples softmax(z / T) itself, the trainer's own distribution."""
        return self.nucleus_only and self.top_p >= 1.0

    @property
    def penalised(self) -> bool:
        """The repetition penalty is on: a position's distribution depends on the tokens before it."""
        return self.repetition_penalty != 1.0


NO_RULES = SamplingRules()


def seen_tokens(ids: torch.Tensor, valid: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, V]`` bool: which tokens occur among row i's ``ids[i]`` ``[n, L]`` where ``valid`` ``[n, L]`` (the repetition
    penalty's history: a prompt's real tokens and the completion's so far)."""
    out = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)  # column V: the invalid ids' bin
    out.scatter_(1, ids.masked_fill(~valid, vocab), True)
    return out[:, :vocab].contiguous()


def penalise(z: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Step 1: the seen tokens' logits divided by ``penalty`` where > 0, multiplied by it elsewhere: ``[n, V]`` -> ``[n, V]``
    (vLLM multiplies by 1 / penalty, as here)."""
    scaling = torch.where(z > 0, 1.0 / penalty, penalty)
    return torch.where(seen, z * scaling, z)


def processed_logits(
    logits: torch.Tensor, temperature: float, rules: SamplingRules, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """``[n, V]`` float64: step 2's logits with -inf on the tokens steps 3-5 drop, from ``logits`` ``[n, V]``; their
    softmax is the sampling distribution. ``seen`` ``[n, V]`` bool: each row's history (:func:`seen_tokens`), needed
    when the repetition penalty is on. Temperature 0 (greedy): step 1's logits, nothing dropped."""
    z = logits.double()
    if rules.penalised:
        z = penalise(z, seen, rules.repetition_penalty)
    if temperature == 0.0:
        return z
    z = z / temperature
    if rules.min_p > 0.0:
        p = torch.softmax(z, dim=-1)
        z = z.masked_fill(p < rules.min_p * p.amax(dim=-1, keepdim=True), -torch.inf)
    if 0 < rules.top_k < z.shape[-1]:
        kth = z.topk(rules.top_k, dim=-1).values[:, -1:]  # [n, 1] the k-th largest logit left
        z = z.masked_fill(z < kth, -torch.inf)
    if rules.top_p < 1.0:
        sorted_p, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=True, stable=True)  # [n, V]
        drop = (sorted_p.cumsum(-1) - sorted_p) >= rules.top_p  # the mass before reaches top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -torch.inf)
    return z


def sampling_log_offset(
    logits: torch.Tensor, target: torch.Tensor, temperature: float, rules: SamplingRules, seen=None
) -> torch.Tensor:
    """``[n]`` log p_T(o) - log p_sampling(o) of each position's token ``target`` ``[n]``, from its logits ``[n, V]``:
    what puts the log-prob of the sampling distribution (the rules') on the whole vocabulary at temperature T (the
    trainer's scale). Written as

        (z_o - z'_o) / T + logsumexp_kept(z' / T) - logsumexp(z / T),

    z' the penalised logits (step 1), kept the tokens steps 3-5 keep: top-p alone gives the log of the kept mass
    (:func:`grpolab.models.logprobs.nucleus_log_mass`), the penalty adds its change of the token's own logit. The form
    stays finite for a token the rules would drop here (an engine whose rounding put a boundary elsewhere).
    ``seen``: ``[n, V]`` bool (the penalty's history), or a callable ``(start, stop) -> [stop - start, V]`` giving it
    for a slice of the positions, which then go through ``OFFSET_BUDGET // V`` at a time. float64 for float64
    logits, else float32."""
    n, V = logits.shape
    step = n if not callable(seen) else max(1, OFFSET_BUDGET // V)
    parts = []
    for i in range(0, n, max(step, 1)):
        history = seen(i, min(i + step, n)) if callable(seen) else seen
        parts.append(_offset(logits[i : i + step], target[i : i + step], temperature, rules, history))
    out = torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float64)
    return out if logits.dtype == torch.float64 else out.float()


def _offset(logits, target, temperature: float, rules: SamplingRules, seen) -> torch.Tensor:
    scale = temperature or 1.0
    z = logits.double()
    z_o = z.gather(1, target[:, None]).squeeze(1)  # [n]
    zp_o = z_o  # [n] the token's penalised logit (step 1)
    if rules.penalised:
        zp_o = penalise(z_o, seen.gather(1, target[:, None]).squeeze(1), rules.repetition_penalty)
    kept = processed_logits(logits, temperature, rules, seen)  # [n, V]
    return (z_o - zp_o) / scale + torch.logsumexp(kept, dim=-1) - torch.logsumexp(z / scale, dim=-1)


def sample_processed(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, rules: SamplingRules, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling from the rules' distribution: the token where its CDF (vocabulary order, float64) first
    exceeds ``u`` ``[n]``, and its log-prob under that distribution (float64): ``[n]``, ``[n]``. Temperature 0:
    the argmax of the penalised logits."""
    z = processed_logits(logits, temperature, rules, seen)  # [n, V], -inf off the kept set
    logp = torch.log_softmax(z, dim=-1)
    if temperature == 0.0:
        tok = z.argmax(dim=-1)
    else:
        cdf = logp.exp().cumsum(-1)  # a dropped token adds 0: with u < 1 the token found has probability > 0
        j = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).clamp(max=z.shape[-1] - 1)
        tok = j.squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
