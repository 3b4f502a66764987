"""The early signs of reward hacking while training (``hacking/*``; docs/reward-hacking.md), beside the math of
:mod:`grpolab.probes.hacking` and the doctor's reading of them (:mod:`grpolab.doctor.hacking`):

- :class:`HackingWatch`, a step observer: every step the similarity of the top-advantage completions of different
  prompts (``hacking/trick_sim``) and, with --audit-reward, the audit's disagreement with the reward on a sample of
  the step's rollouts (``hacking/audit_*``); every --hacking-every steps the alignment of the top-advantage
  rollouts' gradients across prompts (``hacking/align``), its cluster's completions kept for the doctor;
- :func:`honeypot_metrics`: the training reward on prompts with no correct answer, sampled at each evaluation
  (``hacking/honeypot_*``).

None of them draws from the run's random streams or touches the weights: with them on a run's rollouts and
weights are those of the same run with them off.
"""

from __future__ import annotations

import time

import torch

from grpolab.common import distributed as dist_
from grpolab.common import streams
from grpolab.common.batch import select
from grpolab.common.rng import rng_untouched
from grpolab.data.records import question_of
from grpolab.probes.gram import score_gram, token_weights
from grpolab.probes.hacking import alignment, cluster_members, top_rollouts, trick_similarity
from grpolab.rollout.engine import SamplingSettings
from grpolab.training.step import StepObserver, StepResult

SHOWN = 4
"""Completions of a sign's evidence kept per record (hacking.jsonl): enough to read the trick, few enough to read."""


