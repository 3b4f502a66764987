"""Each group's prompt encoded once (grpolab.models.shared_prefix), packed rows, activation checkpointing, and --device.

Unit tier: distinct prompts, log-probs and gradients of the shared and the packed path against the padded one on
three architectures (Llama, GPT-2 with learned absolute positions, Qwen2), the fallback notice.
Smoke tier: 2 GRPO steps with --shared-prefix on and off and with --packing (KL reference, mu = 2, micro-batches
that split groups) reach the same parameters on each architecture, saved as local directories.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cli import run_cli
from helpers.models import gpt2, qwen2
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpolab.common.devices import DeviceError, resolve_device
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import ASSET_DIR, enable_activation_checkpointing, load_policy
from grpolab.models.shared_prefix import distinct_prompts
from grpolab.rollout.sampler import sample
from grpolab.training.forward import TrainModule
from grpolab.training.recipe import train

REL_TOL = 1e-5


def _builtin():
    return load_policy("builtin").model


ARCHS = {"llama": lambda tok: _builtin(), "gpt2": lambda tok: gpt2(len(tok)), "qwen2": lambda tok: qwen2(len(tok))}


@pytest.fixture(scope="module")
def group_batch(char_tokenizer):
    """3 prompts of different lengths x 4 rollouts, sampled from the built-in model (some completions end early)."""
    from grpolab.models.policy import Policy

    pol = Policy(_builtin().eval(), char_tokenizer, "builtin")
    prompts = [pol.prompt_ids({"question": q}) for q in ("12+7", "3*45", "99-1+2")]
    return sample(
        pol.model,
        [p for p in prompts for _ in range(4)],
        [(5, i) for i in range(12)],
        max_new_tokens=16,
        temperature=1.0,
        top_p=1.0,
        eos_id=pol.eos_id,
        pad_id=pol.pad_id,
    )


# ---------------------------------------------------------------- unit


def test_distinct_prompts_finds_each_prompt_once_and_maps_every_row():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])  # row 3: the pad id is a real token
    first, inverse = distinct_prompts(ids, mask)
    assert len(first) == 3
    assert torch.equal(ids[first][inverse], ids) and torch.equal(mask[first][inverse], mask)
    assert inverse[0] == inverse[2] != inverse[3] and inverse[1] == inverse[4]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("chunk_tokens", [0, 5])
@pytest.mark.slow
def test_shared_logprobs_and_gradients_equal_the_plain_path(arch, chunk_tokens, group_batch, char_tokenizer):
    torch.manual_seed(0)
    model = ARCHS[arch](char_tokenizer).train()
    params = [p for p in model.parameters()]
    weights = torch.randn(group_batch.completion_ids.shape)  # a loss that weighs every token differently
    out = {}
    for shared in (False, True):
        logp = completion_logprobs(model, group_batch, chunk_tokens=chunk_tokens, shared_prefix=shared)  # [N, T]
        out[shared] = (logp, torch.autograd.grad((logp * weights).sum(), params, allow_unused=True))
    # fp32 sums in another order: 3e-6 on an AVX512 CPU, 1.2e-5 held to AVX2 (Llama); a wrong mask or position is
    # off by 1e-2 or more
    assert torch.allclose(out[True][0], out[False][0], atol=5e-5, rtol=0)
    assert (out[True][0] != 0).sum() == group_batch.completion_mask.sum()  # every real token scored, padding 0
    for g_shared, g_plain in zip(out[True][1], out[False][1]):
        if g_plain is None:
            assert g_shared is None
            continue
        assert float((g_shared - g_plain).norm() / g_plain.norm().clamp(min=1e-12)) < REL_TOL


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.slow
def test_token_chunked_logprobs_equal_the_whole_head_in_float64(arch, shared, group_batch, char_tokenizer):
    """The LM head over the real tokens only, a few at a time under checkpointing, against the head over every
    position at once: log-probs and gradients equal within 1e-10, in float64."""
    torch.manual_seed(0)
    model = ARCHS[arch](char_tokenizer).double().train()
    params = [p for p in model.parameters()]
    weights = torch.randn(group_batch.completion_ids.shape, dtype=torch.float64)
    out = {}
    for chunk in (0, 3):
        logp = completion_logprobs(model, group_batch, chunk_tokens=chunk, shared_prefix=shared)  # [N, T]
        out[chunk] = (logp, torch.autograd.grad((logp * weights).sum(), params, allow_unused=True))
    torch.testing.assert_close(out[3][0], out[0][0], rtol=0, atol=1e-10)
    assert (out[3][0] != 0).sum() == group_batch.completion_mask.sum() > 6  # every real token, more than 2 chunks
    for g_chunked, g_whole in zip(out[3][1], out[0][1]):
        if g_whole is None:
            assert g_chunked is None
            continue
        assert float((g_chunked - g_whole).norm()) <= 1e-10 * max(float(g_whole.norm()), 1e-30)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.slow
def test_packed_logprobs_and_gradients_equal_the_padded_ones_in_float64(arch, chunk, group_batch, char_tokenizer):
    """The rows' real tokens as one sequence without padding (position ids restarting per row) against the padded
    batch: log-probs and gradients equal within 1e-10, in float64; with the head whole and in chunks of 3 tokens."""
    torch.manual_seed(0)
    model = ARCHS[arch](char_tokenizer).double().train()
    params = [p for p in model.parameters()]
    weights = torch.randn(group_batch.completion_ids.shape, dtype=torch.float64)
    assert (group_batch.prompt_mask == 0).any() and (group_batch.completion_mask == 0).any()  # padding on both sides
    out = {}
    for packed in (False, True):
        logp = completion_logprobs(model, group_batch, chunk_tokens=chunk, packed=packed)  # [N, T]
        out[packed] = (logp, torch.autograd.grad((logp * weights).sum(), params, allow_unused=True))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-10)
    assert (out[True][0] != 0).sum() == group_batch.completion_mask.sum()  # every real token scored, padding 0
    for g_packed, g_padded in zip(out[True][1], out[False][1]):
        if g_padded is None:
            assert g_packed is None
            continue
        assert float((g_packed - g_padded).norm()) <= 1e-10 * max(float(g_padded.norm()), 1e-30)


def test_packing_runs_one_sequence_with_no_padding_token(group_batch, char_tokenizer):
    """What --packing gives the decoder: one row of the batch's real tokens, positions restarting at each rollout."""
    model = _builtin().train()
    seen = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    with torch.no_grad():
        completion_logprobs(model, group_batch, packed=True)
    hook.remove()
    (kw,) = seen
    lengths = (group_batch.prompt_mask.sum(1) + group_batch.completion_mask.sum(1)).tolist()
    assert kw["input_ids"].shape == (1, sum(lengths)) and kw.get("attention_mask") is None
    assert kw["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    assert (kw["input_ids"] != char_tokenizer.pad_token_id).all()


def test_shared_prefill_samples_the_same_tokens_as_one_prompt_at_a_time(char_tokenizer):
    from grpolab.models.policy import Policy

    pol = Policy(_builtin().eval(), char_tokenizer, "builtin")
    prompts = [pol.prompt_ids({"question": q}) for q in ("12+7", "3*45")]
    rows = [p for p in prompts for _ in range(4)]
    keys = [(6, i) for i in range(8)]
    kw = dict(max_new_tokens=20, temperature=1.0, top_p=1.0, eos_id=pol.eos_id, pad_id=pol.pad_id)
    together = sample(pol.model, rows, keys, **kw)  # two prefills, each copied to 4 rows
    for i in range(8):
        alone = sample(pol.model, [rows[i]], [keys[i]], **kw)
        n = int(alone.completion_mask.sum())
        assert int(together.completion_mask[i].sum()) == n
        assert torch.equal(together.completion_ids[i, :n], alone.completion_ids[0, :n])


def test_a_model_that_drops_the_cache_falls_back_with_a_notice(char_tokenizer):
    # GPT-2's decoder drops caches under activation checkpointing: the shared path cannot run.
    model = gpt2(len(char_tokenizer)).train()
    enable_activation_checkpointing(model)
    logs = []
    module = TrainModule(model, 1.0, shared_prefix=True, log=logs.append)
    assert not module.shared_prefix
    assert len(logs) == 1 and "GPT2LMHeadModel cannot take a shared prompt cache" in logs[0]
    # Qwen2's layers keep it (grpolab.models.shared_prefix marks them as safe to checkpoint with this cache): no fallback.
    qwen = qwen2(len(char_tokenizer)).train()
    enable_activation_checkpointing(qwen)
    logs = []
    assert TrainModule(qwen, 1.0, shared_prefix=True, log=logs.append).shared_prefix and not logs


def test_checkpointed_shared_path_gives_the_plain_gradients(group_batch, char_tokenizer):
    torch.manual_seed(0)
    plain, ckpt = qwen2(len(char_tokenizer)).train(), None
    ckpt = qwen2(len(char_tokenizer)).train()
    ckpt.load_state_dict(plain.state_dict())
    enable_activation_checkpointing(ckpt)
    grads = []
    for model, shared in ((plain, False), (ckpt, True)):
        logp = completion_logprobs(model, group_batch, shared_prefix=shared)
        grads.append(torch.autograd.grad(logp.sum(), list(model.parameters())))
    for a, b in zip(*grads):
        assert float((a - b).norm() / a.norm().clamp(min=1e-12)) < REL_TOL


# ---------------------------------------------------------------- device


def test_device_resolution():
    assert resolve_device("auto", cuda_count=0) == torch.device("cpu")
    assert resolve_device("cpu", cuda_count=2) == torch.device("cpu")
    assert resolve_device("auto", local_rank=1, cuda_count=2) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=1, cuda_count=2) == torch.device("cuda", 1)
    assert resolve_device("cuda:0", local_rank=1, cuda_count=2) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda", cuda_count=0)
    with pytest.raises(DeviceError, match="2 CUDA device"):
        resolve_device("cuda:3", cuda_count=2)
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.slow
def test_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^--device: cuda: torch sees no CUDA device"):
        TrainConfig(device="cuda").validate()
    res = run_cli(["train", "--device", "cuda", "--out", str(tmp_path / "r")], cwd=tmp_path)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [res.stderr.strip().splitlines()[-1]]  # one line, no traceback
    assert "--device" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------- training: on vs off


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, char_tokenizer):
    """The built-in model, and random GPT-2 and Qwen2 models with the built-in tokenizer, as local directories."""
    root = tmp_path_factory.mktemp("archs")
    dirs = {"llama": str(ASSET_DIR)}
    for name in ("gpt2", "qwen2"):
        torch.manual_seed(0)
        ids = dict(
            bos_token_id=char_tokenizer.bos_token_id,
            eos_token_id=char_tokenizer.eos_token_id,
            pad_token_id=char_tokenizer.pad_token_id,
        )
        model = (gpt2 if name == "gpt2" else qwen2)(len(char_tokenizer), **ids)
        model.save_pretrained(root / name)
        char_tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _run(out, model: str, **over) -> dict[str, torch.Tensor]:
    """Weights after 2 steps (the adapter's with --lora-rank), trained in float64.

    Why float64: AdamW's step is g / (|g| + eps), so an entry whose gradient is near zero (a zero-initialised LoRA
    B, Qwen2's key bias) moves by up to lr whatever its gradient's size, and fp32 rounding differences between two
    exact methods become weight differences of 1e-5..1e-4 relative in such tensors (measured). In float64 rounding
    is ~1e-16, so a difference above 1e-5 can only come from the method itself. The fp32 log-probs and gradients
    are compared directly in the unit tests above.
    """
    # odd_code_sum reward: nearly every group has reward variance, so the update is not zero; G = 3 and micro-batches of 4
    # rows split groups across micro-batches; beta > 0 runs the (shared) reference forward, mu = 2 the old log-probs.
    fields = dict(
        out=str(out),
        model=model,
        steps=2,
        prompts_per_step=4,
        group_size=3,
        max_new_tokens=24,
        eval_questions=4,
        eval_samples=1,
        warmup_steps=0,
        lr=1e-3,
        beta=0.04,
        mu=2,
        micro_batch=4,
        reward_fn="reward_fixtures:odd_code_sum",
        format_weight=0.0,
        device="cpu",
        progress=False,
        dtype="float64",
    )
    cfg = TrainConfig(**{**fields, **over})
    train(cfg, log=lambda *a: None)
    ckpt = out / "checkpoints" / "step_2"
    if cfg.policy.lora_rank:
        return load_file(ckpt / "adapter_model.safetensors")
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)) for k in a)


