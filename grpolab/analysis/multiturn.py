"""``grpolab multiturn``: GRPO's per-stage bias in multi-turn tasks, and what removes it [Foundations, Sec. 6].

``chain`` is exact (dynamic programming, ``grpolab.analysis.multiturn_chain``). On a language model the bias is measured on
the policy's own episodes, in any environment (``--env arith``, the built-in dialogue; ``--env FILE.py:Class``;
``--tools``), played through the same episode runner as training (``grpolab.rollout.episodes``):

1. R episodes of each of D records; their per-turn rewards (the reward functions' sum on the final conversation
   counts as a reward of the last turn);
2. the value of every visited state, twice, from two independent sets of K continuations branched from it
   (:meth:`EpisodeRunner.branch`): the state before turn 1 is the record itself, the state before turn h the
   episode's first h - 1 replies;
3. per stage h, over the episodes that reached it: GRPO's bias given the history, past rewards ("leakage") plus
   v(s_h) - v(s_1) ("value mismatch", Eq. 23), reward-to-go's (the mismatch alone) and rtg-mc's (v_a - v_b: 0 up
   to noise); their root mean square over histories with each estimate's noise variance taken out of the squares,
   and a 95% bootstrap interval over records.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple

import torch

from grpolab.analysis.multiturn_chain import STAGE_ADVANTAGES, Chain, exact_bias, monte_carlo_bias
from grpolab.common import streams
from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given
from grpolab.common.rng import set_threads
from grpolab.common.stats import percentile_interval
from grpolab.config import fields
from grpolab.config.fields import FROM_RUN

MEASURE_DIALOGUE_SEED = 20_240_004  # dialogues of the bias measurement (not the held-out ones)


@dataclasses.dataclass(frozen=True)
class MultiturnConfig:
    """Per-stage bias of GRPO's advantage (Eq. 22-23), split into past-reward leakage and value
    mismatch, next to reward-to-go with the group baseline (rtg-group) and reward-to-go minus a
    Monte Carlo state value (rtg-mc): exactly on a chain, or measured on a policy's own episodes in an environment."""

    env: str = dataclasses.field(default="", metadata=fields.takes_object("environment", "env"))
    """'chain' (tabular, exact by dynamic programming), 'arith' (the built-in arithmetic dialogue) or an
    environment, 'path/to/file.py:Class' or 'module:Class' (its records from --data). Default: a run's own
    environment (--policy RUN), the --tools environment with --tools, else chain."""
    tools: tuple[str, ...] = dataclasses.field(default=(), metadata=fields.takes_object("tool", "tools"))
    """Episodes of the --tools environment (these functions) on --data's prompts, as in training."""
    policy: str = "builtin"
    """The policy: 'builtin', a model directory or .gguf file, 'smollm2-135m-instruct', or a run directory (its
    checkpoint at --step; its environment, data, prompt format and reward functions unless given here)."""
    step: int | None = None
    """With a run directory as --policy: the checkpoint to measure (0 = its start; default: the newest)."""
    data: str = dataclasses.field(default="", metadata=fields.takes_object("data", "data"))
    """Records of --env/--tools episodes (a data file as --data takes); default: the run's held-out records."""
    reward_fn: tuple[str, ...] = dataclasses.field(
        default=(), metadata={**FROM_RUN, **fields.takes_object("reward function", "reward_funcs")}
    )
    """Reward functions on the final conversation, added to the last turn's reward (a run: its own)."""
    stages: int = 4
    """H: stages of the chain and the dialogue; for an environment, the most turns of an episode."""
    group_size: int = 8
    """R, rollouts per group."""
    q1: float = 0.8
    """chain: success probability after a success."""
    q0: float = 0.3
    """chain: success probability after a failure."""
    groups: int = 50_000
    """chain: Monte Carlo groups."""
    max_operand: int = 50
    """arith: largest operand of the dialogue's questions."""
    episodes: int = 16
    """D: records measured (each with a group of R episodes)."""
    branches: int = 8
    """K: continuations branched from each visited state (twice) to estimate its value."""
    max_new_tokens: int = dataclasses.field(default=48, metadata=FROM_RUN)
    """Longest reply per turn (a run: its own)."""
    max_episode_tokens: int = dataclasses.field(default=1024, metadata=FROM_RUN)
    """The most tokens an episode adds after its opening prompt (a run: its own)."""
    temperature: float = dataclasses.field(default=1.0, metadata=FROM_RUN)
    """Sampling temperature (a run: its own)."""
    context: str = "question"
    """arith: what the policy sees at a turn: 'question' or the whole 'dialogue' (see grpolab/env/arith.py)."""
    rollout_engine: str = "hf"
    """What generates the episodes: 'hf' (grpolab's sampler) or 'vllm'."""
    bootstrap: int = 400
    """Bootstrap resamples for the 95% intervals."""
    out: str = "runs/multiturn"
    """Output directory (multiturn.json, multiturn.png)."""
    json: str = ""
    """Also write the records to this file."""
    seed: int = 0
    """Seed."""
    threads: int = 1
    """Torch intra-op threads."""

    @property
    def kind(self) -> str:
        """What is measured: 'chain', or 'episodes' of an environment (arith, a class, --tools, a run's own)."""
        if self.env == "chain" or not (self.env or self.tools or _is_run(self.policy)):
            return "chain"
        return "episodes"

    def validate(self) -> None:
        if self.env and self.tools:
            raise ConfigError("--env and --tools: give one")
        if ":" not in self.env and self.env not in ("chain", "arith", ""):
            raise ConfigError(f"--env must be 'chain', 'arith' or FILE.py:Class / module:Class, got {self.env!r}")
        if self.stages < 1:
            raise ConfigError(f"--stages must be >= 1, got {self.stages}")
        if self.group_size < 2:
            raise ConfigError(f"--group-size must be >= 2, got {self.group_size}")
        if not (0 <= self.q0 <= 1 and 0 <= self.q1 <= 1):
            raise ConfigError(f"--q0 and --q1 must lie in [0, 1], got {self.q0}, {self.q1}")
        if self.branches < 2:
            raise ConfigError(f"--branches must be >= 2 (the noise correction needs a variance), got {self.branches}")
        if self.episodes < 1:
            raise ConfigError(f"--episodes must be >= 1, got {self.episodes}")
        if self.context not in ("question", "dialogue"):
            raise ConfigError(f"--context must be 'question' or 'dialogue', got {self.context!r}")
        if self.rollout_engine not in ("hf", "vllm"):
            raise ConfigError(f"--rollout-engine must be 'hf' or 'vllm', got {self.rollout_engine!r}")


