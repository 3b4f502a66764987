"""--log-token-credit: which rollouts are recorded, each token's span and segment, the credit/* aggregates, and, on
the built-in model, that the recorded change of each token's log-prob is the step's update's."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from statistics import NormalDist

import pytest
import torch
from helpers.pages import token_cards as _parse

from grpolab.common.batch import select
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.data.answers import answer_spans
from grpolab.models.logprobs import completion_logprobs
from grpolab.probes.token_credit import (
    credit_aggregates,
    half_mass_fraction,
    pearson,
    pick_rollouts,
    step_aggregates,
    summarise_credit,
    token_segments,
    token_spans,
)
from grpolab.report.page import build_report
from grpolab.training.recipe import build_trainer, train

# ---------------------------------------------------------------- which rollouts


def test_pick_rollouts_takes_one_positive_and_one_negative_per_group_in_order():
    adv = torch.tensor([0.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.5, 0.5, -0.5])  # groups of 4
    assert pick_rollouts(adv, [4, 4, 4], 4) == [2, 1, 9, 8]
    assert pick_rollouts(adv, [4, 4, 4], 2) == [2, 1]
    # too few rollouts with credit: the rest in order
    assert pick_rollouts(adv, [4, 4, 4], 7) == [2, 1, 9, 8, 0, 3, 4]
    assert pick_rollouts(torch.zeros(3), [3], 2) == [0, 1]
    assert pick_rollouts(torch.zeros(0), [], 4) == []


# ---------------------------------------------------------------- spans and segments


def test_spans_of_a_character_tokenizer_are_its_characters():
    vocab = list("ab #12\n")

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    ids = [0, 1, 6, 3, 3, 3, 3, 2, 4, 5]
    assert token_spans(decode, ids) == [vocab[i] for i in ids]


def test_a_character_split_over_byte_tokens_goes_to_its_last_byte():
    def decode(ids):  # a byte-level tokenizer: one token per byte
        return bytes(ids).decode("utf-8", errors="replace")

    text = "x é€ y"
    ids = list(text.encode())
    spans = token_spans(decode, ids)
    assert "".join(spans) == text and len(spans) == len(ids)
    assert spans[:3] == ["x", " ", ""] and spans[3] == "é"  # é is two bytes
    assert spans[4:7] == ["", "", "€"]  # € is three


def test_a_decoder_that_rewrites_its_prefix_still_gives_the_whole_text():
    words = ["▁Hello", "▁world", "!", "</s>"]

    def decode(ids):  # sentencepiece-like: the leading space of the text is dropped; </s> is special
        text = "".join(words[i] for i in ids if words[i] != "</s>").replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    spans = token_spans(decode, [0, 1, 2, 3])
    assert spans == ["Hello", " world", "!", ""]


@pytest.mark.parametrize(
    "text,answer,markers",
    [
        ("3*4=12\n#### 12", "12", ["#### "]),
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}", ["\\boxed{", "}"]),
        ("Here:\n```python\ndef f():\n    return 1\n```\n", "def f():\n    return 1\n", ["```python\n", "```"]),
        ("It is 7, not 8.", "8", []),
        ("no answer here", None, []),
        ("#### none", None, ["####"]),
    ],
)
def test_answer_spans_find_what_the_rewards_read(text, answer, markers):
    span, found = answer_spans(text)
    assert (text[span[0] : span[1]] if span else None) == answer
    assert [text[a:b] for a, b in found] == markers


def test_segments_of_a_worked_solution():
    text = "3*4=12\n#### 12"
    spans = list(text) + [""]  # one token per character, then end-of-sequence
    seg = token_segments(spans)
    assert seg[:7] == ["reasoning"] * 7
    assert seg[7:12] == ["format"] * 5  # "#### "
    assert seg[12:14] == ["answer", "answer"] and seg[14] == "format"
    # a token that holds both a marker and part of the answer counts as answer
    assert token_segments(["x ", "#### 1", "2"]) == ["reasoning", "answer", "answer"]


# ---------------------------------------------------------------- aggregates


def test_half_mass_fraction_and_pearson_by_hand():
    assert half_mass_fraction(torch.tensor([0.0, 3.0, -1.0, 1.0, 1.0])) == pytest.approx(1 / 5)  # 3 of 6
    assert half_mass_fraction(torch.tensor([1.0, -1.0, 1.0, 1.0])) == pytest.approx(2 / 4)
    assert half_mass_fraction(torch.zeros(3)) is None
    # centred: x = (-1, 0, 1), y = (-13, -1, 14) / 6: sum xy = 4.5, sum x^2 = 2, sum y^2 = 61/6
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.5])) == pytest.approx(
        4.5 / math.sqrt(2 * 61 / 6)
    )
    assert pearson(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) is None


def test_credit_aggregates_by_hand():
    dlogp = torch.tensor([0.1, -0.2, 0.3, -0.4, 0.0, 0.6])
    adv = torch.tensor([1.0, 1.0, 0.0, -1.0, -1.0, 1.0])
    seg = ["reasoning", "reasoning", "format", "answer", "answer", "answer"]
    out = credit_aggregates(dlogp, adv, seg)
    total = 1.6
    assert out["answer_share"] == pytest.approx(1.0 / total)
    assert out["reasoning_share"] == pytest.approx(0.3 / total)
    assert out["format_share"] == pytest.approx(0.3 / total)
    assert out["answer_token_frac"] == pytest.approx(0.5) and out["format_token_frac"] == pytest.approx(1 / 6)
    carried = [0, 1, 3, 4, 5]  # adv != 0
    expected = pearson(dlogp[carried], torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0]))
    assert out["sign_corr"] == pytest.approx(expected)
    assert out["half_mass_frac"] == pytest.approx(2 / 6)  # 0.6 + 0.4 >= 0.8
    assert out["abs_mean"] == pytest.approx(total / 6)
    assert out["dlogp_pos"] == pytest.approx((0.1 - 0.2 + 0.6) / 3)
    assert out["dlogp_neg"] == pytest.approx(-0.2)
    assert out["tokens"] == 6


def test_the_flag_is_validated():
    with pytest.raises(ConfigError, match="log_token_credit|log-token-credit"):
        TrainConfig(log_token_credit=-1).validate()


# ---------------------------------------------------------------- on the built-in model

F64 = dict(
    dtype="float64",
    prompts_per_step=4,
    group_size=4,
    max_new_tokens=24,
    warmup_steps=0,
    lr=1e-3,
    eval_questions=8,
    eval_samples=1,
    progress=False,
    log_token_credit=4,
)


def _step_with_independent_forwards(cfg: TrainConfig, step: int = 1):
    """One step of a trainer, with the policy's weights copied before it; returns (trainer, output, rollouts,
    weights before)."""
    trainer = build_trainer(cfg.resolved(), log=lambda *a: None)
    seen = {}
    collect = trainer.sampling_stage.collector.collect

    def keep(step):
        seen["roll"] = collect(step)
        return seen["roll"]

    trainer.sampling_stage.collector.collect = keep
    before = copy.deepcopy(trainer.policy.model)
    out = trainer.step(step)
    return trainer, out, seen["roll"], before


@pytest.mark.parametrize("variant", [{}, {"mu": 2, "beta": 0.04, "micro_batch": 4}])
@pytest.mark.slow
def test_dlogp_is_the_difference_of_two_independent_forwards(tmp_path, variant):
    cfg = dataclasses.replace(TrainConfig(), **F64, **variant, out=str(tmp_path))
    trainer, out, roll, before = _step_with_independent_forwards(cfg)
    records, watched = out.token_credit, trainer.update_stage.updater.watched
    assert len(records) == 4 and out.metrics["credit/rollouts"] == 4
    sub = select(roll.groups.rows.batch, torch.tensor(watched.rows))
    with torch.no_grad():
        lp_before = completion_logprobs(before, sub, cfg.generation.temperature)  # [K, T]
        lp_after = completion_logprobs(trainer.policy.model, sub, cfg.generation.temperature)
    moved = 0.0
    for k, rec in enumerate(records):
        T = len(rec["ids"])
        expected = (lp_after[k, :T] - lp_before[k, :T]).tolist()
        assert rec["dlogp"] == pytest.approx(expected, abs=1e-10, rel=0)
        assert rec["logp"] == pytest.approx(lp_before[k, :T].tolist(), abs=1e-10, rel=0)
        assert rec["logp_sampler"] == pytest.approx(rec["logp"], abs=1e-6)  # the hf engine: the same model
        moved = max(moved, max(abs(d) for d in rec["dlogp"]))
        assert "".join(rec["tokens"]) == rec["completion"] == roll.groups.rows.texts[watched.rows[k]]
        carried = [r is not None for r in rec["ratio"]]
        assert all(carried)  # every token carries loss here
        if cfg.objective.mu == 1:  # one pass from the sampling weights: the ratio is 1, never clipped
            assert rec["ratio"] == pytest.approx([1.0] * T, abs=1e-12) and not any(rec["clipped"])
        else:  # the second pass's ratio: pi after the first optimizer step / pi at sampling
            assert max(abs(r - 1.0) for r in rec["ratio"]) > 1e-6
    assert moved > 1e-4, "the update should move some token's log-prob"
    signs = {math.copysign(1, r["advantage"]) for r in records if r["advantage"]}
    assert signs == {1.0, -1.0}, "positive and negative rollouts side by side"
    assert out.metrics["credit/sign_corr"] is not None


def test_masked_tokens_show_advantage_zero(tmp_path):
    """--mask-truncated drops cut-off rollouts and --top-entropy-quantile keeps only the step's high-entropy tokens:
    a token the loss does not use is recorded with advantage 0, and every other token with its rollout's."""
    cfg = dataclasses.replace(
        TrainConfig(),
        **{**F64, "max_new_tokens": 20, "log_token_credit": 16},
        mask_truncated=True,
        top_entropy_quantile=0.5,
        out=str(tmp_path),
    )
    trainer, out, roll, _ = _step_with_independent_forwards(cfg)
    records = out.token_credit
    assert len(records) == 16  # every rollout of the step
    eos = trainer.policy.eos_id
    kept_entropy, dropped_entropy = [], []
    for rec in records:
        truncated = eos not in rec["ids"]
        for a, e, ratio in zip(rec["adv"], rec["entropy"], rec["ratio"]):
            if truncated or rec["advantage"] == 0:  # not in the update at all: no loss, no ratio
                assert a == 0.0 and ratio is None
                continue
            assert a in (0.0, pytest.approx(rec["advantage"], abs=1e-12)) and ratio is not None
            (kept_entropy if a else dropped_entropy).append(e)
    assert any(eos not in r["ids"] for r in records), "some rollout should be cut off at 20 tokens"
    assert kept_entropy and dropped_entropy
    assert min(kept_entropy) >= max(dropped_entropy)  # one threshold over the step's tokens


