"""trl.rewards' functions, and TRL's reward keywords (completion_ids, log_extra, log_metric, None for "does not
apply"), scored by grpolab as TRL's own trainer scores them: the same completions through TRL's
``GRPOTrainer._calculate_rewards`` and through grpolab's, the same values, the same extra columns, the same metrics."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paths import REPO

from grpolab.rewards.forms import from_trl
from grpolab.rewards.rewarder import score

BUILTIN = str(REPO / "grpolab" / "assets" / "arith-sft")

SOLUTIONS = ["$4$", r"$\frac{1}{2}$", "no answer in here", "$7$", "$9$"]  # the third: a gold TRL cannot parse
COMPLETIONS = [
    "<think>2 and 2</think>The answer is $\\boxed{4}$",
    "I think it is $\\frac{1}{3}$",
    "whatever: $3$",
    "<think>hmm</think><think>again</think> $\\boxed{7}$",
    "<think>nine</think>so $9$",
]
COMPLETION_IDS = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [5] * 20, [7, 8], list(range(30)), [4, 4, 4, 4]]


def logs_things(completions, solution, log_extra=None, log_metric=None, **kwargs):
    """A reward function of TRL's documented form that logs a column and a metric."""
    lengths = [len(c[0]["content"]) for c in completions]
    log_extra("length", lengths)
    log_metric("my/mean_length", sum(lengths) / len(lengths))
    log_metric("my/count", float(len(lengths)))
    return [float(n % 3) if n % 2 else None for n in lengths]


def _functions():
    from trl.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return [
        accuracy_reward,
        reasoning_accuracy_reward,
        think_format_reward,
        get_soft_overlong_punishment(max_completion_len=24, soft_punish_cache=8),
        get_cosine_scaled_reward(max_len=24),
        get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0),
        logs_things,
    ]


WEIGHTS = [1.0, 0.5, 0.25, 1.0, 2.0, 1.0, 0.5]