def _is_run(spec: str) -> bool:
    return (Path(spec) / "config.json").is_file()


def run_chain(cfg: MultiturnConfig) -> list[dict]:
    chain = Chain(cfg.stages, cfg.q1, cfg.q0)
    exact = {(r["stage"], r["estimator"]): r for r in exact_bias(chain)}
    rows = monte_carlo_bias(chain, cfg.group_size, cfg.groups, branches=cfg.branches, seed=cfg.seed, boot=cfg.bootstrap)
    for r in rows:
        ex = exact[(r["stage"], r["estimator"])]
        r["bias_rms_exact"] = ex["bias_rms"]
        r["bias_mean_exact"] = ex["bias_mean"]
        r["leakage_rms_exact"] = ex["leakage_rms"]
        r["mismatch_rms_exact"] = ex["mismatch_rms"]
    return rows


def _corrected_rms(b: torch.Tensor, noise: torch.Tensor, w: torch.Tensor | None = None) -> float:
    """RMS of per-history bias estimates ``b`` with their noise variances ``noise`` taken out of the squares
    (``w``: weights of the histories, e.g. bootstrap counts)."""
    w = torch.ones_like(b) if w is None else w
    if float(w.sum()) == 0:
        return 0.0
    return math.sqrt(max(float((w * (b * b - noise)).sum()) / float(w.sum()), 0.0))


