"""Decode speed: milliseconds per new token of each decode loop, beside its own matrix products' time alone.

    python benchmarks/decode.py [--rows 8,64] [--lengths 128,512,1024] [--prompt 64] [--threads 2]
                                [--configs old,slab,new,new-bf16,vllm,vllm-bf16] [--compile] [--json FILE]

SmolLM2-135M-Instruct (``--model``): R rows of one ``--prompt``-token prompt (as a group's rollouts share theirs),
every row running to T new tokens (EOS cannot stop it), temperature 1, in this one process. A configuration's
figure at T is its time for a T-token completion divided by T, prefill included; the hf loops time one completion of
the longest T and read the shorter ones off the same run (its first T tokens: what a T-token run does). Configurations:

- ``old``: the loop as it was: transformers' DynamicCache (the whole cache copied at every token), the model's own
  forward on the live fp32 weights (``F.linear``).
- ``slab``: the cache allocated once and written in place (grpolab.models.decode_cache), the same forward and weights:
  the cache's effect alone.
- ``new``: grpolab's hf engine at ``--rollout-dtype float32``: the slab, the fused decode step
  (grpolab.models.fused_decode) on its own oneDNN-packed copy of the weights.
- ``new-bf16``: the same at ``--rollout-dtype bfloat16`` (keys and values cached, and attended, in fp32).
- ``vllm``, ``vllm-bf16``: the vllm rollout engine in this process (eager), fp32 and bf16.
- ``--compile``: also ``new`` and ``new-bf16`` with the fused step under ``torch.compile`` (dynamic shapes; the packed
  products are opaque operators to it), with the compilation's time: measured here, not a grpolab default.

Rooflines, measured in the same run on the same shapes: the decode step's weight products alone, at R rows, with each
loop's own kernels (``F.linear`` over the model's 211 matrices for ``old`` and ``slab``; the fused decoder's 121
packed products, fp32 and bf16, for ``new`` and ``new-bf16``); and, for scale, the attention kernel alone over 30
layers at the cache's mean length (P + T / 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HF_CONFIGS = ("old", "slab", "new", "new-bf16")
CONFIGS = (*HF_CONFIGS, "vllm", "vllm-bf16")
DTYPES = {"new": torch.float32, "new-bf16": torch.bfloat16, "vllm": torch.float32, "vllm-bf16": torch.bfloat16}


def _prompt(policy, length: int) -> list[int]:
    """A chat prompt of the task's kind, cut or padded with its own tokens to ``length``."""
    ids = policy.prompt_ids({"prompt": "Tom has 12 apples and buys 7 more. How many apples does he have now?"})
    return (ids * (length // len(ids) + 1))[-length:]


class Marks:
    """Wall time at every decode step of the hf sampler (its slab or growing cache), to read shorter runs off one."""

    def __init__(self):
        import grpolab.rollout.sampler as sampler

        self.times: list[float] = []
        self._patched = []
        for cls in (sampler._SlabDecode, sampler._DynamicDecode):
            step = cls.step

            def timed(decoder, model, tok, _step=step):
                out = _step(decoder, model, tok)
                self.times.append(time.perf_counter())
                return out

            self._patched.append((cls, step))
            cls.step = timed

    def close(self) -> None:
        for cls, step in self._patched:
            cls.step = step


def time_hf(name: str, policy, prompts, keys, lengths: list[int], compiled: bool) -> dict[int, float]:
    """ms per token at each T of ``lengths`` for hf configuration ``name``, from one completion of the longest."""
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings
    from grpolab.rollout.sampler import sample_with_stats

    T = max(lengths)
    if name in ("old", "slab"):
        cache = "dynamic" if name == "old" else "slab"

        def run(t):
            args = dict(max_new_tokens=t, temperature=1.0, top_p=1.0, eos_id=-1, pad_id=policy.pad_id)
            return sample_with_stats(policy.model.eval(), prompts, keys, cache=cache, **args)
    else:
        engine = HFEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id, DTYPES[name]))
        if compiled:
            t0 = time.perf_counter()
            compile_decoder(engine.weights.decoder, policy, prompts, keys)
            print(f"    {name}+compile: compiled in {time.perf_counter() - t0:.0f} s", flush=True)

        def run(t):
            return engine.generate(prompts, keys, SamplingSettings(t, 1.0, 1.0, ignore_eos=True))

    run(4)  # warm: first calls allocate and pick kernels
    marks = Marks()
    try:
        t0 = time.perf_counter()
        run(T)
        end = time.perf_counter()
    finally:
        marks.close()
    # step k (0-based) feeds token k and computes token k + 1's logits: a t-token run ends after step t - 2
    at = {t: (marks.times[t - 2] if t >= 2 else t0) for t in lengths if t < T}
    return {**{t: (at[t] - t0) / t * 1e3 for t in at}, T: (end - t0) / T * 1e3}