@pytest.mark.slow
def test_recorded_advantages_and_completions_equal_the_rollouts_log(tmp_path):
    cfg = dataclasses.replace(
        TrainConfig(), **{**F64, "dtype": "float32"}, steps=3, log_rollouts=True, out=str(tmp_path)
    )
    run = train(cfg, log=lambda *a: None)
    rollouts = {
        (r["step"], r["prompt"], r["rollout"]): r
        for r in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines())
    }
    credit = [json.loads(line) for line in (run / "token_credit.jsonl").read_text().splitlines()]
    assert [c["step"] for c in credit] == [1] * 4 + [2] * 4 + [3] * 4
    for c in credit:
        r = rollouts[(c["step"], c["prompt"], c["rollout"])]
        assert c["advantage"] == r["advantage"] and c["reward"] == r["reward"]
        assert c["completion"] == r["completion"] and len(c["ids"]) == r["tokens"]
        assert all(a == pytest.approx(r["advantage"]) for a in c["adv"])  # every token carries the rollout's
    # the report's page: each shown rollout's token spans (markers aside) are its completion exactly
    page = build_report(run).read_text(encoding="utf-8")
    cards = _parse(page).cards
    assert len(cards) >= 2
    by_key = {(c["step"], c["prompt"], c["rollout"]): c for c in credit}
    for card in cards:
        rec = by_key[(card["step"], card["prompt"], card["rollout"])]
        assert "".join(t["text"] for t in card["tokens"] if not t["mark"]) == rec["completion"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "credit/answer_share" in m]
    assert [m["step"] for m in logged] == [1, 2, 3]
    for m in logged:
        shares = [m[f"credit/{s}_share"] for s in ("answer", "reasoning", "format")]
        assert sum(shares) == pytest.approx(1.0)
        assert 0 < m["credit/half_mass_frac"] <= 1.0 and m["credit/tokens"] == sum(
            len(c["ids"]) for c in credit if c["step"] == m["step"]
        )


