"""Where a step spends its rollouts: fixed groups, filtered groups, or group sizes set per prompt.

Three modes (``--sampling``):

``fixed``
    B prompts, G rollouts each: the GRPO of the papers.

``filter`` (DAPO's dynamic sampling)
    A group whose rewards are all equal has every group-baseline advantage exactly 0: its G
    rollouts cost generation and carry no gradient. ``filter`` keeps drawing prompts (a round
    at a time) until the step holds B groups with reward variance, at most ``max_rounds``
    rounds; the update then uses the first B kept groups (or, short of B after the last round,
    the kept ones with the kept batch's normalisers; the step is counted as short).
    Round 1 draws B prompts; each later round draws the expected number still needed,
    ceil(shortfall / keep rate so far), at most B (:func:`next_round_size`).

    Bias. With a group baseline a zero-variance group contributes exactly 0, so for a
    prompt x with ``q(x)`` = P(its group has variance), E[g_x | kept] = grad J_x / q(x). The
    update averages B kept groups, so prompt x enters it in proportion to its share among
    kept groups, ``p(x) q(x) / E q``: the expected update is grad J / E q, the fixed
    estimator's expectation scaled by 1 / (share kept). The *direction* is unbiased; only the
    step length grows (by 1 / E q, about 1.3 when a quarter of the groups are all-equal).
    (With ``grpo_std`` this holds for the standardised estimator's expectation in place of
    grad J.) ``grpolab mse --env bandit --sampling filter`` measures it.

``adaptive``
    A pilot of ``n0`` rollouts per prompt (``--pilot-size``), then the step's remaining
    budget B G - B n0 shared among the prompts by :func:`allocate_group_sizes`. The group
    baseline of a prompt uses all of its rollouts.

The allocation rule (the derivation the papers leave to the reader)
--------------------------------------------------------------------
The step's gradient estimate is g = (1/B) sum_i g_i over its B prompts, g_i the
leave-one-out (rloo) estimate from prompt i's n_i rollouts. Given the prompts, the errors
of different prompts are independent, so

    E||g - grad J_B||^2 = (1/B^2) sum_i MSE_i(n_i),
    MSE_i(n) = sigma_O,i^2 / n + 2 tau_i^2 / (n (n - 1))          [U-statistic, Thm 2]

with grad J_B the mean of the B prompts' true gradients (``grpolab.probes.mse``). To allocate
before the rollouts exist, model the score psi of a rollout as independent of its reward r,
with E||psi||^2 = S the same for every prompt, and drop ||mu||^2 next to S Var(r) (a small
signal, which is where GRPO lives). Then, with V_i = Var(r) for prompt i,

    sigma_O,i^2 = E[(r - v)^2] E||psi||^2 = V_i S
    zeta_2 = E||h||^2 = E[(r - r')^2] E||psi - psi'||^2 / 4 = (2 V_i)(2 S) / 4 = V_i S
    tau_i^2 = zeta_2 - 2 zeta_1 = V_i S - 2 V_i S / 4 = V_i S / 2

    MSE_i(n) = V_i S (1/n + 1/(n (n - 1))) = V_i S / (n - 1).

A leave-one-out estimate from n rollouts behaves like an oracle-baseline one from n - 1.
Minimising sum_i V_i / (n_i - 1) subject to sum_i n_i = budget is Neyman allocation on
n - 1:

    n_i - 1  proportional to  sqrt(V_i),

so prompts whose pass rate is near 1/2 (V = p (1 - p) largest) get the most rollouts, and a
prompt with V_i = 0 gets none beyond the pilot: more rollouts of a prompt that always
succeeds or always fails lower no error. V_i is estimated by the pilot's unbiased sample
variance (for 0/1 rewards, p (1 - p) n0 / (n0 - 1) with p the pilot's pass rate), so
*a pilot whose rewards are all equal gets no further rollouts*, unless every other prompt
has reached the cap or also has zero variance: then the budget left over is spread evenly
(round robin, fewest rollouts first), because the step's budget is always spent exactly.
The objective is separable and convex in the integers n_i, so handing out rollouts one at a
time to the prompt with the largest decrease V_i / ((n_i - 1) n_i) is the exact integer
optimum (ties go to the lower prompt index, so the rule is deterministic). No group grows
past ``max_group_size`` (the model behind the rule trusts a 4-rollout pilot more than it
deserves; the cap bounds how far one lucky pilot can pull the step).

Weights. Rollout j of prompt i enters the loss with its advantage times N / (B n_i) (N the
step's rollouts), so that every prompt carries weight 1/B as in g above, whatever its group
size; with n_i = G for all prompts the factor is exactly 1.

Bias. The group size depends on the pilot's rewards, so the rollouts of a prompt are no
longer a fixed-size i.i.d. sample: the estimate is biased. For one prompt with 0/1 rewards,
every term a(r) psi_j has E[psi_j | r_j] = grad J (r_j - J) / (J (1 - J)), so E[g_i] =
c(J_i) grad J_i, a scale c that depends on the prompt's pass rate (c = 1 for fixed-size
rloo). Across prompts with different pass rates the scales differ, so the direction is
biased too. ``grpolab mse --env bandit --sampling adaptive`` measures c and the bias on a
softmax bandit with prompts of known pass rates (docs/sampling.md reports it).
"""

