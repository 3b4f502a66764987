"""--max-staleness K: the rollouts of step t drawn with exactly the weights of step t - K (a checksum of the weights
the engine drew with against those the trainer had; in the trainer's process and in a generator process), the same run every time, the staleness logged and corrected,
held-out evaluations on the current weights, and the settings not supported yet refused in one line. Two processes
at K = 1 against one: tests/e2e/test_distributed.py (its two-process run shares that file's torchrun launch)."""

from __future__ import annotations

import json

import pytest
from helpers.runs import quiet, small_cfg

from grpolab.config.train import ConfigError
from grpolab.rollout.replica import weights_digest as digest  # the checksum the generator process reports

# in the trainer's process, and in a generator process (a process started: the slow tier); the process at K = 2 with
# a LoRA policy (rank 4), sent its adapter and merging it (--lora-sync auto)
GENERATORS = [
    pytest.param("inline", 1, 0, id="1-inline"),
    pytest.param("inline", 2, 0, id="2-inline"),
    pytest.param("process", 1, 0, id="1-process", marks=pytest.mark.slow),
    pytest.param("process", 2, 4, id="2-process-lora", marks=pytest.mark.slow),
]
RESUMED = [pytest.param(g, marks=pytest.mark.slow) for g in ("inline", "process")]  # three runs each: 2.5 s inline


def policy_digest(trainer) -> str:
    """The checksum of the weights the trainer's policy serves an engine now."""
    from grpolab.rollout.weights import served_weights

    return digest(dict(served_weights(trainer.policy.model)))


def engine_digest(trainer) -> str:
    """The checksum of the weights the (inline) engine's copy holds (and draws with)."""
    return digest(trainer.sampling_stage.service.engine.weights.held)


@pytest.mark.parametrize(("generator", "K", "lora_rank"), GENERATORS)
def test_step_t_draws_with_exactly_the_weights_of_step_t_minus_k(tmp_path, K, generator, lora_rank):
    from grpolab.training.recipe import build_trainer

    cfg = small_cfg(tmp_path, max_staleness=K, warmup_steps=0, generator=generator, lora_rank=lora_rank)
    trainer = build_trainer(cfg, log=quiet)
    engine = trainer.sampling_stage.service.engine
    if generator == "process":
        engine.digests = []  # the generator process reports the checksum of the weights each draw used
    after = [policy_digest(trainer)]  # after[s]: the policy's weights after step s (0: the start)
    drawn = []
    try:
        for t in range(1, 7):
            if generator == "inline":
                drawn.append(engine_digest(trainer))
            metrics = trainer.step(t).metrics
            after.append(policy_digest(trainer))
            assert metrics["async/staleness_max"] == min(K, t - 1)
            if generator == "process":
                assert_synced_as_delta(metrics, trainer, lora_rank)
        drawn = drawn or engine.digests
        # synchronously step t draws with the weights after step t - 1; K steps behind, after step t - 1 - K
        assert drawn == [after[max(0, t - 1 - K)] for t in range(1, 7)]
        assert len(set(after)) == 7  # every step moved the weights
        # a held-out evaluation draws with the current weights, and the stale ones are back after it
        evaluated = {k: v for k, v in trainer.evaluate(6)[0].items() if not k.startswith("time/")}
        assert evaluated == fresh_evaluation(trainer)  # as an engine that holds the current weights draws
        if generator == "inline":
            assert engine_digest(trainer) == after[6 - K]
        else:
            assert set(engine.digests[6:]) == {after[6]}  # the evaluation's draws
            assert engine.prefetches["used"] == 5
        assert trainer.cfg.objective.engine_correction == "sequence-truncate"  # auto corrects the staleness
    finally:
        trainer.close()


def assert_synced_as_delta(metrics: dict, trainer, lora_rank: int) -> None:
    """The step's weight sync to the generator process wrote only what changed: with LoRA the adapter's factors (the
    base went once, at the start); with full fine-tuning in fp32 nearly every weight, whole."""
    from grpolab.rollout.weights import served_weights

    served = dict(served_weights(trainer.policy.model))
    size = sum(t.numel() for t in {id(t): t for t in served.values()}.values())  # a tied weight once
    frac, sent = metrics["generators/sync_delta_frac"], metrics["generators/sync_bytes"]
    assert metrics["generators/sync_s"] > 0
    if lora_rank:  # the factors: 2 r (in + out) per adapted layer, a small share of the weights
        assert 0 < frac < 0.2 and 0 < sent < 0.2 * 4 * size
    else:
        assert frac > 0.5 and 0.5 * 4 * size < sent <= 4 * size


def fresh_evaluation(trainer) -> dict:
    """The held-out metrics of the trainer's current policy drawn by a new engine with no lag (times aside)."""
    from grpolab.eval.accuracy import evaluate
    from grpolab.rollout.engine import EngineSpec, HFEngine
    from grpolab.rollout.service import RolloutService

    policy, cfg = trainer.policy, trainer.cfg
    engine = HFEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id, max_staleness=0))
    service = RolloutService(engine, policy)
    metrics, _ = evaluate(service, trainer.task_stage.held_out, samples=cfg.eval.eval_samples,
                          temperature=cfg.generation.temperature, max_new_tokens=cfg.generation.max_new_tokens,
                          seed=cfg.run.seed, score=trainer.task_stage.eval_reward)  # fmt: skip
    return metrics


