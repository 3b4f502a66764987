"""The gradient probes on any run's task: they draw rollouts through the run's engine and score them with the run's
own reward functions and columns (the path training takes), and their score vectors combine into the update's own
gradient. Evaluation draws through an engine the trainer is given."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from datasets import Dataset
from helpers.runs import for_run, task_of

import grpolab
from grpolab.algo.advantages import compute_advantages
from grpolab.algo.loss import policy_loss
from grpolab.analysis.pool import probe_sampler
from grpolab.analysis.rank import RankConfig
from grpolab.common import streams
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.eval.runs import probe_task, resolve_target
from grpolab.models.logprobs import completion_entropy, completion_logprobs
from grpolab.probes.gram import score_gram, token_weights
from grpolab.rollout.engine import EngineSpec, HFEngine
from grpolab.rollout.sampler import sample_with_stats
from grpolab.training.recipe import build_trainer, train

# a TRL-form reward of two columns, a grpolab-form one of a third, and one that varies whatever the tiny model writes
REWARDS = ("reward_fixtures:digits_of_target", "reward_fixtures:length_times_weight", "reward_fixtures:odd_code_sum")


def _quiet(*args, **kwargs):
    pass


def _rows(n: int) -> list[dict]:
    words = ["abc", "hello", "grpo", "token", "xyz", "model", "river", "stone"]
    return [
        {"prompt": f"{i}: reverse {w}", "target": w[::-1], "bonus": (i % 3) / 4, "weight": 1 + i % 2}
        for i, w in ((i, words[i % len(words)]) for i in range(n))
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("reverse")
    Dataset.from_list(_rows(40)).to_parquet(str(d / "train.parquet"))
    Dataset.from_list(_rows(48)[40:]).to_parquet(str(d / "test.parquet"))
    return d


def _cfg(data, **over) -> TrainConfig:
    return TrainConfig(
        data=str(data / "train.parquet"), eval_data=str(data / "test.parquet"), reward_fn=REWARDS,
        reward_weights=(1.0, 0.5, 1.0), format_weight=0.0, prompts_per_step=3, group_size=4, max_new_tokens=10,
        eval_questions=8, eval_samples=1, progress=False, **over,
    )  # fmt: skip


@pytest.fixture(scope="module")
def data_run(data, tmp_path_factory):
    """A 2-step run on the data file with the two column-reading rewards, checkpointed at both steps."""
    out = tmp_path_factory.mktemp("data_run") / "run"
    train(_cfg(data, out=str(out), steps=2, save_every=1), log=_quiet)
    return out


def test_the_probes_rollouts_and_rewards_are_trainings_for_the_same_keys(data, tmp_path):
    cfg = _cfg(data, out=str(tmp_path)).resolved()
    trainer = build_trainer(cfg, log=_quiet)
    roll = trainer.sampling_stage.collector.collect(1)
    rows, G = roll.groups.rows, cfg.groups.group_size
    draw = probe_sampler(trainer.policy, task_of(cfg), "hf", records=roll.groups.records)
    assert (
        draw.reward.names
        == trainer.task_stage.reward.names
        == ["digits_of_target", "length_times_weight", "odd_code_sum", "format"]
    )
    assert type(draw.service.engine) is type(trainer.sampling_stage.engine) is HFEngine
    for k, (b, record) in enumerate(zip(roll.groups.prompt, roll.groups.records)):
        batch, rewards, entropy = draw(record, G, (streams.ROLLOUT, cfg.run.seed, 1, b))  # training's keys
        mine = slice(k * G, (k + 1) * G)
        T = batch.completion_ids.shape[1]
        assert torch.equal(batch.completion_ids, rows.batch.completion_ids[mine, :T])
        assert torch.equal(batch.completion_mask, rows.batch.completion_mask[mine, :T])
        assert torch.equal(rewards, rows.scores.total[mine])  # the same reward values, to the bit
        torch.testing.assert_close(entropy, rows.entropy[mine, :T], rtol=1e-5, atol=1e-6)  # another batch's matmuls
        scores = draw.reward([*rows.texts[mine]], [record] * G, batch.completion_mask.sum(1))
        for name in draw.reward.names:  # each component read the row's columns as training's did
            assert torch.equal(scores.components[name], rows.scores.components[name][mine])
    assert float(rows.scores.total.std()) > 0  # the rewards vary: the check compares real values


@pytest.mark.slow
def test_the_probes_gradient_on_a_data_run_is_the_updates_own(data, tmp_path):
    """psi_i (the probe's score vectors, with the loss's aggregation weights) combine with the advantages into the
    update's gradient: -(1/R) sum_i A_i psi_i = grad of the GRPO loss at ratio 1, in float64 to 1e-6 relative (the
    built-in model's Llama RMSNorm computes in float32, so a batched and a per-row backward differ at ~1e-7); the
    probe's Psi equals the Gram matrix of those R per-rollout gradients (to float32 precision: its products are
    float32)."""
    cfg = _cfg(data, dtype="float64", out=str(tmp_path)).resolved()
    trainer = build_trainer(cfg, log=_quiet)
    policy, model = trainer.policy, trainer.policy.model
    draw = probe_sampler(policy, task_of(cfg), "hf")
    record = trainer.task_stage.held_out[0]
    batch, rewards, _ = draw(record, 6, (streams.PROBE, 0, 0, 0))
    assert float(rewards.std()) > 0
    adv = compute_advantages(rewards[None].double(), "grpo")[0].double()  # [R]
    for aggregation in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"):
        w = token_weights(batch.completion_mask, aggregation, cfg.generation.max_new_tokens)  # [R, T]
        psi = score_gram(model, batch, w, temperature=cfg.generation.temperature)  # [R, R]
        params = [p for p in model.parameters() if p.requires_grad]
        rows = []
        for i in range(batch.completion_ids.shape[0]):  # R backward passes: the per-rollout scores
            logp = completion_logprobs(model, batch, cfg.generation.temperature)
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad((logp[i] * w[i]).sum(), params)]))
        scores = torch.stack(rows)  # [R, D]
        # the Gram pass multiplies in float32 (accumulating in float64): exact to float32's precision
        torch.testing.assert_close(psi, scores @ scores.T, rtol=1e-5, atol=1e-6 * float(psi.abs().max()))
        logp = completion_logprobs(model, batch, cfg.generation.temperature)
        loss, _ = policy_loss(logp, logp.detach(), adv, batch.completion_mask, aggregation=aggregation,
                              max_len=cfg.generation.max_new_tokens)  # fmt: skip
        grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        R = batch.completion_ids.shape[0]
        scale = 1.0 / R if aggregation != "token-mean" else 1.0 / float(batch.completion_mask.sum())
        combined = -scale * (adv @ scores)  # [D]
        assert float((grad - combined).norm() / grad.norm()) < 1e-6
        assert float(adv @ psi @ adv) * scale**2 == pytest.approx(float(grad @ grad), rel=1e-5)


@pytest.mark.slow
def test_rank_mse_and_groupsize_on_a_data_run_use_its_prompts_and_reward(data_run, tmp_path):
    rank = grpolab.rank(model=str(data_run), group_sizes=[4], prompts=3, verify=True, progress=False,
                        out=str(tmp_path / "rank"), log=_quiet)  # fmt: skip
    assert [r["step"] for r in rank["results"]] == [0, 1, 2]
    assert all(r["gram_max_rel_err"] <= 1e-4 for r in rank["results"])
    assert tuple(rank["config"]["reward_fn"]) == REWARDS and tuple(rank["config"]["reward_weights"]) == (1.0, 0.5, 1.0)
    assert all(r["reward_std_mean"] > 0 for r in rank["results"])  # the run's continuous reward, not 0/1 accuracy
    mse = grpolab.mse(model=str(data_run), prompts=3, pool=4, group_sizes=[2, 4], progress=False,
                      out=str(tmp_path / "mse"), log=_quiet)  # fmt: skip
    assert mse["policies"][0]["reward_mean"] > 0.3  # digits of the target plus a bonus: no accuracy check gives that
    gs = grpolab.groupsize(model=str(data_run), prompts=3, pool=4, budget=8, bootstrap=20, progress=False,
                           out=str(tmp_path / "gs"), log=_quiet)  # fmt: skip
    assert gs["constants"]["sigma_oracle"]["value"] >= 0 and json.loads((tmp_path / "gs/groupsize.json").read_text())


def test_probe_split_and_a_bare_model_with_data(data, data_run):
    target = resolve_target(str(data_run))
    _, held, _ = probe_task(target, for_run(RankConfig, str(data_run), "checkpoint", prompts=4))
    _, trained, _ = probe_task(target, for_run(RankConfig, str(data_run), "checkpoint", prompts=4, probe_split="train"))
    assert [r["prompt"] for r in held] == [r["prompt"] for r in _rows(48)[40:44]]  # --eval-data's first prompts
    assert {r["prompt"] for r in trained} <= {r["prompt"] for r in _rows(40)} and len(trained) == 4
    with pytest.raises(ConfigError, match="--prompts 9: the held-out prompts of .*test.parquet number 8"):
        probe_task(target, for_run(RankConfig, str(data_run), "checkpoint", prompts=9))
    # a bare model: its prompts from --data, its reward from --reward-fn
    bare = RankConfig(prompts=3, data=str(data / "test.parquet"), reward_fn=REWARDS[:1])
    task, records, _ = probe_task(resolve_target("builtin"), bare)
    assert [r["prompt"] for r in records] == [r["prompt"] for r in _rows(48)[40:43]]
    assert task.reward.reward_fn == REWARDS[:1] and task.dataset.format == "prompt"
    with pytest.raises(ConfigError, match="--prompts 9: the records of .*test.parquet number 8"):
        probe_task(resolve_target("builtin"), dataclasses.replace(bare, prompts=9))
    with pytest.raises(ConfigError, match="built-in task draws fresh training questions"):
        probe_task(resolve_target("builtin"), RankConfig(prompts=3, probe_split="train"))


def test_entropies_from_one_forward_equal_the_samplers(tiny_model, char_tokenizer):
    """For an engine that gives none (vLLM), the rank probe's entropy selection computes them with one forward."""
    from grpolab.models.policy import Policy

    policy = Policy(tiny_model, char_tokenizer, "tiny")
    out = sample_with_stats(
        tiny_model, [policy.prompt_ids({"question": q}) for q in ("1+2", "13*4", "7-9")], [(5, i) for i in range(3)],
        max_new_tokens=8, temperature=0.8, top_p=1.0, eos_id=policy.eos_id, pad_id=policy.pad_id,
    )  # fmt: skip
    ent = completion_entropy(tiny_model, out.batch, 0.8)
    torch.testing.assert_close(ent, out.entropy, rtol=1e-5, atol=1e-6)


