"""--precision (grpolab.common.precision): what each choice holds and computes in, the --dtype alias and old configs,
refusals, the LM head in fp32 in the trainer and in the sampler, the Kahan-compensated optimizer and the fp16 loss
scaler through a checkpoint, LoRA's layout under bf16-mixed, and the share of an update that registers on SmolLM2."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.marks import EACH_CPU
from helpers.models import model_and_batch
from helpers.runs import quiet, small_cfg
from helpers.vlm import VLM_FAMILIES, tiny_vlm

from grpolab.common.errors import ConfigError
from grpolab.common.precision import Precision, PrecisionError, auto_precision, resolve_precision, rollout_dtype
from grpolab.config.train import TrainConfig
from grpolab.models.head import Fp32Head, fp32_head
from grpolab.training.forward import LogProbs, TrainModule
from grpolab.training.optim import build_optimizer, exact_weights
from grpolab.training.recipe import run_training, saved_config, train

CPU = torch.device("cpu")


# ---------------------------------------------------------------- the setting


@pytest.mark.parametrize(
    ("name", "param", "compute", "mixed"),
    [
        ("32-true", torch.float32, torch.float32, False),
        ("bf16-mixed", torch.float32, torch.bfloat16, True),
        ("16-mixed", torch.float32, torch.float16, True),
        ("bf16-true", torch.bfloat16, torch.bfloat16, False),
        ("64-true", torch.float64, torch.float64, False),
    ],
)
def test_each_precision_holds_and_computes_in_its_dtypes(name, param, compute, mixed):
    p = Precision(name)
    assert (p.param_dtype, p.compute_dtype, p.mixed, p.scaled) == (param, compute, mixed, name == "16-mixed")
    assert p.kahan == (name == "bf16-true")
    assert Precision(name, fp32_head=True).head_fp32 == (compute in (torch.bfloat16, torch.float16))
    assert rollout_dtype("auto", p.compute_dtype) == compute  # the sampler computes as the trainer does
    assert rollout_dtype("float32", p.compute_dtype) == torch.float32


@pytest.mark.hardware
@EACH_CPU
def test_auto_is_bf16_mixed_on_a_gpu_and_fp32_on_the_cpu(machine_kind, units):
    machine_kind(bf16=units, cuda=1, cuda_bf16=True)
    assert auto_precision(torch.device("cuda", 0)) == "bf16-mixed"
    assert auto_precision(torch.device("cuda", 0), builtin=True) == "32-true"
    assert auto_precision(CPU) == "32-true"  # bf16 units or not: docs/precision.md measures why
    assert auto_precision(CPU, given_dtype=torch.float64) == "64-true"  # a model object keeps its dtype
    # a bf16 model object trains compensated in bf16 where the CPU computes bf16, else in fp32
    assert auto_precision(CPU, given_dtype=torch.bfloat16) == ("bf16-true" if units else "32-true")
    assert auto_precision(CPU, given_dtype=torch.float32) == "32-true"
    machine_kind(bf16=units, cuda=1, cuda_bf16=False)  # a GPU before Ampere
    assert auto_precision(torch.device("cuda", 0)) == "32-true"


@pytest.mark.hardware
def test_the_probe_reads_the_environment_and_torch(monkeypatch):
    from grpolab.common.machine import detect

    monkeypatch.delenv("GRPOLAB_BF16_UNITS", raising=False)
    real = detect()
    assert real.isa == torch.backends.cpu.get_cpu_capability() and real.set_by == ""
    assert bool(real.cpu_bf16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    monkeypatch.setenv("GRPOLAB_BF16_UNITS", "0")
    none = detect()
    assert none.cpu_bf16 == () and none.bf16_units(CPU) == "" and "no bf16 units (GRPOLAB_BF16_UNITS=0)" in (
        none.describe())  # fmt: skip
    monkeypatch.setenv("GRPOLAB_BF16_UNITS", "1")
    assert detect().cpu_bf16 and detect().bf16_units(CPU).startswith("CPU with ")
    monkeypatch.setenv("GRPOLAB_BF16_UNITS", "yes")
    with pytest.raises(ValueError, match="GRPOLAB_BF16_UNITS must be 0"):
        detect()


@pytest.mark.hardware
def test_what_the_device_cannot_run_is_refused_in_one_line(machine_kind):
    with pytest.raises(PrecisionError, match="--precision 16-mixed: fp16 with loss scaling runs on CUDA devices only"):
        resolve_precision("16-mixed", CPU)
    machine_kind(bf16=False, cuda=1, cuda_bf16=False)
    for name in ("bf16-mixed", "bf16-true"):
        with pytest.raises(PrecisionError, match=f"--precision {name}: this GPU does not support bf16"):
            resolve_precision(name, torch.device("cuda", 0))
    assert resolve_precision("32-true", CPU).name == "32-true"
    assert issubclass(PrecisionError, ConfigError)  # the CLI prints it as one line


@pytest.mark.hardware
@EACH_CPU
def test_bf16_runs_on_every_cpu_and_says_what_computes_it(machine_kind, units):
    """A CPU without bf16 units runs bf16 (PyTorch converts through fp32): a laptop rehearses a GPU's bf16-mixed
    configuration with bf16's rounding, and the run's log says what it costs; with units, it names them."""
    machine_kind(bf16=units)
    for name in ("bf16-mixed", "bf16-true"):
        line = resolve_precision(name, CPU).describe(CPU)
        assert ("CPU with AMX_BF16, AVX512_BF16" in line) == units, line
        assert ("no bf16 units on this CPU" in line and "x or more the time of --precision 32-true" in line) != units
    assert "bf16 units" not in resolve_precision("32-true", CPU).describe(CPU)


def test_dtype_is_an_alias_that_folds_into_precision():
    fold = {n: TrainConfig(dtype=n).resolved().machine for n in ("float32", "float64", "bfloat16", "auto")}
    assert (fold["float32"].precision, fold["float64"].precision) == ("32-true", "64-true")
    assert (fold["bfloat16"].precision, fold["bfloat16"].compensation) == ("bf16-true", "none")  # as it trained
    assert fold["auto"].precision == "auto" and all(m.dtype == "" for m in fold.values())
    assert TrainConfig(dtype="auto", precision="bf16-mixed").resolved().machine.precision == "bf16-mixed"
    with pytest.raises(ConfigError, match="--dtype: float32 is --precision 32-true, but --precision bf16-mixed"):
        TrainConfig(dtype="float32", precision="bf16-mixed").validate()


def test_a_run_records_its_precision_and_a_run_from_before_it_resumes(tmp_path):
    out = train(small_cfg(tmp_path / "R", steps=2, save_every=1), log=quiet)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["precision"], saved["dtype"], saved["rollout_dtype"]) == ("32-true", "", "float32")
    with pytest.raises(ConfigError, match="--precision is 'bf16-mixed' but the run was started with '32-true'"):
        train(small_cfg(out, steps=3, resume=True, precision="bf16-mixed"), log=quiet)
    # config.json of a run from before --precision: --dtype and no precision; it loads and resumes as it trained
    old = {k: v for k, v in saved.items() if k not in ("precision", "compensation", "fp32_head")}
    (out / "config.json").write_text(json.dumps({**old, "dtype": "float32"}))
    assert saved_config(out).machine.dtype == "float32"
    recipe = run_training(small_cfg(out, steps=3, resume=True), log=quiet)
    assert recipe.trainer.update_stage.precision.name == "32-true"


# ---------------------------------------------------------------- the forward


def test_bf16_mixed_computes_under_autocast_from_fp32_masters_and_scores_in_fp32():
    model, batch = model_and_batch()
    plain = LogProbs(model)(*batch)
    mixed = LogProbs(model, precision=Precision("bf16-mixed"))(*batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        by_hand = LogProbs(model)(*batch)
    assert mixed.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    assert torch.equal(mixed, by_hand)  # the trainer's forward is autocast's, nothing else
    assert not torch.allclose(mixed, plain, atol=1e-5)  # and it is not fp32's
    assert torch.allclose(mixed, plain, atol=0.1)


def test_the_fp32_head_leaves_autocast_for_the_head_alone():
    model, batch = model_and_batch()
    head = model.get_output_embeddings()
    h = torch.randn(3, head.weight.shape[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head(h).dtype == torch.bfloat16  # linear is on autocast's list, whatever its weight's dtype
        with fp32_head(model):
            wrapped = model.get_output_embeddings()
            assert isinstance(wrapped, Fp32Head) and wrapped.weight is head.weight
            out = wrapped(h.bfloat16())
    assert out.dtype == torch.float32 and torch.equal(
        out, torch.nn.functional.linear(h.bfloat16().float(), head.weight)
    )
    assert model.get_output_embeddings() is head and "lm_head.weight" in model.state_dict()  # put back as it was
    p = Precision("bf16-mixed", fp32_head=True)
    with_head = LogProbs(model, precision=p)(*batch)
    without = LogProbs(model, precision=Precision("bf16-mixed"))(*batch)
    assert not torch.equal(with_head, without)
    # the gradient reaches the head's fp32 weight through the fp32 product
    with_head.sum().backward()
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.float32


@pytest.mark.hardware
def test_the_samplers_copy_keeps_an_fp32_head_from_the_masters():
    from grpolab.rollout.engine import EngineSpec, HFEngine

    model, _ = model_and_batch()
    model.eval()
    for fp32 in (False, True):
        engine = HFEngine(model, EngineSpec(2, 0, torch.bfloat16, fp32_head=fp32), always_copy=True)
        copy = engine.weights.model
        head = engine.weights.decoder.lm_head if engine.weights.decoder else copy.get_output_embeddings()
        x = torch.randn(2, model.config.hidden_size).bfloat16()
        logits = head(x)
        assert logits.dtype == (torch.float32 if fp32 else torch.bfloat16)
        if fp32:  # the master's own weight, unrounded, on the bf16 hidden state cast up
            want = torch.nn.functional.linear(x.float(), model.get_output_embeddings().weight)
            assert torch.allclose(logits, want, rtol=1e-5, atol=1e-5)
        assert next(p for p in copy.parameters()).dtype == torch.bfloat16  # the rest of the copy in bf16


# ---------------------------------------------------------------- the update


def _step(model, precision: Precision, lr: float, batch, grads: list | None = None) -> float:
    """One optimizer step on -mean log-prob at ``lr`` (``grads``: that loss's gradient, computed already, in the
    weights' order); the share of the weights with a nonzero gradient whose exact value changed."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr, 0.0, precision)
    if grads is None:
        logp = TrainModule(model, 1.0, precision=precision).logprobs(batch)
        (-logp.sum() / batch.completion_mask.sum()).backward()
    else:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
    nonzero = [p.grad.reshape(-1) != 0 for p in params]
    before = [exact_weights(opt, p).clone() for p in params]
    opt.step()
    after = [exact_weights(opt, p) for p in params]
    counted = sum(int(n.sum()) for n in nonzero)
    return sum(int(((a != b) & n).sum()) for a, b, n in zip(after, before, nonzero)) / counted


def test_kahan_summation_keeps_what_bf16_rounding_loses():
    """Plain AdamW on bf16 weights at a small learning rate moves few of them; Kahan summation (torch-optimi)
    registers every update in weight + compensation, and over steps tracks fp32 AdamW where plain bf16 stalls."""
    model, batch = model_and_batch()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = 1e-6  # the tiny model's weights are about 0.05: half a bf16 spacing is 1e-4, so plain AdamW moves none
    shares = {}
    for comp in ("none", "kahan"):
        m = model_and_batch()[0].to(torch.bfloat16)
        shares[comp] = _step(m, Precision("bf16-true", comp), lr, batch)
    assert shares["kahan"] > 0.99 > 0.5 > shares["none"]
    # ten steps: how far each run's exact weights moved, against how far fp32 AdamW's moved
    ref = model_and_batch()[0]
    opt32 = build_optimizer(list(ref.parameters()), lr, 0.0, Precision("32-true"))
    runs = {c: model_and_batch()[0].to(torch.bfloat16) for c in ("none", "kahan")}
    opts = {c: build_optimizer(list(m.parameters()), lr, 0.0, Precision("bf16-true", c)) for c, m in runs.items()}
    start = {c: [exact_weights(opts[c], p).clone() for p in m.parameters()] for c, m in runs.items()}
    for _ in range(10):
        for m, opt, p in [
            (ref, opt32, Precision("32-true")),
            *((runs[c], opts[c], Precision("bf16-true", c)) for c in runs),
        ]:
            opt.zero_grad()
            logp = TrainModule(m, 1.0, precision=p).logprobs(batch)
            (-logp.sum() / batch.completion_mask.sum()).backward()
            opt.step()
    moved = [(p.detach() - fp32[n]).reshape(-1) for n, p in ref.named_parameters()]
    size = sum(float(v.norm()) ** 2 for v in moved) ** 0.5
    err = {}
    for c, m in runs.items():
        went = [exact_weights(opts[c], p) - s0 for p, s0 in zip(m.parameters(), start[c])]
        err[c] = sum(float((w - v).norm()) ** 2 for w, v in zip(went, moved)) ** 0.5 / size
    assert err["kahan"] < 0.1 < err["none"], err


@pytest.mark.hardware
@pytest.mark.slow  # three runs of the built-in model
def test_bf16_true_with_kahan_resumes_as_the_uninterrupted_run(tmp_path):
    from helpers.runs import assert_same_metrics

    opts = dict(precision="bf16-true", lr=1e-4, warmup_steps=0, save_every=1)
    whole = train(small_cfg(tmp_path / "whole", steps=3, **opts), log=quiet)
    cut = train(small_cfg(tmp_path / "cut", steps=2, **opts), log=quiet)
    state = torch.load(cut / "checkpoints" / "step_2" / "optimizer.pt", weights_only=True)
    comps = [s["kahan_comp"] for s in state["state"].values() if s.get("kahan_comp") is not None]
    assert comps and all(c.dtype == torch.bfloat16 for c in comps) and any(bool(c.abs().sum()) for c in comps)
    resumed = train(small_cfg(cut, steps=3, resume=True, **opts), log=quiet)
    assert_same_metrics(whole, resumed)
    # the bf16 sampler and the bf16 trainer run other kernels, which differ by bf16's rounding: corrected
    assert json.loads((whole / "config.json").read_text())["engine_correction"] == "sequence-truncate"
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["doctor/weights_unmoved_exact_frac"] < 0.01 for r in rows)  # the compensation kept every update
    assert all(r["doctor/weights_unmoved_frac"] > r["doctor/weights_unmoved_exact_frac"] for r in rows)  # held: less


