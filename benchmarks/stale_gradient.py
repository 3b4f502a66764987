"""What staleness does to the gradient: the same step's prompts drawn with the weights of K steps before.

    python benchmarks/stale_gradient.py [--data data/last_letter/train.parquet] [--steps 8] [--lags 0,1,2,4]
                                        [--threads 2] [--json FILE]

SmolLM2-135M-Instruct on the last-letter task (``examples/last_letter``: ``python examples/last_letter/make_data.py
--out data/last_letter``), 8 prompts x 8 rollouts of up to 16 tokens, temperature 0.7, lr 1e-5 with 2 warm-up
steps, fp32, seed 0. The script trains ``--steps`` steps, keeping the weights after each (theta_0 .. theta_S). Then,
at the current policy theta_S, it draws the next step's rollouts (its prompts and rollout keys) with theta_{S-K} for
each K of ``--lags``: K = 0 is the on-policy batch, K >= 1 what ``--max-staleness K`` draws there. For each K:

- the token log-ratio log pi_theta_S - log pi_behaviour over the completion tokens: its standard deviation, and the
  sequence log-ratio's (log rho);
- the share of tokens ``--engine-correction sequence-truncate`` (auto under staleness) truncates (rho > C, C = 2)
  and the share ``sequence-mask`` would mask (rho outside [1/C, C]);
- the effective rank of the per-rollout gradient matrix (rows w_i A_i psi_i, psi_i the rollout's score at theta_S
  as the loss weighs its tokens, w_i the correction's weight), averaged over the groups with a contrast;
- the relative error ||g_K - g_0|| / ||g_0|| and the cosine of the corrected stale-batch gradient
  g_K = sum_i w_i A_i psi_i / N against the on-policy one g_0 of the same prompts and keys (every parameter, each
  gradient by backward passes at theta_S);
- as a yardstick, the same two figures for a second on-policy batch of the same prompts drawn with other keys:
  the sampling noise of one step's gradient, against which a stale batch's difference is to be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CAP = 2.0


def gradient(policy, batch, coef, weights, temperature: float, chunk: int = 16):
    """sum_i coef_i sum_t weights_it grad log pi(o_it) at the policy's weights, every parameter, as one flat float64
    vector (``chunk`` rows a backward pass)."""
    import torch

    from grpolab.common.batch import select
    from grpolab.models.logprobs import completion_logprobs

    params = [p for p in policy.model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for start in range(0, batch.completion_ids.shape[0], chunk):
        idx = torch.arange(start, min(start + chunk, batch.completion_ids.shape[0]))
        part = select(batch, idx)
        w = weights[idx][:, : part.completion_ids.shape[1]]  # select trims all-padding completion columns
        logp = completion_logprobs(policy.model, part, temperature)
        loss = (coef[idx, None].to(logp.dtype) * w.to(logp.dtype) * logp).sum()
        for t, g in zip(total, torch.autograd.grad(loss, params)):
            t += g.double()
    return torch.cat([t.reshape(-1) for t in total])


def compare(g, ref) -> dict:
    """Relative error and cosine of gradient ``g`` against ``ref``."""
    return {"rel_error": float((g - ref).norm() / ref.norm()), "cosine": float(g @ ref / (g.norm() * ref.norm()))}


def run_config(args):
    """The run: SmolLM2 on the last-letter task, 8 prompts x 8 rollouts of up to 16 tokens, fp32, seed 0."""
    from grpolab.config.train import TrainConfig

    return TrainConfig(
        model="smollm2-135m-instruct",
        data=args.data,
        eval_data=args.eval_data,
        reward_fn=("examples/last_letter/reward.py:last_letter",),
        temperature=0.7,
        max_new_tokens=16,
        prompts_per_step=8,
        group_size=8,
        lr=1e-5,
        warmup_steps=2,
        steps=args.steps,
        seed=0,
        threads=args.threads,
        eval_every=0,
        save_every=0,
        progress=False,
        out="/tmp/grpolab-stale-gradient",
    )


def train(trainer, steps: int) -> list[dict]:
    """Trains ``steps`` steps; the served weights before the first and after each (theta_0 .. theta_S)."""
    from grpolab.rollout.weights import served_weights

    def snapshot():
        return {n: t.detach().clone() for n, t in served_weights(trainer.policy.model)}

    thetas = [snapshot()]
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        m = trainer.step(step).metrics
        thetas.append(snapshot())
        print(f"step {step}: reward {m['reward/mean']:.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
    return thetas


@dataclasses.dataclass
class Probe:
    """What each measurement at theta_S reads: the policy, B x G, the sampling settings, the advantage estimator
    and the loss's token weighting."""

    policy: object
    B: int
    G: int
    settings: object
    estimator: str
    aggregation: str

    @classmethod
    def of(cls, trainer, cfg) -> Probe:
        from grpolab.algo.loss import effective_aggregation

        objective = trainer.cfg.objective
        aggregation = effective_aggregation(trainer.cfg.terms.loss_type, objective.aggregation)
        settings = trainer.sampling_stage.collector.settings.sampling
        B, G = cfg.groups.prompts_per_step, cfg.groups.group_size
        return cls(trainer.policy, B, G, settings, objective.estimator, aggregation)

    def weights_of(self, batch):
        from grpolab.probes.gram import token_weights

        return token_weights(batch.completion_mask, self.aggregation, self.settings.max_new_tokens)

    def advantages(self, rows):
        from grpolab.algo.advantages import compute_advantages

        return compute_advantages(rows.scores.total.view(self.B, self.G), self.estimator).reshape(-1)

    def gradient(self, batch, coef, weights):
        return gradient(self.policy, batch, coef, weights, self.settings.temperature)