class _Counting:
    """A real engine (grpolab's sampler) that also records the keys it was asked for."""

    def __init__(self, engine):
        self.engine, self.keys = engine, []

    def generate(self, prompts, keys, settings, media=None):
        self.keys += keys
        return self.engine.generate(prompts, keys, settings)

    def weights_changed(self):
        self.engine.weights_changed()


@pytest.mark.slow
def test_evaluation_draws_through_the_engine_the_trainer_was_given(tmp_path):
    cfg = TrainConfig(out=str(tmp_path), prompts_per_step=2, group_size=2, eval_questions=4, eval_samples=2,
                      progress=False).resolved()  # fmt: skip
    plain = build_trainer(cfg, log=_quiet)
    model = copy.deepcopy(plain.policy.model)
    engine = _Counting(HFEngine(model, EngineSpec(plain.policy.eos_id, plain.policy.pad_id)))
    given = build_trainer(cfg, log=_quiet, engine=engine)
    given.policy.model.load_state_dict(model.state_dict())
    metrics, _ = given.evaluate(0)
    eval_keys = [k for k in engine.keys if k[0] == streams.EVAL]
    assert len(eval_keys) == 4 * (1 + 2)  # every greedy and sampled answer came from the given engine
    expected, _ = plain.evaluate(0)  # the same weights through the trainer's own engine: the same accuracy
    assert {k: v for k, v in metrics.items() if not k.startswith("time/")} == {
        k: v for k, v in expected.items() if not k.startswith("time/")
    }


def test_a_probe_of_a_code_run_scores_programs_in_the_sandbox(tmp_path):
    """The code reward through the probe's path: the sandbox is configured (and said) before scoring, as in
    training, and a written program really runs against the record's tests."""
    from grpolab.eval.runs import RunTask, Target
    from grpolab.models.policy import load_policy

    fixture = "tests/fixtures/code_problems.jsonl"
    task = RunTask.of(Target("builtin"), data=fixture, reward_fn=("grpolab.rewards:code_reward",))
    said = []
    draw = probe_sampler(load_policy("builtin"), task, "hf", log=said.append)
    assert len(said) == 1 and "bubblewrap" in said[0]  # the sandbox, said as training says it
    record = json.loads(open(fixture).readline())
    scores = draw.reward([record["solution"], record["wrong"]], [record] * 2, torch.tensor([20, 20]))
    right, wrong = scores.components["code_reward"].tolist()
    assert right == 1.0 and wrong < 1.0
    assert scores.counts["code_passed"] == 1 and scores.counts["code_failed"] == 1  # both programs really ran