def time_vllm(name: str, policy, prompts, keys, lengths: list[int]) -> dict[int, float]:
    """ms per token at each T for the vllm engine in ``name``'s dtype: one run per T (its steps cannot be timed)."""
    from grpolab.rollout.engine import SamplingSettings
    from grpolab.rollout.spec import EngineSpec, VLLMSettings
    from grpolab.rollout.vllm_engine import VLLMEngine

    settings = VLLMSettings(max_model_len=len(prompts[0]) + max(lengths) + 8)
    engine = VLLMEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id, DTYPES[name], vllm=settings))
    engine.generate(prompts, keys, SamplingSettings(8, 1.0, 1.0, ignore_eos=True))
    out = {}
    for T in lengths:
        t0 = time.perf_counter()
        engine.generate(prompts, keys, SamplingSettings(T, 1.0, 1.0, ignore_eos=True))
        out[T] = (time.perf_counter() - t0) / T * 1e3
    return out


def _timed(fn, repeat: int = 10) -> float:
    """Median ms of ``fn()`` over ``repeat`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rooflines(policy, rows: int) -> dict[str, float]:
    """ms of the decode step's weight products alone at ``rows`` rows, with each loop's kernels."""
    from grpolab.rollout.weights import SamplerWeights

    out = {}
    linears = [m for m in policy.model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    with torch.no_grad():
        out["F.linear fp32"] = _timed(
            lambda: [torch.nn.functional.linear(xs[m.in_features], m.weight) for m in linears]
        )
        for label, dtype in (("packed fp32", torch.float32), ("packed bf16", torch.bfloat16)):
            dec = SamplerWeights(policy.model, dtype).decoder
            products = [p for layer in dec.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            products.append(dec.head)
            x = {n: torch.randn(rows, n, dtype=dtype) for n in {p.in_features for p in products}}
            out[label] = _timed(lambda: [p(x[p.in_features]) for p in products])  # noqa: B023
    return out


def attention_alone(policy, rows: int, length: int) -> float:
    """ms of 30 layers' attention at one decode step over ``length`` cached keys (fp32, grouped heads, a mask)."""
    c = policy.model.config
    H, Hk, d = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    kv = [
        (torch.randn(rows, Hk, length + 8, d)[:, :, :length], torch.randn(rows, Hk, length + 8, d)[:, :, :length])
        for _ in range(c.num_hidden_layers)
    ]  # views of larger buffers, one per layer (none stays in the CPU's caches), as the slab gives them
    q, mask = torch.randn(rows, H, 1, d), torch.ones(rows, 1, 1, length, dtype=torch.bool)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        return _timed(lambda: [sdpa(q, k, v, attn_mask=mask, enable_gqa=True) for k, v in kv], repeat=5)


_PRODUCTS: list = []  # the packed products the compiled steps call, by slot