def behaviour_sampler(trainer, probe: Probe, S: int):
    """``draw(theta, seed)``: step S + 1's prompts and rollout keys drawn by a replica of the model holding the
    weights ``theta`` (the behaviour policy), through the run's rollout service."""
    from grpolab.common import streams
    from grpolab.rollout.engine import EngineSpec, HFEngine
    from grpolab.rollout.service import RolloutService

    policy, B, G = probe.policy, probe.B, probe.G
    replica = type(policy.model)(policy.model.config).eval()  # the behaviour policy's model
    engine = HFEngine(replica, EngineSpec(policy.eos_id, policy.pad_id), always_copy=True)
    service = RolloutService(engine, policy, trainer.task_stage.reward)
    records = trainer.task_stage.sampler.draw(S + 1, B)
    recs = [r for r in records for _ in range(G)]

    def draw(theta, seed):
        replica.load_state_dict({**replica.state_dict(), **theta})
        engine.weights_changed()
        keys = [(streams.ROLLOUT, seed, S + 1, b, g) for b in range(B) for g in range(G)]
        rows, _, _ = service.sample(recs, keys, probe.settings)
        return rows

    return draw


def off_policy(probe: Probe, rows) -> tuple[dict, object]:
    """The log-ratio's spread and the shares the corrections truncate and mask, and the truncating correction's
    per-rollout weight ``w``."""
    import torch

    from grpolab.algo.engine_correction import engine_weights
    from grpolab.models.logprobs import completion_logprobs

    mask = rows.batch.completion_mask.bool()
    with torch.no_grad():
        current = completion_logprobs(probe.policy.model.eval(), rows.batch, probe.settings.temperature)
    log_ratio = (current - rows.logprobs.to(current.dtype)) * mask
    seq = log_ratio.sum(1)
    w = engine_weights(current, rows.logprobs.to(current.dtype), mask, "sequence-truncate", CAP)[:, 0]
    masked = engine_weights(current, rows.logprobs.to(current.dtype), mask, "sequence-mask", CAP)[:, 0]
    tokens = mask.sum(1).double()
    figures = {
        "token_logratio_std": float(log_ratio[mask].std()),
        "seq_logratio_std": float(seq.std()),
        "truncated_token_share": float(tokens[seq > torch.log(torch.tensor(CAP))].sum() / tokens.sum()),
        "masked_token_share": float(tokens[masked == 0].sum() / tokens.sum()),
    }
    return figures, w


