"""A pool of rollouts from a policy, reduced to what the MSE and group-size probes need.

For each of M prompts: N rollouts, their rewards, the N x N Gram matrix of their score
vectors (one forward + one backward, :func:`grpolab.probes.gram.score_gram`), and one
D-dimensional leave-one-out gradient estimate mu_hat(x) whose cross inner products
<mu_hat(x), mu_hat(x')> (x != x') estimate ||grad J||^2 without bias. Only the M x M
matrix of those products is kept; the vectors are held long enough to form it.

On P processes each rank takes a block of the prompts (prompt k's rollouts draw from the
stream keyed by its global index k, so they do not depend on P) and the per-prompt results
and the M x M products are gathered (grpolab.common.distributed.gram): every rank ends with the
single-process pool.
"""

from __future__ import annotations

import dataclasses

import torch

from grpolab.common import distributed, streams
from grpolab.common.batch import Batch
from grpolab.common.distributed import SINGLE, World
from grpolab.common.given import NOTHING, Given
from grpolab.common.progress import progress_bar
from grpolab.config.rollout import EngineSection
from grpolab.models.policy import Policy
from grpolab.probes.gram import score_gram, select_params
from grpolab.probes.mse import loo_vector, prompt_moments, sketch_dim_for
from grpolab.rewards.forms import check_columns
from grpolab.rewards.rewarder import Rewarder, rewarder_for
from grpolab.rollout.engine import EngineSpec, SamplingSettings
from grpolab.rollout.placement import build_engine, greedy_texts
from grpolab.rollout.service import RolloutService


@dataclasses.dataclass
class ProbeSampler:
    """How a probe draws and scores rollouts: training's own path, a
    :class:`grpolab.rollout.service.RolloutService` through the run's rollout engine, scored by the run's
    :class:`grpolab.rewards.rewarder.Rewarder` (its reward functions, weights and columns), so a probe measures the
    gradient of the reward the run trained on."""

    service: RolloutService
    settings: SamplingSettings

    @property
    def reward(self) -> Rewarder:
        return self.service.reward

    def __call__(self, record: dict, n: int, key: tuple) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
        """n rollouts of one prompt, their rewards ``[n]`` and the sampler's token entropies ``[n, T]`` (None from an
        engine that gives none: vLLM); rollout i draws from stream (*key, i)."""
        keys = [(*key, i) for i in range(n)]
        rows, _, _ = self.service.sample([record] * n, keys, self.settings)
        return rows.batch, rows.scores.total, rows.entropy

    def close(self) -> None:
        self.service.close()


def probe_sampler(
    policy: Policy,
    task,
    engine: str = "hf",
    log=print,
    records: list[dict] = (),
    given: Given = NOTHING,
    rollout_dtype: str | None = None,
    fp32_head: bool = False,
    autocast: bool = False,
) -> ProbeSampler:
    """The :class:`ProbeSampler` of ``policy`` on ``task`` (a :class:`grpolab.eval.runs.RunTask`: the run's, with
    the probe's sampling and reward options on top) through the rollout engine ``engine`` ('hf' or 'vllm') sampling in
    ``rollout_dtype`` (``--rollout-dtype``'s names; None: the policy's own, so the probe samples what it measures). A reward
    function that needs a column ``records`` lack is named now, in one line, not scored 0 on every rollout; a code
    reward's sandbox starts now (``given``: reward functions given to the Python API). ``fp32_head``, ``autocast``:
    the engine computes as a trainer with ``--fp32-head``, under a mixed precision (``build_engine``). Close it when done (:meth:`ProbeSampler.close`)."""
    gen, data = task.generation, task.dataset
    reward = rewarder_for(
        task.reward,
        policy,
        episodes=task.multi_turn,
        max_new_tokens=gen.max_new_tokens,
        sandbox=task.code_sandbox,
        given=given,
        greedy=greedy_texts,
    )
    if records and (data.data or data.eval_data):
        check_columns(reward.reward_fns, records, f"the probe prompts of {data.eval_data or data.data}")
    reward.start(log)
    own = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
    section = EngineSection(rollout_engine=engine, rollout_dtype=rollout_dtype or own)
    service = RolloutService(
        build_engine(EngineSpec.of(section, task.seed, policy, fp32_head=fp32_head, autocast=autocast), policy.model),
        policy,
        reward,
    )
    return ProbeSampler(service, SamplingSettings.of(gen, ignore_eos=False))


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
    sampler: ProbeSampler,
    *,
    seed: int = 0,
    include: str | None = None,
    progress: bool = True,
    label: str = "pool",
    world: World = SINGLE,
    sketch_dim: int | None = None,
    log=print,
) -> Pool:
    """Sample n rollouts for each record with ``sampler`` and reduce them (module docstring); over ``world``, each
    rank takes its block of the records and all get the whole pool.

    ``sketch_dim``: 0 keeps the M leave-one-out vectors whole (exact cross products); k > 0 keeps a
    k-dimensional CountSketch of each (unbiased cross products, entry error at most
    sqrt(2/k) ||a|| ||b||); None = exact when the M vectors fit in EXACT_VECTOR_FLOATS floats, else
    SKETCH_DIM (a real model's M x D floats would not fit in memory: 32 x 135 M x 4 bytes = 17 GB).
    The per-prompt Gram matrices (and so every per-prompt moment) are always exact.
    """
    if n < 3:
        raise ValueError(f"--pool must be >= 3 rollouts per prompt, got {n}")
    model = policy.model
    model.eval()
    chosen = select_params(model, include)
    params = [p for p in model.parameters() if id(p) in chosen]
    D = sum(p.numel() for p in params)
    sketch_dim = _resolve_sketch_dim(sketch_dim, len(records), D, world, log)
    named = {chosen[id(p)]: p for p in params}
    reduce = _PromptReducer(policy, n, seed, sampler, include, named, sketch_dim)
    moments, vectors, means, stds = [], [], [], []
    mine = world.split(len(records))
    with progress_bar(label, len(mine), enabled=progress and world.is_main) as bar:
        for k in mine:  # global prompt index: the random stream does not depend on the process count
            moment, vector, rewards = reduce(k, records[k])
            moments.append(moment)
            vectors.append(vector)
            means.append(float(rewards.mean()))
            stds.append(float(rewards.std(unbiased=False)))
            bar.update(len(means), f"mean reward {sum(means) / len(means):.2f}")
    return _gather_pool(moments, vectors, means, stds, sketch_dim or D, world)