def _opaque_op():
    """``grpolab_bench::packed(x, slot, out_features)``: product ``slot`` of :data:`_PRODUCTS`, an operator
    torch.compile calls without looking inside (registered once per process)."""
    if hasattr(torch.ops.grpolab_bench, "packed"):
        return torch.ops.grpolab_bench.packed

    @torch.library.custom_op("grpolab_bench::packed", mutates_args=())
    def packed(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
        return _PRODUCTS[slot](x)

    @packed.register_fake
    def _(x, slot, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    return packed


def compile_decoder(decoder, policy, prompts, keys) -> None:
    """Puts ``decoder``'s step under ``torch.compile``: its packed products become opaque operators (inductor cannot
    take oneDNN's packed tensors), the step reads the cache as views passed in (so the growing length is a dynamic
    shape, not a constant to recompile for). Compiles on a short completion."""
    import grpolab.rollout.sampler as sampler

    packed = _opaque_op()

    def opaque(product):
        _PRODUCTS.append(product)
        slot, n = len(_PRODUCTS) - 1, product.out_features
        return lambda x: packed(x, slot, n)

    fused = [(opaque(x.qkv), opaque(x.o), opaque(x.gate_up), opaque(x.down), x) for x in decoder.layers]
    head = opaque(decoder.head)
    H, Hk, d, inter = decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.intermediate
    grouped = bool(Hk < H)  # a constant: under dynamic shapes the comparison would be a symbolic bool

    def step(tok, position, mask, keys_, values_):
        from grpolab.models.fused_decode import _rotate

        n = tok.shape[0]
        h = decoder.embed(tok)
        cos, sin = decoder.rotary(h, position[:, None])
        keep = mask.bool()[:, None, None, :]
        for (qkv_, o_, gate_up_, down_, layer), k_all, v_all in zip(fused, keys_, values_):
            qkv = qkv_(layer.norm_in(h))
            q = _rotate(qkv[:, : H * d].view(n, H, 1, d), cos, sin)
            k_all[:, :, -1:].copy_(_rotate(qkv[:, H * d : (H + Hk) * d].view(n, Hk, 1, d), cos, sin))
            v_all[:, :, -1:].copy_(qkv[:, (H + Hk) * d :].view(n, Hk, 1, d))
            out = torch.nn.functional.scaled_dot_product_attention(
                q.to(k_all.dtype), k_all, v_all, attn_mask=keep, enable_gqa=grouped
            )
            h = h + o_(out.view(n, H * d).to(h.dtype))
            gu = gate_up_(layer.norm_post(h))
            h = h + down_(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])
        return head(decoder.norm(h))

    compiled = torch.compile(step, dynamic=True)

    def decoder_step(tok, position, mask, cache):
        L = cache.get_seq_length()
        n = tok.shape[0]
        ks = [layer.buffer_k[:n, :, : L + 1] for layer in cache.layers]
        vs = [layer.buffer_v[:n, :, : L + 1] for layer in cache.layers]
        out = compiled(tok, position, mask, ks, vs)
        for layer in cache.layers:
            layer.length = L + 1
        return out

    decoder.step = decoder_step
    args = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, eos_id=-1, pad_id=policy.pad_id)
    sampler.sample(policy.model, prompts, keys, decoder=decoder, **args)  # compiles (first sizes, then dynamic)
    sampler.sample(policy.model, prompts, keys, decoder=decoder, **args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", default="8,64", help="rows decoded together (comma-separated)")
    p.add_argument("--lengths", default="128,512,1024", help="new tokens per completion, T (comma-separated)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)}")
    p.add_argument("--compile", action="store_true", help="also time new/new-bf16 with the step under torch.compile")
    p.add_argument("--json", default="", help="write every figure here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from grpolab.models.policy import load_policy

    policy = load_policy(args.model)
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    lengths = sorted(int(t) for t in args.lengths.split(","))
    results: dict = {"machine": f"{os.cpu_count()} CPUs, {args.threads} threads, torch {torch.__version__}"}
    for rows in (int(r) for r in args.rows.split(",")):
        prompts, keys = [_prompt(policy, args.prompt)] * rows, [(0, 0, 0, i) for i in range(rows)]
        per: dict[str, dict[int, float]] = {}
        for name in configs + ([f"{c}+compile" for c in ("new", "new-bf16") if c in configs] if args.compile else []):
            base = name.removesuffix("+compile")
            if base in HF_CONFIGS:
                per[name] = time_hf(base, policy, prompts, keys, lengths, name.endswith("+compile"))
            else:
                per[name] = time_vllm(name, policy, prompts, keys, lengths)
            print(
                f"rows={rows} {name:<17}" + "".join(f"  T={T}: {ms:7.1f} ms" for T, ms in per[name].items()), flush=True
            )
        roof = rooflines(policy, rows)
        attn = {T: attention_alone(policy, rows, args.prompt + T // 2) for T in lengths}
        results[str(rows)] = {"ms_per_token": per, "rooflines_ms": roof, "attention_ms": attn}
        print_table(rows, lengths, per, roof, attn)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


ROOF = {"old": "F.linear fp32", "slab": "F.linear fp32", "new": "packed fp32", "new-bf16": "packed bf16"}


def print_table(rows: int, lengths: list[int], per: dict, roof: dict, attn: dict) -> None:
    """One markdown table per row count: ms/token, the old loop's over it, and over its matmul roofline."""
    print(f"\nrows = {rows}; weight products alone: " + ", ".join(f"{k} {v:.1f} ms" for k, v in roof.items()))
    print(
        "attention alone over 30 layers at the mean cache length: "
        + ", ".join(f"T={T}: {v:.1f} ms" for T, v in attn.items())
    )
    head = "| configuration | " + " | ".join(f"T={T} ms/token | old / this | this / roofline" for T in lengths) + " |"
    print(head)
    print("|" + " --- |" * (1 + 3 * len(lengths)))
    for name, by_T in per.items():
        cells = []
        for T in lengths:
            ms = by_T.get(T)
            old = per.get("old", {}).get(T)
            r = roof.get(ROOF.get(name.removesuffix("+compile"), ""))
            cells += [f"{ms:.1f}", f"{old / ms:.2f}x" if old else "-", f"{ms / r:.2f}x" if r else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(flush=True)


if __name__ == "__main__":
    main()