def _rms_stats(
    b: torch.Tensor, noise: torch.Tensor, cluster: torch.Tensor, boot: int, gen: torch.Generator
) -> tuple[float, float | None, float | None]:
    """``_corrected_rms`` and its 95% bootstrap interval, resampling clusters (records); no interval (None, None)
    when the episodes come from fewer than two records, where resampling records cannot vary anything."""
    ids = torch.unique(cluster)
    if len(ids) < 2:
        return _corrected_rms(b, noise), None, None
    onehot = (cluster[None, :] == ids[:, None]).double()  # [C, n]
    vals = []
    for _ in range(boot):
        counts = torch.bincount(torch.randint(0, len(ids), (len(ids),), generator=gen), minlength=len(ids)).double()
        vals.append(_corrected_rms(b, noise, counts @ onehot))
    return (_corrected_rms(b, noise), *percentile_interval(vals))


# ---------------------------------------------------------------------- a policy's episodes
class _Task(NamedTuple):
    """What episodes are measured: the rollout service that plays them (engine, policy, environment, the run's
    reward functions), the records and the sampling settings."""

    service: object
    records: list[dict]
    settings: object

    def final_rewards(self, episodes) -> list[float]:
        """The reward functions' sum on each episode's final conversation (0 without reward functions)."""
        if not self.service.reward.reward_fns:
            return [0.0] * len(episodes)
        return self.service.final_rewards(episodes).total.tolist()


def _task(cfg: MultiturnConfig, log, given: Given) -> _Task:
    """The policy, its environment and the records to measure, as training would play them."""
    from grpolab.data.dialogues import make_dialogues
    from grpolab.env import environment
    from grpolab.eval.runs import RunTask, load_task_policy, resolve_target
    from grpolab.rewards.rewarder import rewarder_for
    from grpolab.rollout.placement import greedy_texts
    from grpolab.rollout.sampler import SamplingSettings
    from grpolab.rollout.service import RolloutService

    target = resolve_target(cfg.policy, cfg.step)
    task = RunTask.of(target, cfg, given, **_episode_options(cfg))
    if not task.multi_turn:
        raise ConfigError(f"--policy {cfg.policy}: its run trained single-turn; give --env or --tools")
    policy = load_task_policy(target, task, given=given)
    policy.model.eval()
    if task.episodes.task == "arith-multiturn":
        records = make_dialogues(cfg.episodes, MEASURE_DIALOGUE_SEED + cfg.seed, _spec(task))
    else:
        records = task.data(max(cfg.episodes, 1), log=lambda *a: None, given=given)[0][: cfg.episodes]
    env = environment(task.episodes, task.arithmetic.max_operand, policy, records[0], given)
    engine = _engine(task, cfg.rollout_engine, policy, log)
    gen = task.generation
    # the run's reward functions, scored as training scores an episode
    reward = rewarder_for(
        task.reward, policy, episodes=True, max_new_tokens=gen.max_new_tokens, sandbox=task.code_sandbox, given=given,
        greedy=greedy_texts,
    )  # fmt: skip
    reward.start(log)
    settings = SamplingSettings.of(gen, ignore_eos=False)
    log(f"measuring {policy.source} on {env.name}: {len(records)} records x {cfg.group_size} episodes")
    return _Task(RolloutService(engine, policy, reward, env), records, settings)


def _episode_options(cfg: MultiturnConfig) -> dict:
    """The task options ``cfg`` sets over the run's: the environment (--env, --tools), its turns, its records."""
    options = {"seed": cfg.seed}
    if cfg.env == "arith":
        options.update(task="arith-multiturn", env="", tools=(), stages=cfg.stages, dialogue_context=cfg.context)
        options.update(max_operand=cfg.max_operand)
    elif cfg.env or cfg.tools:
        options.update(task="arith", env=cfg.env, tools=tuple(cfg.tools), max_turns=cfg.stages)
    if cfg.data:
        options.update(data=cfg.data, eval_data=cfg.data, eval_fraction=0.0)
    return options


def _spec(task):
    from grpolab.data.dialogues import DialogueSpec

    ep = task.episodes
    return DialogueSpec(ep.stages, max_operand=min(task.arithmetic.max_operand, 50), context=ep.dialogue_context)