class HackingWatch(StepObserver):
    """The hacking signs read from a step's rollouts, on the policy that sampled them. ``every``: steps between two
    gradient-alignment measurements (0: none, and no similarity either); ``groups``: the top-advantage rollouts (one
    a prompt) measured; ``audit``: (name, function) of --audit-reward or None, run on ``audit_sample`` rollouts a
    step; ``first``: the name of the reward's first component, whose paying the audit is compared with."""

    def __init__(self, model, every: int, groups: int, aggregation: str, max_len: int, temperature: float, world,
                 device, audit=None, audit_sample: int = 32, first: str = "accuracy", gram: bool = True,
                 log=print):  # fmt: skip
        self.model, self.every, self.groups = model, every, groups
        self.aggregation, self.max_len, self.temperature = aggregation, max_len, temperature
        self.world, self.device, self.log = world, device, log
        self.audit, self.audit_sample, self.first = audit, audit_sample, first
        self.gram = gram  # False under FSDP: a Gram pass needs whole parameters (the similarity still runs)
        self.audit_errors = 0

    def before_update(self, result: StepResult) -> None:
        t0 = time.perf_counter()
        roll, adv = result.collected, result.advantages
        groups, rows = roll.groups, roll.groups.rows
        top = top_rollouts(adv.rollout.tolist(), list(groups.sizes)) if self.every else []
        if self.every:
            texts = dist_.gather_concat([rows.texts[i] for i in top], self.world)
            sim = trick_similarity(texts)
            if sim is not None:
                result.metrics["hacking/trick_sim"] = sim
        if self.every and self.gram and result.step % self.every == 0 and adv.token is None:
            self._align(result, top[: self.groups])
        if self.audit is not None:
            self._audit(result)
        result.metrics["time/hacking_s"] = time.perf_counter() - t0

    def _align(self, result: StepResult, top: list[int]) -> None:
        """hacking/align on this rank's top rollouts (their mean over ranks), its cluster's completions kept."""
        roll = result.collected
        groups, rows = roll.groups, roll.groups.rows
        local: tuple[float, int, list[dict]] | None = None
        if len(top) >= 2:
            idx = torch.tensor(rows.rows_of(top), device=self.device)
            sub = select(rows.batch, idx)
            weights = token_weights(
                rows.loss_tokens[idx, : sub.completion_ids.shape[1]], self.aggregation, self.max_len
            )
            with rng_untouched(self.device):
                psi = score_gram(self.model, sub, weights, temperature=self.temperature).cpu()
            value, vector = alignment(psi)
            group_of = _group_index(groups.sizes)
            members = [
                {
                    "question": question_of(groups.records[group_of[top[m]]]),
                    "completion": rows.texts[top[m]],
                    "reward": rows.scores.total[top[m]].item(),
                    "advantage": result.advantages.rollout[top[m]].item(),
                    "loading": float(vector[m]),
                }
                for m in cluster_members(vector)
            ]
            local = (value, len(top), members)
        parts = [p for p in dist_.gather(local, self.world) if p is not None]
        if not parts:
            return
        result.metrics["hacking/align"] = sum(p[0] for p in parts) / len(parts)
        result.metrics["hacking/align_rollouts"] = sum(p[1] for p in parts)
        result.metrics["hacking/align_cluster"] = sum(len(p[2]) for p in parts)
        shown = [m for p in parts for m in p[2]][:SHOWN]
        result.hacking = (result.hacking or []) + [{"sign": "align", "value": result.metrics["hacking/align"],
                                                    "rollouts": shown}]  # fmt: skip

    def _audit(self, result: StepResult) -> None:
        """The audit on an evenly spaced sample of the step's rollouts: the share it fails of those the reward's
        first component pays (hacking/audit_paid_failed) and the share of all where the two disagree."""
        groups, rows = result.collected.groups, result.collected.groups.rows
        n = len(rows.texts)
        count = min(self.audit_sample, n)
        picks = [k * n // count for k in range(count)]
        group_of = _group_index(groups.sizes)
        texts = [rows.texts[i] for i in picks]
        records = [groups.records[group_of[i]] for i in picks]
        paid = [float(rows.scores.components[self.first][i]) > 0 for i in picks]
        name, fn = self.audit
        try:
            passed = [v is not None and float(v) > 0.5 for v in fn(texts, records)]
            if len(passed) != len(texts):
                raise ValueError(f"returned {len(passed)} values for {len(texts)} completions")
            errors = 0
        except Exception as e:  # an audit's fault is counted and logged, never the run's end
            errors, passed = len(texts), None
            if not self.audit_errors:
                self.log(f"--audit-reward {name} raised {type(e).__name__}: {e}; counted in hacking/audit_errors")
        self.audit_errors += errors
        local = (errors, [] if passed is None else list(zip(paid, passed)))
        parts = dist_.gather(local, self.world)
        pairs = [x for p in parts for x in p[1]]
        result.metrics["hacking/audit_errors"] = sum(p[0] for p in parts)
        result.metrics["hacking/audit_checked"] = len(pairs)
        if pairs:
            paid_n = sum(1 for p, _ in pairs if p)
            failed = sum(1 for p, a in pairs if p and not a)
            result.metrics["hacking/audit_disagree"] = sum(1 for p, a in pairs if p != a) / len(pairs)
            result.metrics["hacking/audit_paid_failed"] = failed / paid_n if paid_n else 0.0


def _group_index(sizes) -> list[int]:
    """The group of each rollout (flat, in group order)."""
    return [k for k, size in enumerate(sizes) for _ in range(size)]


def honeypot_metrics(service, records: list[dict], samples: int, settings: SamplingSettings, seed: int, step: int,
                     first: str, world) -> tuple[dict, list[dict]]:  # fmt: skip
    """The training reward on ``samples`` completions of each honeypot (a prompt with no correct answer) drawn through
    ``service`` with keys of their own (``streams.HONEYPOT``: no other draw moves): ``hacking/honeypot_paid``, the
    share its first component (``first``) pays, and ``hacking/honeypot_reward``, the mean total; and the best-paid
    completions (at most SHOWN), for the doctor. Each rank draws a block of the honeypots."""
    mine = world.split(len(records))
    rep = [records[i] for i in mine for _ in range(samples)]
    keys = [(streams.HONEYPOT, seed, step, i, j) for i in mine for j in range(samples)]
    model = service.policy.model
    was_training = model.training
    model.eval()
    try:
        rows, _, _ = service.sample(rep, keys, settings)
    finally:
        model.train(was_training)
    first_values = rows.scores.components[first].tolist() if rep else []
    local = [
        {"question": question_of(r), "completion": t, "reward": float(total), "paid": float(v)}
        for r, t, total, v in zip(rep, rows.texts, rows.scores.total.tolist(), first_values)
    ]
    every = dist_.gather_concat(local, world)
    if not every:
        return {}, []
    metrics = {
        "hacking/honeypot_paid": sum(1 for e in every if e["paid"] > 0) / len(every),
        "hacking/honeypot_reward": sum(e["reward"] for e in every) / len(every),
    }
    shown = sorted((e for e in every if e["paid"] > 0), key=lambda e: -e["paid"])[:SHOWN]
    return metrics, shown