from __future__ import annotations

import dataclasses
import heapq
import math

SAMPLING_MODES = ("fixed", "filter", "adaptive")


def next_round_size(B: int, kept: int, drawn: int) -> int:
    """Prompts to draw in the next ``filter`` round, having kept ``kept`` of ``drawn`` so far.

    The expected number still needed, ceil((B - kept) / keep rate), between the shortfall and B.
    A step that has kept nothing yet draws B again.
    """
    short = B - kept
    if short <= 0:
        return 0
    if kept == 0:
        return B
    return max(short, min(B, math.ceil(short * drawn / kept)))


def sample_variance(rewards: list[float]) -> float:
    """Unbiased sample variance of a pilot's rewards (0 for fewer than 2)."""
    n = len(rewards)
    if n < 2:
        return 0.0
    m = sum(rewards) / n
    return sum((r - m) ** 2 for r in rewards) / (n - 1)


def allocate_group_sizes(pilot_rewards: list[list[float]], budget: int, max_group_size: int) -> list[int]:
    """Group size of each prompt: its pilot plus a share of what the budget has left (module docstring).

    ``pilot_rewards``: one list per prompt (its pilot rollouts' rewards, n0 >= 2 each).
    ``budget``: total rollouts of the step, pilots included. Returns sizes summing to
    ``budget`` exactly, each between its pilot's size and ``max_group_size``.
    """
    sizes = [len(r) for r in pilot_rewards]
    if min(sizes, default=2) < 2:
        raise ValueError("every pilot needs at least 2 rollouts")
    left = budget - sum(sizes)
    if left < 0:
        raise ValueError(f"the pilots ({sum(sizes)} rollouts) exceed the step's budget ({budget})")
    if left > len(sizes) * max_group_size - sum(sizes):
        raise ValueError(f"a budget of {budget} does not fit {len(sizes)} groups of at most {max_group_size}")
    var = [sample_variance(r) for r in pilot_rewards]
    # Max-heap of marginal decreases V / ((n - 1) n) of the objective sum V / (n - 1).
    heap = [(-v / ((n - 1) * n), i) for i, (v, n) in enumerate(zip(var, sizes)) if v > 0 and n < max_group_size]
    heapq.heapify(heap)
    while left and heap:
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        left -= 1
        if sizes[i] < max_group_size:
            n = sizes[i]
            heapq.heappush(heap, (-var[i] / ((n - 1) * n), i))
    # Budget left over (every prompt with variance at the cap, or none with variance): evenly.
    while left:
        i = min((i for i in range(len(sizes)) if sizes[i] < max_group_size), key=lambda i: (sizes[i], i))
        sizes[i] += 1
        left -= 1
    return sizes


def prompt_weights(sizes: list[int]) -> list[float]:
    """Per-group advantage factor N / (B n_i): every prompt weighs 1/B in the step's mean (1.0 when all sizes are equal)."""
    N, B = sum(sizes), len(sizes)
    return [N / (B * n) for n in sizes]


# ---------------------------------------------------------------- the rank-aware group size (--group-size-control rank)


@dataclasses.dataclass(frozen=True)
class RankControl:
    """The rank-aware controller's state: the step's group size, the effective rank it is compared against (the
    first probe at this group size; None until then), and the step of the last change."""

    group_size: int
    reference: float | None = None
    changed_at: int = 0


def rank_control(
    state: RankControl,
    step: int,
    eff_rank: float | None,
    budget: int,
    min_prompts: int,
    patience: int,
    divisor: int = 1,
    share: float = 0.5,
) -> RankControl:
    """The next state after a step whose probe measured ``eff_rank`` (None: no probe this step, or no group with
    reward variance). The effective rank of the step's groups led the held-out accuracy's saturation by 9 steps in 48
    on SmolLM2 (docs/foundations.md): when it has fallen to ``share`` (half) of its first value at this group size, at least
    ``patience`` steps after the last change, the group size doubles and the prompts per step halve, so the step's
    rollouts stay ``budget``; the reference is then taken again at the new size. Never beyond ``budget //
    min_prompts`` rollouts a group, nor to a size that does not divide the budget into a number of prompts that
    ``divisor`` (the process count) divides."""
    if eff_rank is None:
        return state
    if state.reference is None:
        return dataclasses.replace(state, reference=eff_rank)
    doubled = 2 * state.group_size
    room = doubled <= budget // min_prompts and budget % doubled == 0 and (budget // doubled) % divisor == 0
    if eff_rank <= share * state.reference and step - state.changed_at >= patience and room:
        return RankControl(doubled, None, step)
    return state
