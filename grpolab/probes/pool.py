"""A pool of rollouts from a policy, reduced to what the MSE and group-size probes need.

For each of M prompts: N rollouts, their rewards, the N x N Gram matrix of their score
vectors (one forward + one backward, :func:`grpolab.probes.gram.score_gram`), and one
D-dimensional leave-one-out gradient estimate mu_hat(x) whose cross inner products
<mu_hat(x), mu_hat(x')> (x != x') estimate ||grad J||^2 without bias. Only the M x M
matrix of those products is kept; the vectors are held long enough to form it.

On P processes each rank takes a block of the prompts (prompt k's rollouts draw from the
stream keyed by its global index k, so they do not depend on P) and the per-prompt results
and the M x M products are gathered (grpolab.distributed.gram): every rank ends with the
single-process pool.
"""

from __future__ import annotations

import dataclasses

import torch

from grpolab import distributed, streams
from grpolab.distributed import SINGLE, World
from grpolab.logprobs import completion_logprobs
from grpolab.policy import Policy
from grpolab.probes.gram import _count_sketch, _select_params, score_gram
from grpolab.probes.mse import prompt_moments, rloo_weights
from grpolab.progress import progress_bar
from grpolab.rewards import default_reward_fns, overlong_penalty, score
from grpolab.rollout import Batch, sample_with_stats

EXACT_POOL_FLOATS = 2**28  # 1 GB of float32 leave-one-out vectors; beyond it they are sketched
SKETCH_DIM = 2**22


def sample_rollouts(
    policy: Policy,
    record: dict,
    n: int,
    key: tuple,
    *,
    max_new_tokens: int,
    temperature: float,
    format_weight: float,
    overlong: tuple[int, float] = (0, 1.0),
    entropy: list | None = None,
) -> tuple[Batch, torch.Tensor]:
    """n rollouts of one prompt and their rewards ``[n]``; rollout i draws from stream (*key, i).

    ``overlong``: (buffer, penalty) of DAPO's length penalty, added to the reward as in training.
    ``entropy``: a list that receives the rollouts' token entropies ``[n, T]``."""
    batch, _, ent = sample_with_stats(
        policy.model,
        [policy.prompt_ids(record)] * n,
        [(*key, i) for i in range(n)],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        eos_id=policy.eos_id,
        pad_id=policy.pad_id,
    )
    if entropy is not None:
        entropy.append(ent)
    texts = policy.decode(batch.completion_ids, batch.completion_mask)
    rewards = score(texts, [record] * n, default_reward_fns(format_weight)).total
    if overlong[0]:
        rewards = rewards + overlong_penalty(batch.completion_mask.sum(1).cpu(), max_new_tokens, *overlong)
    return batch, rewards


@dataclasses.dataclass
class Pool:
    moments: list[dict[str, float]]  # per prompt: A2, O2, H2, mu2 (grpolab.probes.mse)
    cross: torch.Tensor  # [M, M] <mu_hat(x), mu_hat(x')>
    reward_mean: list[float]  # per prompt
    reward_std: list[float]


def collect_pool(
    policy: Policy,
    records: list[dict],
    n: int,
    *,
    seed: int = 0,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    format_weight: float = 0.1,
    include: str | None = None,
    progress: bool = True,
    label: str = "pool",
    world: World = SINGLE,
    sketch_dim: int | None = None,
    log=print,
    overlong: tuple[int, float] = (0, 1.0),
) -> Pool:
    """Sample n rollouts for each record and reduce them (module docstring); over ``world``, each
    rank takes its block of the records and all get the whole pool.

    ``sketch_dim``: 0 keeps the M leave-one-out vectors whole (exact cross products); k > 0 keeps a
    k-dimensional CountSketch of each (unbiased cross products, entry error at most
    sqrt(2/k) ||a|| ||b||); None = exact when the M vectors fit in EXACT_POOL_FLOATS floats, else
    SKETCH_DIM (a real model's M x D floats would not fit in memory: 32 x 135 M x 4 bytes = 17 GB).
    The per-prompt Gram matrices (and so every per-prompt moment) are always exact.
    """
    if n < 3:
        raise ValueError(f"--pool must be >= 3 rollouts per prompt, got {n}")
    model = policy.model
    model.eval()
    chosen = _select_params(model, include)
    params = [p for p in model.parameters() if id(p) in chosen]
    D = sum(p.numel() for p in params)
    if sketch_dim is None:
        sketch_dim = 0 if len(records) * D <= EXACT_POOL_FLOATS else SKETCH_DIM
        if sketch_dim and world.is_main:
            log(
                f"pool: {len(records)} gradients of {D / 1e6:.0f} M parameters would take {len(records) * D * 4 / 2**30:.1f} GB; "
                f"their cross products come from a {sketch_dim}-dimensional CountSketch (unbiased)"
            )
    moments, vectors, means, stds = [], [], [], []
    mine = world.split(len(records))
    with progress_bar(label, len(mine), enabled=progress and world.is_main) as bar:
        for k in mine:  # global prompt index: the random stream does not depend on the process count
            rec = records[k]
            batch, rewards = sample_rollouts(
                policy,
                rec,
                n,
                (streams.POOL, seed, k),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                format_weight=format_weight,
                overlong=overlong,
            )
            # The plain score sum_t grad log pi (weight 1 per token): E[psi] = 0, so mu = E[r psi] is the
            # true gradient. A length-normalised psi would not be a score and would not average to 0.
            weights = batch.completion_mask.double()  # [n, T]
            psi = score_gram(model, batch, weights, temperature=temperature, include=include)  # [n, n]
            moments.append(prompt_moments(psi, rewards))
            a = rloo_weights(rewards)  # [n]
            if bool((rewards == rewards[0]).all()):  # equal rewards: every leave-one-out weight is 0, so is mu_hat
                vectors.append(torch.zeros(sketch_dim or D))
            else:
                logp = completion_logprobs(model, batch, temperature)  # [n, T]
                obj = (logp * (weights * a[:, None]).to(logp.dtype)).sum()
                grads = torch.autograd.grad(obj, params, allow_unused=True)
                blocks = [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)
                ]
                del grads
                if sketch_dim:  # each parameter's block hashed with its own (name-keyed) buckets and signs
                    vectors.append(
                        sum(_count_sketch(b[None], chosen[id(p)], sketch_dim, seed)[0] for b, p in zip(blocks, params))
                    )  # [k]
                else:
                    vectors.append(torch.cat(blocks))  # [D]
                del blocks
            means.append(float(rewards.mean()))
            stds.append(float(rewards.std(unbiased=False)))
            bar.update(len(means), f"mean reward {sum(means) / len(means):.2f}")
    width = sketch_dim or D
    V = torch.stack(vectors).double() if vectors else torch.zeros(0, width, dtype=torch.float64)  # [M / P, D or k]
    cat = lambda xs: distributed.gather_concat(xs, world)  # noqa: E731
    return Pool(cat(moments), distributed.gram(V, world), cat(means), cat(stds))