def _without_key_bias(state: dict) -> dict:
    """GPT-2's fused QKV bias without its key third. The key bias has no gradient in exact arithmetic (it adds
    q.b to every score of a query, and softmax ignores a shift), so each path's gradient there is float noise
    (~1e-10) that AdamW scales up to steps of ~lr/100: those entries would compare one noise with another."""
    out = dict(state)
    for k, v in state.items():
        if k.endswith("attn.c_attn.bias"):
            q, _, val = v.view(3, -1)
            out[k] = torch.cat([q, val])
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.slow
def test_two_steps_with_shared_prefix_or_packing_reach_the_padded_runs_parameters(arch, model_dirs, tmp_path):
    off = _without_key_bias(_run(tmp_path / "off", model_dirs[arch], shared_prefix="off"))
    on = _without_key_bias(_run(tmp_path / "on", model_dirs[arch], shared_prefix="on"))
    # packed passes planned by a token budget (1-3 rows each) instead of 4 rows each
    packed = _without_key_bias(
        _run(tmp_path / "pk", model_dirs[arch], packing=True, micro_batch=0, micro_batch_tokens=80)
    )
    start = _without_key_bias(AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float64).state_dict())
    assert _max_rel_diff(start, off) > 1e-4  # the runs trained: the comparison is not vacuous
    assert _max_rel_diff(off, on) < REL_TOL
    assert _max_rel_diff(off, packed) < REL_TOL


@pytest.mark.slow
def test_gradient_checkpointing_keeps_the_shared_update_exact(model_dirs, tmp_path):
    off = _run(tmp_path / "off", model_dirs["qwen2"], shared_prefix="off")
    ckpt = _run(tmp_path / "ckpt", model_dirs["qwen2"], shared_prefix="on", gradient_checkpointing=True)
    assert _max_rel_diff(off, ckpt) < REL_TOL


@pytest.mark.slow
def test_lora_adapters_train_the_same_with_shared_prefix_on_and_off(model_dirs, tmp_path):
    # the KL reference is the model with its adapter disabled: that forward shares the prompt too
    on = _run(tmp_path / "on", model_dirs["llama"], shared_prefix="on", lora_rank=4)
    off = _run(tmp_path / "off", model_dirs["llama"], shared_prefix="off", lora_rank=4)
    assert any(float(v.abs().max()) > 0 for k, v in off.items() if "lora_B" in k)  # B starts at 0: it moved
    assert _max_rel_diff(off, on) < REL_TOL