@pytest.mark.slow  # three runs of the built-in model in fp16, which this CPU computes slowly
def test_fp16_loss_scaling_skips_and_counts_overflows_and_resumes(tmp_path, monkeypatch):
    """16-mixed through the whole trainer on this CPU (its refusal lifted for the test: CPU autocast runs fp16, and
    torch's GradScaler takes the CPU): a first scale of 2^40 overflows the fp16 gradients, so the first steps are
    skipped and counted and the scale halves each time until the gradients fit; a resumed run takes the scale back
    from its checkpoint."""
    from helpers.runs import assert_same_metrics

    import grpolab.training.update_stage as update_stage_module

    monkeypatch.setattr("grpolab.common.precision.check_supported", lambda precision, device: None)
    monkeypatch.setattr(
        update_stage_module, "build_scaler", lambda p, d: torch.amp.GradScaler(d.type, init_scale=2.0**22)
    )
    opts = dict(precision="16-mixed", warmup_steps=0, save_every=1)
    whole = train(small_cfg(tmp_path / "whole", steps=6, **opts), log=quiet)
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "precision/loss_scale" in r]
    assert steps[0]["precision/overflow_skips"] == 1 and steps[0]["precision/loss_scale"] == 2.0**21
    assert steps[0]["loss/skipped_updates"] == 0  # an overflow is the scaler's, not a non-finite loss
    assert steps[-1]["precision/overflow_skips"] == 0  # it backed off until the gradients fit, and then stepped
    cut = train(small_cfg(tmp_path / "cut", steps=2, **opts), log=quiet)
    state = json.loads((cut / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["grad_scaler"]["scale"] == steps[1]["precision/loss_scale"]
    resumed = train(small_cfg(cut, steps=6, resume=True, **opts), log=quiet)
    assert_same_metrics(whole, resumed)


@pytest.mark.hardware
def test_lora_under_bf16_mixed_trains_fp32_adapters_over_a_bf16_base(tmp_path):
    recipe = run_training(
        small_cfg(tmp_path / "L", steps=2, precision="bf16-mixed", lora_rank=4, lr=1e-3, warmup_steps=0), log=quiet
    )
    model, opt = recipe.trainer.policy.model, recipe.trainer.update_stage.optimizer
    named = dict(model.named_parameters())
    base = [p for n, p in named.items() if "lora_" not in n]
    adapters = [p for n, p in named.items() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapters}
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert any(bool(p.detach().abs().sum()) for n, p in named.items() if "lora_B" in n)  # B left zero: it trained


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.slow
@pytest.mark.smollm2
def test_an_update_at_lr_1e_6_registers_on_smollm2_in_each_precision_but_pure_bf16():
    """The share of SmolLM2's weights with a nonzero gradient that one AdamW step at lr 1e-6 changes (the exact
    value: with Kahan summation, weight + compensation): all but rounding's few in fp32 masters and with Kahan; about
    0.4% with plain AdamW on bf16 weights (docs/precision.md). What only the real model shows is its weights' sizes
    against the step; the step is the optimizer's. Adam's first step moves each weight by about lr whatever its
    gradient's rounding, so one fp32 gradient serves every precision, each stepping a copy in its weights' dtype (the
    bf16 forward and backward: the tests above, on the tiny model; on a CPU without bf16 units SmolLM2's took 250 s)."""
    from grpolab.common.batch import Batch, left_pad
    from grpolab.models.policy import load_policy

    shares = {}
    loaded = load_policy("smollm2-135m-instruct", torch.float32)  # once; each precision steps a copy in its dtype
    N, T = 4, 32
    prompt_ids, prompt_mask = left_pad([loaded.prompt_ids({"prompt": "What is 12 + 30?"})] * N, loaded.pad_id)
    ids = torch.randint(100, 40000, (N, T), generator=torch.Generator().manual_seed(0))
    batch = Batch(prompt_ids, prompt_mask, ids, torch.ones(N, T, dtype=torch.long))
    model = loaded.model.train()
    logp = TrainModule(model, 1.0, precision=Precision("32-true")).logprobs(batch)
    grads = torch.autograd.grad(-logp.sum() / batch.completion_mask.sum(), list(model.parameters()))
    for name, comp in (("32-true", "kahan"), ("bf16-mixed", "kahan"), ("bf16-true", "kahan"), ("bf16-true", "none")):
        p = Precision(name, comp)
        shares[(name, comp)] = _step(copy.deepcopy(model).to(p.param_dtype), p, 1e-6, batch, grads)
    assert shares[("32-true", "kahan")] >= 0.99
    assert shares[("bf16-mixed", "kahan")] >= 0.99
    assert shares[("bf16-true", "kahan")] >= 0.99
    assert shares[("bf16-true", "none")] < 0.02, shares


@pytest.mark.hardware
def test_eval_samples_in_its_precisions_compute_dtype(monkeypatch):
    """``grpolab eval --precision bf16-mixed``: the weights loaded in fp32, sampled by a bf16 copy that computes as
    autocast does; 16-mixed on a CPU is refused before anything is loaded."""
    import grpolab
    from grpolab.rollout import engine as engines

    built = []
    original = engines.HFEngine.__init__

    def recording(self, model, spec, **kw):
        original(self, model, spec, **kw)
        built.append((next(model.parameters()).dtype, self.weights.dtype, self.weights.storage))

    monkeypatch.setattr(engines.HFEngine, "__init__", recording)
    report = grpolab.evaluate(model="builtin", precision="bf16-mixed", questions=4, samples=0, log=quiet)
    assert 0.0 <= report["metrics"]["eval/accuracy_greedy"] <= 1.0
    assert built == [(torch.float32, torch.bfloat16, torch.float32)]
    with pytest.raises(PrecisionError, match="16-mixed"):
        grpolab.evaluate(model="builtin", precision="16-mixed", questions=4, samples=0, log=quiet)


@pytest.mark.hardware
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_mixed_sampler_copy_of_a_vision_language_model_rounds_its_language_models_attention(family):
    """The flag that makes a mixed copy's attention round as autocast's is read from each attention module's config:
    for a vision-language model that is the language model's own config, not the outer one."""
    from grpolab.models.attention import attention_rounding
    from grpolab.rollout.weights import SamplerWeights

    model, _ = tiny_vlm(family)
    copy_ = SamplerWeights(model, torch.bfloat16, always_copy=True, storage=torch.float32).model
    text = copy_.get_decoder() if hasattr(copy_, "get_decoder") else copy_.model.language_model
    attention = [m for name, m in text.named_modules() if name.endswith("self_attn")]
    assert attention and all(attention_rounding(m) == torch.bfloat16 for m in attention)


@pytest.mark.hardware
def test_a_sampler_for_a_mixed_trainer_computes_as_autocast_does():
    """Under bf16-mixed the sampler's copy keeps fp32 embeddings, norms and residual stream around bf16 products and
    rounds attention as autocast does: through the fused decode step or transformers' forward alike, and closer to
    the bf16-mixed trainer's log-probs than a copy held wholly in bf16 (seeded; the tiny model's own figures: log-ratio
    sd 2.6e-4 against 5.2e-4)."""
    from grpolab.rollout.sampler import sample_with_stats
    from grpolab.rollout.weights import SamplerWeights

    model, _ = model_and_batch()
    model.eval()
    prompts, keys = [[1, 5, 6, 7], [1, 8, 9]] * 4, [(0, i) for i in range(8)]
    trainer = LogProbs(model, precision=Precision("bf16-mixed"))
    spread = {}
    for storage in (None, torch.float32):
        draws = []
        for fuse in (True, False):
            w = SamplerWeights(model, torch.bfloat16, fuse=fuse, always_copy=True, storage=storage)
            assert (w.decoder is not None) == fuse and w.mixed == (storage is not None)
            if storage is not None:  # fp32 outside the products, bf16 products
                assert w.model.get_input_embeddings().weight.dtype == torch.float32
            draws.append(sample_with_stats(w.model, prompts, keys, max_new_tokens=12, temperature=1.0, top_p=1.0,
                                           eos_id=2, pad_id=0, decoder=w.decoder))  # fmt: skip
        assert torch.equal(draws[0].batch.completion_ids, draws[1].batch.completion_ids)
        assert torch.allclose(draws[0].logprobs, draws[1].logprobs, atol=1e-6)
        b = draws[0].batch
        with torch.no_grad():
            spread[storage] = float((trainer(*b) - draws[0].logprobs)[b.completion_mask.bool()].std())
    assert spread[torch.float32] < 0.75 * spread[None], spread