@pytest.mark.slow  # K = 1, generator auto: draws in a generator process
def test_two_seeded_stale_runs_are_identical_and_measure_their_staleness(tmp_path):
    from grpolab.training.recipe import train

    runs = [
        train(small_cfg(tmp_path / f"r{i}", steps=4, max_staleness=1, log_rollouts=True, warmup_steps=0), log=quiet)
        for i in (0, 1)
    ]
    rows = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    # times aside, and the generator's own books (generators/sync_s is a time)
    strip = [
        [{k: v for k, v in row.items() if not k.startswith(("time/", "generators/"))} for row in rs] for rs in rows
    ]
    assert strip[0] == strip[1]
    assert (runs[0] / "rollouts.jsonl").read_text() == (runs[1] / "rollouts.jsonl").read_text()
    steps = rows[0][1:]
    assert [r["async/staleness_max"] for r in steps] == [0, 1, 1, 1]
    logged = [json.loads(line) for line in (runs[0] / "rollouts.jsonl").read_text().splitlines()]
    assert {(r["step"], r["weights"]) for r in logged} == {(1, 0), (2, 0), (3, 1), (4, 2)}  # each rollout's weights
    # step 1 draws with the weights the trainer scores (no mismatch); later steps with one step older ones
    assert steps[0]["engine/logratio_std"] < 1e-5 and all(r["engine/logratio_std"] > 1e-4 for r in steps[1:])
    # sequence-truncate (auto under staleness) weighs each stale rollout by its capped trainer/sampler ratio
    assert abs(steps[0]["engine/correction_weight_mean"] - 1) < 1e-5
    assert all(abs(r["engine/correction_weight_mean"] - 1) > 1e-5 for r in steps[1:])


def test_what_staleness_does_not_support_yet_is_refused_in_one_line():
    from grpolab.config.train import TrainConfig

    with pytest.raises(ConfigError, match="--max-staleness: must be >= 0"):
        TrainConfig(max_staleness=-1).validate()


@pytest.mark.parametrize("generator", RESUMED)
def test_a_resumed_stale_run_continues_as_the_uninterrupted_one(tmp_path, generator):
    from helpers.runs import assert_same_params, metrics_by_step, rollouts_of

    from grpolab.training.recipe import train

    options = dict(max_staleness=2, log_rollouts=True, warmup_steps=0, save_every=2, generator=generator)
    whole = train(small_cfg(tmp_path / "whole", steps=5, **options), log=quiet)
    cut = train(small_cfg(tmp_path / "cut", steps=3, **options), log=quiet)  # saved at 2 and 3 (the last)
    import shutil

    shutil.rmtree(cut / "checkpoints" / "step_3")  # resume from step 2: two steps' weights in flight
    resumed = train(small_cfg(cut, steps=5, resume=True, **options), log=quiet)

    def books(run) -> dict:  # the generator's own (generators/sync_*: a resumed run's first sync goes whole)
        return {s: {k: v for k, v in r.items() if not k.startswith("generators/")} for s, r in metrics_by_step(run).items()}  # fmt: skip

    assert books(resumed) == books(whole)
    assert rollouts_of(resumed) == rollouts_of(whole)
    assert_same_params(whole, resumed, step=5)


@pytest.mark.slow  # K = 1, generator auto: draws in a generator process
def test_the_ratio_the_correction_weighs_is_pi_theta_over_the_stale_behaviour_policy_in_float64(tmp_path):
    import copy

    import torch

    from grpolab.models.logprobs import completion_logprobs
    from grpolab.training.recipe import build_trainer
    from grpolab.training.step import StepObserver

    class Rows(StepObserver):  # the rollouts the update sees, with the sampler's log-probs
        def before_update(self, result):
            self.rows = result.collected.groups.rows

    cfg = small_cfg(tmp_path, max_staleness=1, warmup_steps=0, dtype="float64", lr=1e-3)
    trainer = build_trainer(cfg, log=quiet)
    seen = Rows()
    trainer.observers.append(seen)
    trainer.step(1)
    behaviour = copy.deepcopy(trainer.policy.model)  # the weights after step 1: step 3 draws with them
    trainer.step(2)
    current = copy.deepcopy(trainer.policy.model)  # after step 2: what step 3's update scores first
    trainer.step(3)
    rows, T = seen.rows, cfg.generation.temperature
    mask = rows.batch.completion_mask.bool()
    with torch.no_grad():
        stale = completion_logprobs(behaviour.eval(), rows.batch, T)
        new = completion_logprobs(current.eval(), rows.batch, T)
    sampled = rows.logprobs.double()  # the sampler's log-probs (kept in float32) of the tokens it drew
    assert torch.allclose(sampled[mask], stale[mask], atol=1e-6)  # drawn by the policy of step t - 1 - K
    assert not torch.allclose(sampled[mask], new[mask], atol=1e-6)  # not by the one the update starts from
    log_ratio = (new - sampled)[mask]  # log pi_theta / pi_behaviour, the correction's ratio
    assert log_ratio.abs().max() > 1e-4  # stale by a step of lr 1e-3: a ratio that is not 1


def test_the_held_version_is_k_syncs_back_and_never_before_the_start():
    from grpolab.rollout.weights import held_version

    assert [held_version(syncs, 2) for syncs in range(6)] == [0, 0, 0, 1, 2, 3]  # K = 2: steps 1..3 draw the start
    assert [held_version(syncs, 0) for syncs in range(3)] == [0, 1, 2]  # K = 0: the newest


def test_the_placement_says_where_the_engine_draws():
    from grpolab.config.rollout import EngineSection
    from grpolab.rollout.spec import Placement

    assert [EngineSection(**o).placement for o in ({}, {"max_staleness": 1}, {"generator": "process"})] == [
        "inline", "process", "process"]  # fmt: skip
    assert EngineSection(max_staleness=1, generator="inline").placement == "inline"
    workers = Placement.of(EngineSection(generators=2, generator_listen="127.0.0.1:0"), run="r", rank=1)
    assert (workers.where, workers.workers, workers.listen, workers.run, workers.rank) == (
        "workers", 2, "127.0.0.1:0", "r", 1)  # fmt: skip
