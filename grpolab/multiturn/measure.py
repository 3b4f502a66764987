"""``grpolab multiturn``: GRPO's per-stage bias in multi-turn tasks, and what removes it [Foundations, Sec. 6]."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple

import torch

from grpolab import streams
from grpolab.config import ConfigError
from grpolab.multiturn.chain import STAGE_ADVANTAGES, Chain, exact_bias, monte_carlo_bias
from grpolab.multiturn.dialogue import DialogueSpec, branch_values, make_dialogues, play
from grpolab.utils import percentile_interval, set_threads

MEASURE_DIALOGUE_SEED = 20_240_004  # dialogues of the bias measurement (not the held-out ones)


@dataclasses.dataclass
class MultiturnConfig:
    """Per-stage bias of GRPO's advantage (Eq. 22-23), split into past-reward leakage and value
    mismatch, next to reward-to-go with the group baseline (rtg-group) and reward-to-go minus a
    Monte Carlo state value (rtg-mc)."""

    env: str = "chain"
    """'chain' (tabular, exact by dynamic programming) or 'arith' (the dialogue on a language model)."""
    stages: int = 4
    """H, the number of stages (turns)."""
    group_size: int = 8
    """R, rollouts per group."""
    q1: float = 0.8
    """chain: success probability after a success."""
    q0: float = 0.3
    """chain: success probability after a failure."""
    groups: int = 50_000
    """chain: Monte Carlo groups."""
    model: str = "builtin"
    """arith: the policy."""
    max_operand: int = 50
    """arith: largest operand of the dialogue's questions."""
    dialogues: int = 16
    """arith: dialogues measured (each with a group of R trajectories)."""
    branches: int = 8
    """Continuations branched from each visited state to estimate its value."""
    max_new_tokens: int = 32
    """arith: longest answer per turn."""
    temperature: float = 1.0
    """arith: sampling temperature."""
    context: str = "question"
    """arith: what the policy sees at a turn: 'question' or the whole 'dialogue' (see grpolab/multiturn/dialogue.py)."""
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

    def validate(self) -> None:
        if self.env not in ("chain", "arith"):
            raise ConfigError(f"--env must be 'chain' or 'arith', got {self.env!r}")
        if self.stages < 1:
            raise ConfigError(f"--stages must be >= 1, got {self.stages}")
        if self.group_size < 2:
            raise ConfigError(f"--group-size must be >= 2, got {self.group_size}")
        if not (0 <= self.q0 <= 1 and 0 <= self.q1 <= 1):
            raise ConfigError(f"--q0 and --q1 must lie in [0, 1], got {self.q0}, {self.q1}")
        if self.branches < 2:
            raise ConfigError(f"--branches must be >= 2 (the noise correction needs a variance), got {self.branches}")
        if self.context not in ("question", "dialogue"):
            raise ConfigError(f"--context must be 'question' or 'dialogue', got {self.context!r}")


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
    return math.sqrt(max(float((w * (b * b - noise)).sum()) / float(w.sum()), 0.0))


def _rms_stats(
    b: torch.Tensor, noise: torch.Tensor, cluster: torch.Tensor, boot: int, gen: torch.Generator
) -> tuple[float, float, float]:
    """``_corrected_rms`` and its 95% bootstrap interval, resampling clusters (dialogues)."""
    ids = torch.unique(cluster)
    onehot = (cluster[None, :] == ids[:, None]).double()  # [C, n]
    vals = []
    for _ in range(boot):
        counts = torch.bincount(torch.randint(0, len(ids), (len(ids),), generator=gen), minlength=len(ids)).double()
        vals.append(_corrected_rms(b, noise, counts @ onehot))
    return (_corrected_rms(b, noise), *percentile_interval(vals))


def run_arith(cfg: MultiturnConfig, log=print) -> list[dict]:
    """Bias per stage on the dialogue, from branched Monte Carlo values of the visited states."""
    from grpolab.policy import load_policy

    set_threads(cfg.threads)
    spec = DialogueSpec(cfg.stages, max_operand=cfg.max_operand, context=cfg.context)
    policy = load_policy(cfg.model)
    policy.model.eval()
    dialogues = make_dialogues(cfg.dialogues, MEASURE_DIALOGUE_SEED + cfg.seed, spec)
    with torch.no_grad():
        rewards, values = _measure_dialogues(policy, dialogues, cfg, spec, log)
    cluster = torch.arange(cfg.dialogues).repeat_interleave(cfg.group_size)  # [D*R] each rollout's dialogue
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for h in range(cfg.stages):
        rows += _stage_rows(h, rewards, values, cluster, cfg.bootstrap, gen)
    return rows