def group_ranks(probe: Probe, rows, token_w, A, w) -> list[float]:
    """The effective rank of each group with a contrast: its Gram of its rollouts' scores (as the in-training probe
    takes it), the rows weighted w_i A_i."""
    import torch

    from grpolab.common.batch import select
    from grpolab.probes.gram import score_gram
    from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics

    ranks = []
    for b in range(probe.B):
        idx = torch.arange(b * probe.G, (b + 1) * probe.G)
        if A[idx].abs().sum() > 0:
            part = select(rows.batch, idx)
            psi = score_gram(probe.policy.model, part, token_w[idx][:, : part.completion_ids.shape[1]],
                             temperature=probe.settings.temperature)  # fmt: skip
            s = singular_values_from_gram(psi, (w * A)[idx])
            ranks.append(spectrum_metrics(s)["effective_rank"])
    return ranks


def lag_row(probe: Probe, rows, g0) -> dict:
    """One batch's figures against the on-policy gradient ``g0`` (the rows of the printed table)."""
    ratio, w = off_policy(probe, rows)
    A = probe.advantages(rows)
    coef = (w * A) / (probe.B * probe.G)
    token_w = probe.weights_of(rows.batch)
    gap = compare(probe.gradient(rows.batch, coef, token_w), g0)
    ranks = group_ranks(probe, rows, token_w, A, w)
    return {
        **ratio,
        "effective_rank": sum(ranks) / max(len(ranks), 1),
        "groups_with_contrast": len(ranks),
        "reward_mean": float(rows.scores.total.mean()),
        **gap,
    }


def measure(args) -> list[dict]:
    """Trains S steps, then the on-policy gradient at theta_S and a row per K of ``--lags`` and for the noise."""
    from grpolab.training.recipe import build_trainer

    cfg = run_config(args)
    trainer = build_trainer(cfg, log=print)
    thetas = train(trainer, args.steps)
    S, seed = args.steps, cfg.run.seed
    probe = Probe.of(trainer, cfg)
    draw = behaviour_sampler(trainer, probe, S)
    on_policy = draw(thetas[S], seed)
    A0 = probe.advantages(on_policy)
    probe.policy.model.eval()  # no dropout: the gradient of the policy's own weights, as the loss takes it
    g0 = probe.gradient(on_policy.batch, A0 / (probe.B * probe.G), probe.weights_of(on_policy.batch))
    out = []
    for K in [*args.lags, "noise"]:
        rows = draw(thetas[S], seed + 1) if K == "noise" else draw(thetas[S - K], seed)
        row = {"K": K, **lag_row(probe, rows, g0)}
        out.append(row)
        print(json.dumps(row), flush=True)
    trainer.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/last_letter/train.parquet")
    p.add_argument("--eval-data", default="data/last_letter/test.parquet")
    p.add_argument("--steps", type=int, default=8, help="training steps before the measurement (S)")
    p.add_argument("--lags", default="0,1,2,4", help="K values, comma-separated (at most --steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.lags = [int(k) for k in args.lags.split(",")]
    if max(args.lags) > args.steps:
        sys.exit("--lags: every K must be at most --steps")
    rows = measure(args)
    print(f"{'K':>5} {'tok logratio sd':>16} {'seq logratio sd':>16} {'truncated':>10} {'masked':>8} "
          f"{'eff rank':>9} {'rel err':>8} {'cosine':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['K']!s:>5} {r['token_logratio_std']:16.4f} {r['seq_logratio_std']:16.4f} "
            f"{r['truncated_token_share']:10.3f} {r['masked_token_share']:8.3f} {r['effective_rank']:9.2f} "
            f"{r['rel_error']:8.3f} {r['cosine']:7.3f}"
        )
    print("(noise: a second on-policy batch, other rollout keys, against the first: one step's sampling noise)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