def test_low_probability_share_by_hand():
    dlogp = torch.tensor([0.5, -0.1, 0.2, 0.2])
    logp = torch.log(torch.tensor([0.3, 0.95, 0.5, 0.99]))  # tokens 0 and 2 were below 0.9
    out = credit_aggregates(dlogp, torch.ones(4), ["reasoning"] * 4, logp)
    assert out["low_p_share"] == pytest.approx(0.7 / 1.0) and out["low_p_token_frac"] == pytest.approx(0.5)
    assert "low_p_share" not in credit_aggregates(dlogp, torch.ones(4), ["reasoning"] * 4)


def _line(step, dlogp, adv, segment, logp):
    return {"step": step, "dlogp": dlogp, "adv": adv, "segment": segment, "logp": logp}


def test_step_aggregates_and_their_summary_over_spans_of_steps():
    records = [
        _line(1, [0.2, -0.2], [1.0, 1.0], ["answer", "format"], [-0.01, -2.0]),
        _line(1, [0.0, 0.6], [-1.0, -1.0], ["reasoning", "answer"], [-0.5, -0.01]),
        _line(2, [0.1, 0.3], [1.0, 0.0], ["answer", "reasoning"], [-3.0, None]),
        _line(3, [0.4], [1.0], ["answer"], [-1.0]),
    ]
    per = step_aggregates(records)
    assert [p["step"] for p in per] == [1, 2, 3]
    assert per[0]["answer_share"] == pytest.approx(0.8 / 1.0) and per[0]["tokens"] == 4
    assert per[1]["answer_share"] == pytest.approx(0.25) and per[2]["answer_share"] == 1.0
    spans = summarise_credit(per, parts=2)
    assert [(s["first"], s["last"], s["steps"]) for s in spans] == [(1, 2, 2), (3, 3, 1)]
    mean, lo, hi = spans[0]["answer_share"]
    sd = math.sqrt(((0.8 - 0.525) ** 2 + (0.25 - 0.525) ** 2) / 1)
    assert mean == pytest.approx(0.525) and hi - mean == pytest.approx(NormalDist().inv_cdf(0.975) * sd / math.sqrt(2))
    assert spans[1]["answer_share"] == (1.0, 1.0, 1.0)