def _resolve_sketch_dim(sketch_dim: int | None, M: int, D: int, world: World, log) -> int:
    """``sketch_dim`` as given, or for None: 0 (exact) when the M vectors of D floats fit in
    EXACT_VECTOR_FLOATS, else SKETCH_DIM (said once, on the main rank)."""
    if sketch_dim is not None:
        return sketch_dim
    sketch_dim = sketch_dim_for(M, D)
    if sketch_dim and world.is_main:
        log(
            f"pool: {M} gradients of {D / 1e6:.0f} M parameters would take {M * D * 4 / 2**30:.1f} GB; "
            f"their cross products come from a {sketch_dim}-dimensional CountSketch (unbiased)"
        )
    return sketch_dim


@dataclasses.dataclass
class _PromptReducer:
    """collect_pool's work on one prompt: n rollouts, reduced to their moments (from the exact
    n x n Gram matrix) and the leave-one-out gradient mu_hat ``[D]`` (or its CountSketch ``[k]``)."""

    policy: Policy
    n: int
    seed: int
    sampler: ProbeSampler
    include: str | None
    params: dict[str, torch.nn.Parameter]  # the chosen parameters by name, in model order: the blocks of mu_hat
    sketch_dim: int  # 0: mu_hat kept whole

    def __call__(self, k: int, record: dict) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """Prompt k's moments, mu_hat and rewards ``[n]``; its rollouts draw from stream (POOL, seed, k)."""
        batch, rewards, _ = self.sampler(record, self.n, (streams.POOL, self.seed, k))
        # The plain score sum_t grad log pi (weight 1 per token): E[psi] = 0, so mu = E[r psi] is the
        # true gradient. A length-normalised psi would not be a score and would not average to 0.
        weights = batch.completion_mask.double()  # [n, T]
        temperature = self.sampler.settings.temperature
        psi = score_gram(self.policy.model, batch, weights, temperature=temperature, include=self.include)  # [n, n]
        vector = loo_vector(self.policy.model, batch, rewards, self.params, temperature, self.sketch_dim, self.seed)
        return prompt_moments(psi, rewards), vector, rewards


def _gather_pool(moments: list, vectors: list, means: list, stds: list, width: int, world: World) -> Pool:
    """This rank's per-prompt results and mu_hat vectors (each ``[width]``) gathered into the whole pool."""
    V = torch.stack(vectors).double() if vectors else torch.zeros(0, width, dtype=torch.float64)  # [M / P, D or k]
    # every rank makes the same collective calls in the same order
    gathered_moments = distributed.gather_concat(moments, world)
    cross = distributed.gram(V, world)  # [M, M]
    return Pool(
        gathered_moments, cross, distributed.gather_concat(means, world), distributed.gather_concat(stds, world)
    )