class _BranchValues(NamedTuple):
    """Two independent branched estimates (a, b) of v(s_h) for every rollout's visited state and
    their noise variances: per stage h = 1 .. H (index 0: s_1), a ``[D*R]`` tensor each."""

    a: list[torch.Tensor]
    var_a: list[torch.Tensor]
    b: list[torch.Tensor]
    var_b: list[torch.Tensor]


def _measure_dialogues(
    policy, dialogues: list, cfg: MultiturnConfig, spec: DialogueSpec, log
) -> tuple[torch.Tensor, _BranchValues]:
    """R rollouts of each dialogue, their rewards ``[D*R, H]``, and the branched values of their states."""
    D, R, K = cfg.dialogues, cfg.group_size, cfg.branches
    kw = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
    rep = [d for d in dialogues for _ in range(R)]
    turns = play(policy, rep, [None] * (D * R), 0, [(streams.DIALOGUE, cfg.seed, n) for n in range(D * R)], spec, **kw)
    r = turns.rewards  # [D*R, H]
    log(f"dialogue rollouts: per-stage accuracy {[round(float(x), 3) for x in r.mean(0)]}")
    # v(s_1) of each dialogue, twice (independent sets), and v(s_h) of every visited state, twice
    v1a, var1a = branch_values(policy, dialogues, [None] * D, 0, K, (cfg.seed, 0, 0), spec, **kw)
    v1b, var1b = branch_values(policy, dialogues, [None] * D, 0, K, (cfg.seed, 0, 1), spec, **kw)
    values = _BranchValues(
        [v1a.repeat_interleave(R)],
        [var1a.repeat_interleave(R)],
        [v1b.repeat_interleave(R)],
        [var1b.repeat_interleave(R)],
    )
    for h in range(1, cfg.stages):
        a, av = branch_values(policy, rep, turns.answers[h - 1], h, K, (cfg.seed, h, 0), spec, **kw)
        b, bv = branch_values(policy, rep, turns.answers[h - 1], h, K, (cfg.seed, h, 1), spec, **kw)
        values.a.append(a), values.var_a.append(av), values.b.append(b), values.var_b.append(bv)
        log(f"stage {h + 1}: values estimated ({D * R * K * 2} branches)")
    return r, values


def _stage_rows(
    h: int, r: torch.Tensor, v: _BranchValues, cluster: torch.Tensor, boot: int, gen: torch.Generator
) -> list[dict]:
    """The records of stage h + 1 (0-based h), one per estimator; rewards r ``[D*R, H]``."""
    past = r[:, :h].sum(dim=1)  # [D*R]
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
        leak, m, noise = parts[est]
        b = leak + m
        rms, lo, hi = _rms_stats(b, noise, cluster, boot, gen)
        rows.append(
            {
                "stage": h + 1,
                "estimator": est,
                "bias_mean": float(b.mean()),
                "bias_rms": rms,
                "ci_low": lo,
                "ci_high": hi,
                "leakage_rms": math.sqrt(float((leak * leak).mean())),
                "mismatch_rms": _corrected_rms(m, noise),
                "accuracy": float(r[:, h].mean()),
            }
        )
    return rows


def run_multiturn(cfg: MultiturnConfig, log=print) -> list[dict]:
    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_chain(cfg) if cfg.env == "chain" else run_arith(cfg, log=log)
    (out / "multiturn.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), "records": rows}, indent=2))
    if cfg.json:
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(rows, indent=2))
    from grpolab.probes.plots import plot_multiturn

    plot_multiturn(rows, out / "multiturn.png", title=f"{cfg.env}, H = {cfg.stages}, R = {cfg.group_size}")
    return rows


def format_multiturn(rows: list[dict]) -> str:
    exact = "bias_rms_exact" in rows[0]
    head = f"{'stage':>5} {'estimator':<10} {'bias mean':>10} {'bias RMS [95% CI]':>28}" + (
        f" {'exact RMS':>10}" if exact else ""
    )
    lines = [head + f" {'leakage RMS':>12} {'mismatch RMS':>13}"]
    for r in rows:
        line = f"{r['stage']:>5} {r['estimator']:<10} {r['bias_mean']:>10.4f} {r['bias_rms']:>10.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
        if exact:
            inside = r["ci_low"] <= r["bias_rms_exact"] <= r["ci_high"]
            line += f" {r['bias_rms_exact']:>10.4f}{'' if inside else ' (outside)'}"
        lines.append(line + f" {r['leakage_rms']:>12.4f} {r['mismatch_rms']:>13.4f}")
    return "\n".join(lines)