@pytest.fixture(scope="module")
def trl_side(tmp_path_factory):
    """TRL's own trainer's rewards of the completions: per function (NaN for None), its extra columns, its metrics."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "solution": s} for i, s in enumerate(SOLUTIONS)]
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=5, num_generations=5, reward_weights=WEIGHTS)  # fmt: skip
    trainer = GRPOTrainer(BUILTIN, _functions(), args=args, train_dataset=Dataset.from_list(rows))
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    per_func = trainer._calculate_rewards(rows, [r["prompt"] for r in rows], completions, COMPLETION_IDS)
    return per_func, dict(trainer._pending_extra_logs), dict(trainer._pending_metrics), trainer.reward_func_names


@pytest.fixture(scope="module")
def grpolab_side():
    records = [{"prompt": [{"role": "user", "content": f"q{i}"}], "solution": s} for i, s in enumerate(SOLUTIONS)]
    fns = [from_trl(fn, prompt_of=lambda r: r["prompt"], chat=True) for fn in _functions()]
    return score(
        COMPLETIONS, records, [(f.__name__, f, w) for f, w in zip(fns, WEIGHTS)], completion_ids=COMPLETION_IDS
    )


def test_each_function_gives_what_it_gives_under_trl_s_trainer(trl_side, grpolab_side):
    per_func, _, _, names = trl_side
    assert [n for n in grpolab_side.components] == names  # the functions' names, as TRL names them in its logs
    ours = torch.stack([grpolab_side.components[n] for n in names], dim=1)  # [N, F]
    skipped = torch.stack([grpolab_side.skipped.get(n, torch.zeros(len(COMPLETIONS), dtype=torch.bool))
                           for n in names], dim=1)  # fmt: skip
    assert torch.equal(skipped, per_func.isnan())  # None where TRL has NaN, and only there
    assert torch.equal(ours[~skipped], per_func[~skipped])
    assert grpolab_side.errors == 0
    # accuracy_reward's None for the gold it cannot parse; cosine's None follows it
    assert skipped[2, names.index("accuracy_reward")] and skipped[2, names.index("cosine_scaled_reward")]
    # every function's values vary over these completions: a function wrongly fed (no completion_ids) would not
    assert all(len(set(per_func[:, j][~per_func[:, j].isnan()].tolist())) > 1 for j in range(len(names)))


def test_the_total_is_trl_s_nansum_and_each_mean_its_nanmean(trl_side, grpolab_side):
    per_func, _, _, names = trl_side
    nansum = (per_func * torch.tensor(WEIGHTS)).nansum(dim=1)
    assert torch.allclose(grpolab_side.total, nansum, atol=1e-6)
    from grpolab.rollout.collect import applied_values  # what the step metrics read
    from grpolab.rollout.metrics import mean_applied

    for j, name in enumerate(names):
        mean = mean_applied(applied_values(grpolab_side.components[name], grpolab_side.skipped.get(name)))
        assert mean == pytest.approx(torch.nanmean(per_func[:, j]).item(), abs=1e-6), name


def test_log_extra_columns_and_log_metric_values_are_trl_s(trl_side, grpolab_side):
    _, extra, metrics, _ = trl_side
    n = len(COMPLETIONS)
    ours = {column: [row.get(column) for row in grpolab_side.extra] for column in extra}
    # accuracy_reward and reasoning_accuracy_reward log the same three columns: TRL appends both lists to one column
    # (2N values, which its table shows against the wrong rows); grpolab keeps each rollout's value of the later one
    assert ours == {k: list(v)[-n:] for k, v in extra.items()}
    assert len(extra["gold_parsed"]) == 2 * n and len(extra["length"]) == n
    assert set(extra) == {"solution", "gold_parsed", "answer_parsed", "length"}  # accuracy_reward's and ours
    assert grpolab_side.logged == {k: list(v) for k, v in metrics.items()}


def test_a_function_that_fails_on_the_whole_batch_logs_nothing_half_done():
    """Scored rollout by rollout after its whole-batch call failed, a function's logged columns are not kept (they
    would describe a call whose result was thrown away)."""

    def half(completions, log_extra=None, **kwargs):
        log_extra("seen", list(range(len(completions))))
        if len(completions) > 1:
            raise RuntimeError("cannot do a batch")
        return [1.0]

    fn = from_trl(half, prompt_of=lambda r: r["q"], chat=False)
    got = score(["a", "b"], [{"q": "x"}, {"q": "y"}], [("half", fn, 1.0)])
    assert got.components["half"].tolist() == [1.0, 1.0] and got.errors == 0 and got.extra == []


@pytest.mark.slow
def test_under_both_trainers_the_extras_reach_the_completions_and_the_metrics_log_history(tmp_path):
    """Two training steps under TRL's GRPOTrainer and under grpolab.trl's with the same functions: the
    log_metric values in log_history by the name given, each function's mean its nanmean (None left out), and under
    grpolab the log_extra columns beside each rollout of rollouts.jsonl (TRL's completions table)."""
    from datasets import Dataset
    from trl import GRPOConfig as TrlConfig
    from trl import GRPOTrainer as TrlTrainer

    from grpolab.trl import GRPOConfig, GRPOTrainer

    def every_other(completions, log_extra=None, log_metric=None, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_metric("constant_metric", 3.0)
        return [None if i % 2 else 1.0 for i in range(len(completions))]  # with the Nones as 0 the mean is 0.5

    def always(completions, **kwargs):
        return [0.5] * len(completions)

    rows = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])
    options = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                   logging_steps=1, report_to="none", bf16=False, use_cpu=True, log_completions=True,
                   disable_tqdm=True, save_strategy="no")  # fmt: skip
    logs = {}
    for who, Config, Trainer in (("trl", TrlConfig, TrlTrainer), ("grpolab", GRPOConfig, GRPOTrainer)):
        trainer = Trainer(BUILTIN, [every_other, always], args=Config(output_dir=str(tmp_path / who), **options),
                          train_dataset=rows)  # fmt: skip
        trainer.train()
        logs[who] = [e for e in trainer.state.log_history if "reward" in e]
    for who, entries in logs.items():
        assert len(entries) == 2, who
        for e in entries:
            assert e["constant_metric"] == pytest.approx(3.0), who
            assert e["rewards/always/mean"] == pytest.approx(0.5), who
            assert e["rewards/every_other/mean"] == pytest.approx(1.0), who  # nanmean: the Nones left out
            assert e["reward"] == pytest.approx(1.0), who  # nansum: 1 + 0.5 and (None) + 0.5, averaged
    records = [json.loads(line) for line in (tmp_path / "grpolab" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 and all(r["extra"]["length"] == len(r["completion"]) for r in records)

    # every_other alone: half the rollouts have no reward; the logged reward is the mean over the other half (1.0),
    # as TRL logs it, not 0.5 (their Nones counted as 0)
    for who, Config, Trainer in (("trl", TrlConfig, TrlTrainer), ("grpolab", GRPOConfig, GRPOTrainer)):
        args = Config(output_dir=str(tmp_path / f"{who}-alone"), **options)
        trainer = Trainer(BUILTIN, [every_other], args=args, train_dataset=rows)
        trainer.train()
        entries = [e for e in trainer.state.log_history if "reward" in e]
        assert len(entries) == 2 and all(e["reward"] == pytest.approx(1.0) for e in entries), (who, entries)


# ---------------------------------------------------------------- rollouts no function scored


def test_a_rollout_every_function_declined_has_no_reward_and_trl_s_advantage():
    """TRL 1.16: a completion for which every reward function returned None is NaN, left out of its group's nanmean
    and nanstd, and its advantage set to 0 (nan_to_num); grpolab's scorable_advantages gives the same numbers."""
    from trl.trainer.utils import nanstd

    from grpolab.algo.advantages import scorable_advantages

    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, 5, generator=g).round(decimals=1)  # [groups, G]
    declined = torch.rand(6, 5, generator=g) < 0.35
    declined[0] = False  # a group fully scored
    declined[1, 1:] = True  # a group with one scored rollout
    declined[2] = True  # a group with none
    with_nan = rewards.masked_fill(declined, float("nan"))
    mean = torch.nanmean(with_nan, dim=1, keepdim=True)
    std = torch.stack([nanstd(row) for row in with_nan])[:, None]
    trl = torch.nan_to_num((with_nan - mean) / (std + 1e-4), nan=0.0)
    ours = scorable_advantages(list(rewards), list(declined), "grpo_std", sample_std=True).view(6, 5)
    assert torch.allclose(ours, trl, atol=1e-5)
    assert (ours[declined] == 0).all() and (ours[1] == 0).all()
    plain = scorable_advantages(list(rewards), list(declined), "grpo").view(6, 5)  # group mean over the scored
    assert torch.allclose(plain[0], rewards[0] - rewards[0].mean(), atol=1e-6)


def test_score_marks_the_rollouts_every_function_declined():
    def half(completions, **kwargs):
        return [None if c.startswith("x") else 1.0 for c in completions]

    def other(completions, **kwargs):
        return [None if c.endswith("x") else 0.5 for c in completions]

    fns = [(n, from_trl(f, prompt_of=lambda r: "q", chat=False), 1.0) for n, f in (("half", half), ("other", other))]
    got = score(["xax", "xa", "ax", "aa"], [{}] * 4, fns)
    assert got.unscorable.tolist() == [True, False, False, False]
    assert got.total.tolist() == [0.0, 0.5, 1.0, 1.5] and got.errors == 0
    assert score(["aa"], [{}], fns).unscorable is None  # all scored: nothing marked


def test_grpolab_trl_leaves_declined_rollouts_out_of_the_reward_and_gives_them_no_advantage(tmp_path):
    from datasets import Dataset

    from grpolab.trl import GRPOConfig, GRPOTrainer

    def every_other(completions, **kwargs):
        return [None if i % 2 else float(len(c) % 3) for i, c in enumerate(completions)]

    rows = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)])
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, logging_steps=1, report_to="none", bf16=False, use_cpu=True,
                      log_completions=True, disable_tqdm=True, save_strategy="no")  # fmt: skip
    trainer = GRPOTrainer(BUILTIN, [every_other], args=args, train_dataset=rows)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    declined = [r for r in records if r["reward"] is None]
    assert len(declined) == len(records) // 2 and all(r["advantage"] == 0.0 for r in declined)
    for entry in (e for e in trainer.state.log_history if "reward" in e):
        scored = [r["reward"] for r in records if r["reward"] is not None and r["step"] == entry["step"]]
        assert entry["reward"] == pytest.approx(sum(scored) / len(scored))  # the mean over the scored alone