CLIPS = {
    "token-0.2": dict(importance_sampling="token"),
    "token-tight-delta": dict(importance_sampling="token", clip_low=1e-3, clip_high=2e-3, clip_delta=1.01),
    "sequence-gspo": dict(importance_sampling="sequence", clip_low=3e-4, clip_high=4e-4),
}


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.slow
def test_recorded_ratio_clipping_and_advantage_are_the_losss_own(tmp_path, monkeypatch, clip, aggregation):
    """The record's per-token ratio, clipping and advantage equal (float64, exactly) what ``policy_loss`` computed on
    the last of the mu passes, for every importance-sampling level, clip setting and aggregation; and they agree with
    the textbook formulas written out here."""
    import grpolab.training.update

    calls = []
    real = grpolab.training.update.policy_loss

    def spy(logp, old, adv, mask, **kw):
        calls.append((logp.detach().clone(), old.clone(), adv.clone(), mask.clone(), dict(kw)))
        return real(logp, old, adv, mask, **kw)

    plans = []
    plan_real = grpolab.training.update.plan_micro_batches
    monkeypatch.setattr(grpolab.training.update, "policy_loss", spy)
    monkeypatch.setattr(
        grpolab.training.update, "plan_micro_batches", lambda *a: plans.append(plan_real(*a)) or plans[-1]
    )
    cfg = dataclasses.replace(
        TrainConfig(), **{**F64, "log_token_credit": 16}, mu=2, micro_batch=16, aggregation=aggregation,
        **CLIPS[clip], out=str(tmp_path),
    )  # fmt: skip
    trainer, out, _, _ = _step_with_independent_forwards(cfg)
    assert len(calls) == 2  # mu = 2 passes over one micro-batch of the rows with credit
    pos = {r: i for i, r in enumerate(plans[-1].rows.tolist())}  # a row's place in the pass
    logp, old, adv, mask, kw = calls[-1]
    _, st = real(logp, old, adv, mask, **{**kw, "token_values": True})
    # the formulas: GSPO's ratio per rollout, PPO's clip with the optional cap on the unclipped ratio
    m = mask.double()
    if cfg.objective.importance_sampling == "token":
        ratio = torch.exp(logp - old)
    else:
        ratio = torch.exp(((logp - old) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)).expand_as(logp)
    A = adv[:, None].double().expand_as(logp)
    capped = ratio if not cfg.objective.clip_delta else torch.clamp(ratio, max=cfg.objective.clip_delta)
    clipped = (
        torch.clamp(ratio, 1 - cfg.objective.clip_low, 1 + cfg.objective.clip_high) * A < capped * A
    ) & mask.bool()
    watched = trainer.update_stage.updater.watched
    assert len(out.token_credit) == 16
    n_clipped = 0
    for k, rec in enumerate(out.token_credit):
        if watched.rows[k] not in pos:  # no credit, no pass: nothing the loss computed
            assert rec["advantage"] == 0 and all(a == 0 for a in rec["adv"])
            continue
        r, T = pos[watched.rows[k]], len(rec["ids"])
        assert rec["ratio"] == st["token_ratio"][r, :T].tolist()  # exact
        assert rec["clipped"] == st["token_clipped"][r, :T].tolist()
        assert rec["adv"] == st["token_advantage"][r, :T].tolist()
        assert rec["ratio"] == pytest.approx(ratio[r, :T].tolist(), abs=1e-12, rel=0)
        assert rec["clipped"] == clipped[r, :T].tolist()
        assert rec["adv"] == (A * m)[r, :T].tolist()
        n_clipped += sum(rec["clipped"])
    if clip != "token-0.2":  # tight clips: the second pass clips some tokens, so the check has teeth
        assert n_clipped > 0