def _engine(task, kind: str, policy, log):
    from grpolab.config.rollout import EngineSection
    from grpolab.rollout.engine import EngineSpec
    from grpolab.rollout.placement import build_engine

    engine = build_engine(EngineSpec.of(EngineSection(rollout_engine=kind), task.seed, policy), policy.model)
    if kind != "hf":
        log(f"rollout engine: {kind}")
    return engine


class _Values(NamedTuple):
    """Two independent branched estimates (a, b) of v(s_h) for every episode's visited state and their noise
    variances: per stage h = 1 .. H (index 0: s_1), a ``[N]`` tensor each (0 where the episode did not reach h)."""

    a: list[torch.Tensor]
    var_a: list[torch.Tensor]
    b: list[torch.Tensor]
    var_b: list[torch.Tensor]


def _turn_table(episodes, finals: list[float], H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, H]`` per-turn rewards (the final reward on the last turn) and ``[N]`` turns."""
    r = torch.zeros(len(episodes), H, dtype=torch.float64)
    for i, (e, f) in enumerate(zip(episodes, finals)):
        rewards = list(e.rewards) or [0.0]
        rewards[-1] += f
        r[i, : len(rewards)] = torch.tensor(rewards[:H], dtype=torch.float64)
    return r, torch.tensor([e.turns for e in episodes])


def _reward_to_go(branched, finals: list[float], h: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[M]`` and variance of the mean ``[M]`` of the reward-to-go from turn h of K continuations each."""
    g = torch.tensor([sum(e.rewards[h:]) + f for e, f in zip(branched, finals)], dtype=torch.float64).view(-1, K)
    return g.mean(dim=1), g.var(dim=1, unbiased=True) / K


def _measure_episodes(task: _Task, cfg: MultiturnConfig, log) -> tuple[torch.Tensor, torch.Tensor, _Values]:
    """R episodes of each record, their rewards ``[N, H]``, turns ``[N]`` and the branched values of their states."""
    D, R, K, H = len(task.records), cfg.group_size, cfg.branches, cfg.stages
    rep = [rec for rec in task.records for _ in range(R)]
    with torch.no_grad():
        eps = task.service.play(rep, [(streams.DIALOGUE, cfg.seed, n) for n in range(D * R)], task.settings)
        rewards, turns = _turn_table(eps, task.final_rewards(eps), H)
        log(f"episodes: mean reward per stage {[round(float(x), 3) for x in rewards.mean(0)]}")
        values = _Values([], [], [], [])
        for s in range(2):  # v(s_1) of each record: fresh episodes
            keys = [(streams.BRANCH, cfg.seed, 0, s, d, k) for d in range(D) for k in range(K)]
            fresh = task.service.play([rec for rec in task.records for _ in range(K)], keys, task.settings)
            v, var = _reward_to_go(fresh, task.final_rewards(fresh), 0, K)
            (values.a if s == 0 else values.b).append(v.repeat_interleave(R))
            (values.var_a if s == 0 else values.var_b).append(var.repeat_interleave(R))
        for h in range(1, H):
            alive = [i for i, e in enumerate(eps) if e.turns > h]
            for s in range(2):
                full, var_full = torch.zeros(D * R, dtype=torch.float64), torch.zeros(D * R, dtype=torch.float64)
                if alive:
                    keys = [(streams.BRANCH, cfg.seed, h, s, i, k) for i in alive for k in range(K)]
                    branched = task.service.branch([eps[i] for i in alive for _ in range(K)], h, keys, task.settings)
                    v, var = _reward_to_go(branched, task.final_rewards(branched), h, K)
                    full[alive], var_full[alive] = v, var
                (values.a if s == 0 else values.b).append(full)
                (values.var_a if s == 0 else values.var_b).append(var_full)
            log(f"stage {h + 1}: {len(alive)} episodes reached it, values from {len(alive) * K * 2} branches")
    return rewards, turns, values


