"""Decode speed on a GPU: grpolab's sampler against transformers' ``generate``, at a real model's shapes.

    python benchmarks/decode_gpu.py [--config qwen2.5-0.5b] [--rows 8,64] [--length 512] [--prompt 64]
                                    [--dtype bfloat16] [--configs generate,generate-static,grpolab,grpolab-fused,
                                    grpolab-fused-compile] [--budget 120] [--json FILE]

A model of ``--config``'s shapes with random weights (Qwen2.5-0.5B's: 24 layers, hidden 896, 14 query and 2 key/value
heads, vocabulary 151,936; no download), in ``--dtype`` on the first CUDA device; R rows of one ``--prompt``-token
prompt, every row running to T new tokens (EOS cannot stop it), temperature 1. Milliseconds per new token, prefill
included, after one warm-up completion (``--warmup-length`` tokens), and peak GPU memory:

- ``generate``: ``model.generate`` (transformers' DynamicCache; what TRL's GRPOTrainer calls);
- ``generate-static``: the same with ``cache_implementation="static"`` (transformers compiles its forward for a
  static cache where it can: CUDA graphs);
- ``grpolab``: grpolab's hf engine in the model's dtype: the decode cache written in place, the model's own forward;
- ``grpolab-fused``: grpolab's sampler on its own copy of the weights with the fused decode step (one product for
  q, k, v and one for gate and up);
- ``grpolab-fused-compile``: the fused step under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); the cache
  length grows every token, so this measures what CUDA graphs do with a shape that changes at every step.

A configuration whose warm-up alone takes more than ``--budget`` seconds is reported as such and skipped. Each
configuration prints one line as it ends; what failed prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIGS = ("generate", "generate-static", "grpolab", "grpolab-fused", "grpolab-fused-compile")
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
}


def build(config: str, dtype: torch.dtype, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[config], attn_implementation="sdpa", eos_token_id=0, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def runner(name: str, model, prompts: list[list[int]]):
    """A function ``T -> None`` that generates T new tokens for every row with configuration ``name``."""
    device = next(model.parameters()).device
    rows = len(prompts)
    if name.startswith("generate"):
        ids = torch.tensor(prompts, device=device)
        extra = {"cache_implementation": "static"} if name == "generate-static" else {}

        def run(T):
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=T,
                min_new_tokens=T,
                pad_token_id=0,
                **extra,
            )

        return run
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings
    from grpolab.rollout.sampler import sample_with_stats
    from grpolab.rollout.weights import SamplerWeights

    keys = [(0, 1, 0, i) for i in range(rows)]
    if name == "grpolab":
        engine = HFEngine(model, EngineSpec(0, 0, next(model.parameters()).dtype))

        def run(T):
            engine.generate(prompts, keys, SamplingSettings(T, 1.0, 1.0, ignore_eos=True))

        return run
    weights = SamplerWeights(model, next(model.parameters()).dtype, always_copy=True)
    if weights.decoder is None:
        raise RuntimeError(f"no fused decoder: {weights.note}")
    decoder = weights.decoder
    if name == "grpolab-fused-compile":
        decoder.step = torch.compile(decoder.step, mode="reduce-overhead", dynamic=True)

    def run(T):
        sample_with_stats(
            weights.model, prompts, keys, max_new_tokens=T, temperature=1.0, top_p=1.0, eos_id=-1, pad_id=0,
            decoder=decoder,
        )  # fmt: skip

    return run


def timed(fn, device: torch.device | None = None) -> float:
    """Seconds ``fn()`` takes on ``device`` (default CUDA; there its queued work is included)."""
    sync = torch.cuda.synchronize if device is None or device.type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="8,64")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--budget", type=float, default=120.0, help="seconds a configuration's warm-up may take")
    p.add_argument(
        "--warmup-length",
        type=int,
        default=16,
        help="new tokens of the warm-up completion (--length: a compiled configuration meets the timed shapes first)",
    )
    p.add_argument("--json", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gpu.py needs a CUDA device (benchmarks/decode.py is the CPU's benchmark)")
    device = torch.device("cuda")
    from grpolab.common.devices import prepare_device

    prepare_device(device)
    model = build(args.config, getattr(torch, args.dtype), device)
    import transformers

    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.config} random weights in "
          f"{args.dtype}, {sum(x.numel() for x in model.parameters()) / 1e6:.0f} M parameters", flush=True)  # fmt: skip
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "args": vars(args),
               "transformers": transformers.__version__}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        prompt = torch.randint(100, 30000, (args.prompt,), generator=g).tolist()
        prompts = [prompt] * rows
        for name in args.configs.split(","):
            try:
                run = runner(name, model, prompts)
                warm = timed(lambda: run(args.warmup_length))  # noqa: B023
                if warm > args.budget:
                    print(f"rows={rows} {name:<22} warm-up took {warm:.0f} s: skipped", flush=True)
                    results[f"{rows}/{name}"] = {"warmup_s": warm, "skipped": True}
                    continue
                torch.cuda.reset_peak_memory_stats(device)
                seconds = timed(lambda: run(args.length))  # noqa: B023
                ms = seconds / args.length * 1e3
                peak = torch.cuda.max_memory_allocated(device) / 2**20
                results[f"{rows}/{name}"] = {"ms_per_token": ms, "warmup_s": warm, "peak_mib": peak}
                print(f"rows={rows} {name:<22} T={args.length}: {ms:7.2f} ms/token  (warm-up {warm:.1f} s, "
                      f"peak {peak:,.0f} MiB)", flush=True)  # fmt: skip
            except Exception as e:  # a configuration that cannot run here: say why, go on
                print(f"rows={rows} {name:<22} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                traceback.print_exc(limit=3)
                results[f"{rows}/{name}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