def run_episodes(cfg: MultiturnConfig, log=print, given: Given = NOTHING) -> list[dict]:
    """Bias per stage on a policy's episodes, from branched Monte Carlo values of the visited states."""
    set_threads(cfg.threads)
    task = _task(cfg, log, given)
    try:
        rewards, turns, values = _measure_episodes(task, cfg, log)
    finally:
        task.service.close()
    cluster = torch.arange(len(task.records)).repeat_interleave(cfg.group_size)  # [N] each episode's record
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for h in range(cfg.stages):
        alive = turns > h
        if alive.any():
            rows += _stage_rows(h, rewards, values, cluster, alive, cfg.bootstrap, gen)
    return rows


def _stage_rows(
    h: int, r: torch.Tensor, v: _Values, cluster: torch.Tensor, alive: torch.Tensor, boot: int, gen: torch.Generator
) -> list[dict]:
    """The records of stage h + 1 (0-based h), one per estimator, over the episodes that reached it; rewards r
    ``[N, H]``."""
    past = r[:, :h].sum(dim=1)  # [N]
    if h == 0:  # s_1 is the initial state itself: leakage and mismatch are 0 by definition
        mis, mis_noise = torch.zeros_like(past), torch.zeros_like(past)
    else:  # the value mismatch v(s_h) - v(s_1): the noise of both estimates adds
        mis, mis_noise = v.a[h] - v.a[0], v.var_a[h] + v.var_a[0]
    parts = {  # (leakage, mismatch, noise variance of the mismatch)
        "grpo": (past, mis, mis_noise),
        "rtg-group": (torch.zeros_like(past), mis, mis_noise),
        "rtg-mc": (torch.zeros_like(past), v.a[h] - v.b[h], v.var_a[h] + v.var_b[h]),
    }
    rows = []
    for est in STAGE_ADVANTAGES:
        leak, m, noise = (t[alive] for t in parts[est])
        b = leak + m
        rms, lo, hi = _rms_stats(b, noise, cluster[alive], boot, gen)
        rows.append(
            {
                "stage": h + 1,
                "estimator": est,
                "episodes": int(alive.sum()),
                "bias_mean": float(b.mean()),
                "bias_rms": rms,
                "ci_low": lo,
                "ci_high": hi,
                "leakage_rms": math.sqrt(float((leak * leak).mean())),
                "mismatch_rms": _corrected_rms(m, noise),
                "reward": float(r[alive, h].mean()),
            }
        )
    return rows


def run_multiturn(cfg: MultiturnConfig, log=print, given: Given = NOTHING) -> list[dict]:
    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_chain(cfg) if cfg.kind == "chain" else run_episodes(cfg, log=log, given=given)
    (out / "multiturn.json").write_text(json.dumps({"config": fields.to_flat(cfg), "records": rows}, indent=2))
    if cfg.json:
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(rows, indent=2))
    from grpolab.analysis.plots import plot_multiturn

    where = "chain" if cfg.kind == "chain" else cfg.env or ("tools" if cfg.tools else cfg.policy)
    plot_multiturn(rows, out / "multiturn.png", title=f"{where}, H = {cfg.stages}, R = {cfg.group_size}")
    return rows


def format_multiturn(rows: list[dict]) -> str:
    exact = "bias_rms_exact" in rows[0]
    head = f"{'stage':>5} {'estimator':<10} {'bias mean':>10} {'bias RMS [95% CI]':>28}" + (
        f" {'exact RMS':>10}" if exact else ""
    )
    lines = [head + f" {'leakage RMS':>12} {'mismatch RMS':>13}" + ("" if exact else f" {'episodes':>9}")]
    for r in rows:
        ci = "[ one record: none ]" if r["ci_low"] is None else f"[{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
        line = f"{r['stage']:>5} {r['estimator']:<10} {r['bias_mean']:>10.4f} {r['bias_rms']:>10.4f} {ci:>17}"
        if exact:
            inside = r["ci_low"] is not None and r["ci_low"] <= r["bias_rms_exact"] <= r["ci_high"]
            line += f" {r['bias_rms_exact']:>10.4f}{'' if inside else ' (outside)'}"
        line += f" {r['leakage_rms']:>12.4f} {r['mismatch_rms']:>13.4f}"
        lines.append(line + ("" if exact else f" {r['episodes']:>9}"))
    return "\n".join(lines)
