"""Every CUDA path of grpolab, a few steps each, in one command: what holds on this GPU, with a figure each.

    tools/gpu-check [--cpu] [--only NAMES] [--skip NAMES] [--json FILE] [--work DIR] [--budget SECONDS]
    make gpu-check ARGS="--cpu"

Made for a GPU lent for minutes: nothing to write on the day, one line per check as it ends (passed, failed with
the error's first line, or skipped with why), every figure in a JSON file ($OUT/gpu-check.json when $OUT is set,
the device machine's output folder; else --json), written after each check. The models are random, so nothing is
downloaded: a model of Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 query and 2 key/value heads, vocabulary
151,936) over a character tokenizer padded to its vocabulary, a Qwen2.5-VL of 3B's shapes, and the built-in models.
With --cpu the same checks run on the CPU, the Qwen models at a few layers of width 64 and a vocabulary of 1,024: the
suite runs it, so a broken check is found before a GPU comes. On CUDA the checks not started within --budget
seconds (420) are skipped, said so, so that the run ends inside a device's time.

The checks, in the order they run (the processes of `distributed` and `workers` start first and run beside the
next ones; the last three time things or fill the GPU, so they run after those processes have ended, alone):

  checkpoint   the built-in model under bf16-mixed: 4 steps, against 2 steps + --resume to 4; metrics, rollouts
               and weights bit for bit (torch's deterministic algorithms on; the ops without one are listed)
  rewards      a reward model (random, sequence classification) and a local LLM judge (the built-in model) as
               reward components on the device, 2 steps; the reward model's scores on the device against the CPU's
  vision       the built-in vision-language model on the shapes task, 3 steps of bf16-mixed
  vllm         the vllm engine (skipped when vllm is not installed): 2 steps of the built-in model, the weight sync
               (the engine's log-probs against the trainer's after each step) and the mismatch (engine/*)
  distributed  DDP and FSDP2 (fp32) and FSDP2 (bf16-mixed) on 2 processes sharing one GPU (NCCL, else gloo for CUDA
               tensors, said which) against 1 process: the same rollouts, the weights' largest relative difference
  workers      a generator worker process (`grpolab generator`) and its trainer on the one device, 2 steps: the same
               rollouts and weights as the inline run
  precisions   the Qwen model, 3 steps (--cpu: 2) at lr 1e-6 in each precision (32-true, bf16-mixed, 16-mixed,
               bf16-true with Kahan summation and without): the share of weights with a gradient whose exact value
               moved, step time, peak memory, the fp16 scaler's skipped steps
  decode       the hf engine's decode ms/token at 8 rows for T = 512 (--cpu: 16) on the Qwen model in bf16 (--cpu:
               fp32), beside transformers' generate with the static cache (compiled on CUDA: CUDA graphs)
  qwen-vl      the random Qwen2.5-VL (3.75 B parameters; --cpu: tiny), 3 steps of bf16-mixed on 224-pixel pictures
               (--cpu: 56), grpolab's QwenProcessor; its peak memory

Exit status: 0 when no check failed (skipped ones included), 1 otherwise, 2 when there is no CUDA device and --cpu
was not given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

# cuBLAS is deterministic only with a workspace set before CUDA starts (the checkpoint check asks for determinism)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ORDER = ("checkpoint", "rewards", "vision", "vllm", "distributed", "workers", "precisions", "decode", "qwen-vl")
TIMED = ("precisions", "decode", "qwen-vl")
"""Checks that time things or fill the GPU: they run after the background processes have ended."""
BACKGROUND = ("distributed", "workers")
PAIRS = {"ddp": ("32-true", []), "fsdp": ("32-true", ["--fsdp"]), "fsdp-mixed": ("bf16-mixed", ["--fsdp"])}
"""The distributed check's runs on 2 processes: (precision, options), each against 1 process in that precision."""
QWEN_CPU = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, vocab_size=1024)  # fmt: skip
"""--cpu: the Qwen model at these sizes (its layout kept; a vocabulary of 1,024, where 151,936 made each step 1.7 s)."""
PRECISIONS = (("32-true", "kahan"), ("bf16-mixed", "kahan"), ("16-mixed", "kahan"), ("bf16-true", "kahan"),
              ("bf16-true", "none"))  # fmt: skip


class Skip(Exception):
    """A check (or part of one) that cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    device: torch.device
    cpu: bool
    work: Path

    @property
    def dev(self) -> str:
        return "cpu" if self.cpu else "cuda:0"

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None


def quiet(*args, **kwargs) -> None:
    """A ``log`` that says nothing: the check's line says what matters."""


# ---------------------------------------------------------------- models, data and a reward


def qwen_shape(cpu: bool) -> dict:
    from benchmarks.decode_gpu import SHAPES

    return SHAPES["qwen2.5-0.5b"] | (QWEN_CPU if cpu else {})


_TOKENIZERS: dict[tuple, object] = {}


def padded_tokenizer(vocab: int, specials: tuple[str, ...] = ()):
    """The built-in character tokenizer with ``specials`` (matched whole) and filler tokens up to ``vocab`` entries,
    so every id the model can sample decodes (a filler decodes to ``<n>``)."""
    if (vocab, specials) not in _TOKENIZERS:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        from grpolab.models.builtin import CHARACTERS, SPECIAL_TOKENS

        tokens = list(SPECIAL_TOKENS + CHARACTERS + specials)
        tokens += [f"<{i}>" for i in range(vocab - len(tokens))]
        tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        _TOKENIZERS[vocab, specials] = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
            unk_token="<unk>",
            additional_special_tokens=list(specials),
        )
    return _TOKENIZERS[vocab, specials]


def qwen(ctx: Context, seed: int = 0):
    """``(model, tokenizer)``: the Qwen2.5-0.5B-shaped model (--cpu: :data:`QWEN_CPU`), random, fp32, on the device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = qwen_shape(ctx.cpu)
    tok = padded_tokenizer(shape["vocab_size"])
    config = Qwen2Config(**shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    with ctx.device:  # initialised where it runs: seconds on a GPU for 0.5 B weights
        model = Qwen2ForCausalLM(config)
    return model, tok


ROWS = [{"prompt": f"Write some digits, {i}:"} for i in range(64)]
"""Prompts for the random models; :func:`digit_share` scores their completions."""


def digit_share(completions, **columns) -> list[float]:
    """The share of a completion's characters that are digits: random models' completions differ in it, so every
    group has reward variance and a gradient."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # chat runs: the messages
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def check_learning_signal(metrics: list[dict]) -> None:
    """Every step scored without a reward error and had rollouts with an advantage: else the check measured nothing."""
    errors = sum(m.get("reward/errors") or 0 for m in metrics)
    active = [m.get("loss/active_frac") or 0 for m in metrics]
    if errors or not all(active):
        raise AssertionError(f"the run had no learning signal: {errors} reward errors, active shares {active}")


def run_args(ctx: Context, out: Path, steps: int, *extra: str, precision: str = "32-true") -> list[str]:
    """``grpolab train`` of the built-in model for ``steps`` steps on the device in ``precision``, into ``out``."""
    return [
        "train", "--out", str(out), "--steps", str(steps), "--device", ctx.dev, "--prompts-per-step", "4",
        "--group-size", "4", "--max-new-tokens", "24", "--eval-questions", "8", "--eval-samples", "0",
        "--warmup-steps", "0", "--threads", "1", "--log-rollouts", "--no-progress", "--doctor", "off",
        "--precision", precision, *extra,
    ]  # fmt: skip


class Recorder:
    """Run hooks (``grpolab.training.recipe.RunHooks``) that keep the recipe and each step's metrics, and call
    ``on_begin(trainer)`` / ``on_step(trainer, step, metrics)``."""

    def __init__(self, on_begin: Callable | None = None, on_step: Callable | None = None):
        from grpolab.training.recipe import RunHooks

        recorder = self

        class Hooks(RunHooks):
            def begin(self, recipe):
                recorder.trainer = recipe.trainer
                if on_begin is not None:
                    on_begin(recipe.trainer)

            def step_end(self, step, metrics, saved):
                recorder.metrics.append(dict(metrics))
                if on_step is not None:
                    on_step(recorder.trainer, step, metrics)
                return False

        self.trainer = None
        self.metrics: list[dict] = []
        self.hooks = Hooks()


def train_qwen(ctx: Context, out: Path, model, tok, steps: int, hooks=None, **options):
    import grpolab

    fields = dict(train_dataset=ROWS, reward_funcs=[digit_share], eval_fraction=0, chat="off", prompts_per_step=4,
                  group_size=4, max_new_tokens=16 if ctx.cpu else 64, warmup_steps=0, progress=False, doctor="off",
                  device=ctx.dev, seed=0, save_every=0)  # fmt: skip
    return grpolab.train(model=model, tokenizer=tok, out=str(out), steps=steps, log=quiet, hooks=hooks,
                         **(fields | options))  # fmt: skip


# ---------------------------------------------------------------- comparing runs


def metric_rows(run: Path) -> list[dict]:
    from grpolab.training.runlog import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run / "metrics.jsonl")]


def train_rows(run: Path) -> list[dict]:
    """:func:`metric_rows` without the evaluations, but for the last step's."""
    rows = metric_rows(run)
    return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rows[:-1]] + rows[-1:]


def rollouts(run: Path) -> list[dict]:
    path = run / "rollouts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def last_weights(run: Path) -> dict[str, torch.Tensor]:
    """The weights of ``run``'s newest checkpoint (verified against its manifest)."""
    from grpolab.models.checkpoint import load_tensors, newest_intact

    return load_tensors(newest_intact(run)[1], "model.safetensors")


def weight_difference(a: Path, b: Path) -> float:
    """The largest relative difference ``|wa - wb| / |wa|`` (norms per tensor) of two runs' last weights."""
    wa, wb = last_weights(a), last_weights(b)
    if wa.keys() != wb.keys():
        raise AssertionError(f"the checkpoints hold different tensors: {sorted(wa.keys() ^ wb.keys())[:3]}")
    return max(float((wa[k].float() - wb[k].float()).norm() / wa[k].float().norm().clamp_min(1e-30)) for k in wa)


def metric_difference(a: Path, b: Path) -> float:
    """The largest relative difference of two runs' logged metrics (times and the engine's float noise aside)."""
    worst = 0.0
    for x, y in zip(metric_rows(a), metric_rows(b), strict=True):
        for k, v in x.items():
            if k.startswith(("engine/", "credit/")) or not isinstance(v, int | float) or y.get(k) is None:
                continue
            worst = max(worst, abs(y[k] - v) / max(abs(v), 1e-6))
    return worst


# ---------------------------------------------------------------- the checks


def check_checkpoint(ctx: Context) -> dict:
    """4 steps straight against 2 steps and a resume to 4: equal metrics, rollouts and weights."""
    import grpolab

    options = dict(model="builtin", device=ctx.dev, precision="bf16-mixed", prompts_per_step=4, group_size=4,
                   max_new_tokens=24, eval_questions=8, eval_samples=0, warmup_steps=0, threads=1,
                   log_rollouts=True, progress=False, doctor="off", save_every=2, seed=0, log=quiet)  # fmt: skip
    ops: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            t0 = time.perf_counter()
            straight = grpolab.train(steps=4, out=str(ctx.work / "ckpt-straight"), **options).dir
            seconds = time.perf_counter() - t0
            grpolab.train(steps=2, out=str(ctx.work / "ckpt-resumed"), **options)
            resumed = grpolab.train(steps=4, resume=True, out=str(ctx.work / "ckpt-resumed"), **options).dir
        finally:
            torch.use_deterministic_algorithms(False)
    for w in caught:
        text = str(w.message)
        if "deterministic" in text:
            ops.add(text.split(" does not have")[0][:120])
    # the 2-step run evaluated at its last step, which the straight run did not: evaluations compare at step 4
    same_metrics = train_rows(straight) == train_rows(resumed)
    drawn = rollouts(straight)
    same_rollouts = drawn == rollouts(resumed)
    wa, wb = last_weights(straight), last_weights(resumed)
    same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    figures = dict(same_metrics=same_metrics, same_rollouts=same_rollouts, same_weights=same_weights,
                   rollouts=len(drawn), tensors=len(wa), straight_run_s=seconds,
                   nondeterministic_ops=sorted(ops))  # fmt: skip
    if not (same_metrics and same_rollouts and same_weights):
        diff = weight_difference(straight, resumed)
        raise AssertionError(f"the resumed run differs: metrics {same_metrics}, rollouts {same_rollouts}, weights "
                             f"{same_weights} (largest relative difference {diff:.2e}); ops without a deterministic "
                             f"algorithm: {sorted(ops) or 'none'}")  # fmt: skip
    return figures


def check_rewards(ctx: Context) -> dict:
    """A reward model and a local judge as reward components on the device; the reward model's scores there
    against the CPU's in fp32."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    import grpolab
    from grpolab.models.builtin import build_char_tokenizer
    from grpolab.rewards.model import RewardModelSettings, load_reward_model

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=2, num_labels=1,
                                                    pad_token_id=tok.pad_token_id))  # fmt: skip
    rm_dir = ctx.work / "reward-model"
    rm.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    judge = ctx.work / "judge.txt"
    judge.write_text("Is {{ completion }} the answer to {{ prompt }}? Answer yes or no.\n")
    rec = Recorder()
    t0 = time.perf_counter()
    grpolab.train(model="builtin", steps=2, device=ctx.dev, reward_model=(str(rm_dir),), judge=str(judge),
                  judge_model="builtin", prompts_per_step=4, group_size=4, eval_questions=8, eval_samples=0,
                  warmup_steps=0, threads=1, progress=False, doctor="off", out=str(ctx.work / "rewards"), log=quiet,
                  hooks=rec.hooks)  # fmt: skip
    seconds = time.perf_counter() - t0
    last = rec.metrics[-1]
    components = {k: last.get(k) for k in ("reward/reward-model", "reward/judge", "reward/mean")}
    if not all(map(_finite, components.values())):
        raise AssertionError(f"the reward components are not all finite: {components}")
    # the device's scores in fp32 against the CPU's (the rule), and in the run's own dtype (bf16 on CUDA; a figure)
    texts = [f"{a} + {b} = {a + b}" for a in range(4) for b in range(4)]
    scores, placed = {}, {}
    for name, device, dtype in (("here", ctx.device, "auto"), ("here32", ctx.device, "float32"),
                                ("cpu", torch.device("cpu"), "float32")):  # fmt: skip
        model = load_reward_model(str(rm_dir), RewardModelSettings(device, dtype), lambda r: "", chat=False)
        scores[name] = model.score_texts(texts).float().cpu()
        placed[name] = str(next(model.model.parameters()).device), str(next(model.model.parameters()).dtype)
    gap32 = float((scores["here32"] - scores["cpu"]).abs().max())
    gap = float((scores["here"] - scores["cpu"]).abs().max())
    spread = float(scores["cpu"].std())
    if not gap32 <= max(1e-3 * spread, 1e-5):
        raise AssertionError(f"the reward model in fp32 on {placed['here32'][0]} scores {gap32:.3g} away from the "
                             f"CPU's (spread {spread:.3g})")  # fmt: skip
    return dict(components=components, judge_requests=last.get("reward/judge_requests"), run_s=seconds,
                reward_model_device=placed["here"][0], reward_model_dtype=placed["here"][1],
                score_gap_vs_cpu_fp32=gap, score_gap_fp32_vs_cpu_fp32=gap32, score_spread=spread)  # fmt: skip


def check_vision(ctx: Context) -> dict:
    """The built-in vision-language model on the shapes task: 3 steps of bf16-mixed."""
    import grpolab
    from grpolab.commands.demo import SHAPES_PRESET
    from grpolab.data.shapes import write_task

    train, test = write_task(ctx.work / "shapes", train=64, held_out=8)
    preset = SHAPES_PRESET | dict(steps=3, eval_questions=8, eval_samples=0, prompts_per_step=4, eval_every=0,
                                  threads=1)  # fmt: skip
    rec = Recorder()
    ctx.reset_peak()
    t0 = time.perf_counter()
    grpolab.train(model="builtin-vlm", data=str(train), eval_data=str(test), device=ctx.dev, precision="bf16-mixed",
                  progress=False, doctor="off", out=str(ctx.work / "vision"), log=quiet, hooks=rec.hooks,
                  **preset)  # fmt: skip
    seconds = time.perf_counter() - t0
    losses = [m["loss/total"] for m in rec.metrics]
    if len(losses) != 3 or not all(map(_finite, losses)):
        raise AssertionError(f"3 finite losses expected, got {losses}")
    return dict(steps=len(losses), loss=losses, reward_mean=[m["reward/mean"] for m in rec.metrics],
                step_s=[m["time/step_s"] for m in rec.metrics], run_s=seconds, peak_gib=ctx.peak_gib())  # fmt: skip


QWEN_VL_3B = dict(
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                fullatt_block_indexes=[7, 15, 23, 31]),
    mrope_section=[16, 24, 24],
    pixels=224,
)  # fmt: skip
"""Qwen2.5-VL-3B-Instruct's shapes (its config's values; the vision tower's window attention of 112 pixels)."""
QWEN_VL_CPU = dict(
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=4096, tie_word_embeddings=True),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                fullatt_block_indexes=[1]),
    mrope_section=[2, 3, 3],
    pixels=56,
)  # fmt: skip
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
)
"""A plain chat template for the random Qwen2.5-VL: each image part is Qwen's placeholder, a turn ends in a newline."""


def qwen_vl(ctx: Context):
    """``(model, processor, pixels)``: a random Qwen2.5-VL of :data:`QWEN_VL_3B`'s shapes (--cpu:
    :data:`QWEN_VL_CPU`'s) on the device, fp32, and grpolab's QwenProcessor over the padded character tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from grpolab.vision.processing import QwenProcessor

    shape = QWEN_VL_CPU if ctx.cpu else QWEN_VL_3B
    tok = padded_tokenizer(1024 if ctx.cpu else 151936, QWEN_VL_TOKENS)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(("start", "end", "image", "video"), QWEN_VL_TOKENS)}
    rope = {"rope_type": "default", "mrope_section": shape["mrope_section"], "rope_theta": 1000000.0}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), rope_parameters=rope, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape["text"]),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           **shape["vision"]),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
    )  # fmt: skip
    torch.manual_seed(0)
    with ctx.device:
        model = Qwen2_5_VLForConditionalGeneration(config)
    side = shape["pixels"]
    try:  # transformers' PIL image processor needs no torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Images
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Images
    images = Images(min_pixels=side * side, max_pixels=side * side)
    return model, QwenProcessor(images, tok, CHAT), side


def check_qwen_vl(ctx: Context) -> dict:
    """A random Qwen2.5-VL (3B's shapes; --cpu: tiny), 3 steps of bf16-mixed on pictures of one colour each."""
    from PIL import Image

    model, processor, side = qwen_vl(ctx)
    params = sum(p.numel() for p in model.parameters())
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Digits {i}:"}]}],
         "image": Image.new("RGB", (side, side), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256))}
        for i in range(32)
    ]  # fmt: skip
    rec = Recorder()
    ctx.reset_peak()
    t0 = time.perf_counter()
    train_qwen(ctx, ctx.work / "qwen-vl", model, processor, 3, rec.hooks, train_dataset=rows, chat="auto",
               precision="bf16-mixed", lr=1e-6)  # fmt: skip
    seconds = time.perf_counter() - t0
    losses = [m["loss/total"] for m in rec.metrics]
    if len(losses) != 3 or not all(map(_finite, losses)):
        raise AssertionError(f"3 finite losses expected, got {losses}")
    check_learning_signal(rec.metrics)
    return dict(parameters=params, pixels=side, steps=len(losses), loss=losses, step_s=[m["time/step_s"] for m in
                rec.metrics], run_s=seconds, peak_gib=ctx.peak_gib())  # fmt: skip


def check_vllm(ctx: Context) -> dict:
    """The vllm engine: 2 steps, its log-probs against the trainer's after each (the weight sync), engine/*."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed")
    import grpolab
    from grpolab.models.logprobs import completion_logprobs

    held: dict = {}
    gaps: list[float] = []

    def fixed_tokens(trainer):
        held["batch"] = trainer.collector.collect(0).groups.rows.batch
        with torch.no_grad():
            held["start"] = completion_logprobs(trainer.policy.model, held["batch"], 1.0)

    def compare(trainer, step, metrics):
        batch = held["batch"]
        with torch.no_grad():
            expected = completion_logprobs(trainer.policy.model, batch, 1.0)
        mask = batch.completion_mask.bool()
        gaps.append(float((trainer.engine.score(batch) - expected)[mask].abs().max()))
        held["moved"] = float((expected - held["start"])[mask].abs().max())

    rec = Recorder(fixed_tokens, compare)
    t0 = time.perf_counter()
    grpolab.train(model="builtin", steps=2, device=ctx.dev, rollout_engine="vllm", precision="32-true", lr=2e-3,
                  prompts_per_step=4, group_size=4, eval_questions=8, eval_samples=0, warmup_steps=0, threads=1,
                  progress=False, doctor="off", out=str(ctx.work / "vllm"), log=quiet, hooks=rec.hooks)  # fmt: skip
    seconds = time.perf_counter() - t0
    engine = {k: v for k, v in rec.metrics[-1].items() if k.startswith("engine/")}
    sync = [m.get("time/sync_s") for m in rec.metrics]
    if not max(gaps) < held["moved"] / 10:
        raise AssertionError(f"the engine's log-probs are {max(gaps):.3g} from the trainer's after a step that moved "
                             f"them {held['moved']:.3g}: the weights did not reach it")  # fmt: skip
    return dict(sync_gap_per_step=gaps, moved_by_the_steps=held["moved"], sync_s=sync, mismatch=engine, run_s=seconds)


def check_precisions(ctx: Context) -> dict:
    """The Qwen model, 3 steps (--cpu: 2) at lr 1e-6 in each precision: the share of the weights with a nonzero
    gradient whose exact value (Kahan: weight + compensation) moved, the step time, the peak memory, the fp16
    scaler's skips."""
    from grpolab.common.precision import PrecisionError
    from grpolab.training.optim import exact_weights

    out: dict = {}
    for name, comp in PRECISIONS:
        key = name if name != "bf16-true" else f"bf16-true/{comp}"
        model, tok = qwen(ctx)
        held: dict = {}

        def begin(trainer, held=held):
            params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
            held["params"], held["opt"] = params, trainer.optimizer
            held["before"] = [exact_weights(trainer.optimizer, p).clone() for p in params]
            held["grad"] = [torch.zeros(p.numel(), dtype=torch.bool, device=p.device) for p in params]
            for p, mask in zip(params, held["grad"]):
                p.register_post_accumulate_grad_hook(functools.partial(mark_gradient, mask))
            ctx.reset_peak()

        rec = Recorder(begin)
        try:
            steps = 2 if ctx.cpu else 3
            train_qwen(ctx, ctx.work / f"precision-{key.replace('/', '-')}", model, tok, steps, rec.hooks, lr=1e-6,
                       precision=name, compensation=comp)  # fmt: skip
        except PrecisionError as e:
            out[key] = {"skipped": str(e).splitlines()[0]}
            continue
        check_learning_signal(rec.metrics)
        after = [exact_weights(held["opt"], p) for p in held["params"]]
        moved = sum(int(((a != b) & g).sum()) for a, b, g in zip(after, held["before"], held["grad"]))
        counted = sum(int(g.sum()) for g in held["grad"])
        steps = rec.metrics
        out[key] = dict(
            moved_share=moved / max(counted, 1),
            weights_with_gradient=counted,
            step_s=[m["time/step_s"] for m in steps],
            update_s=[m["time/update_s"] for m in steps],
            peak_gib=ctx.peak_gib(),
            overflow_skips=sum(m.get("precision/overflow_skips") or 0 for m in steps),
            loss_scale=steps[-1].get("precision/loss_scale"),
            loss=[m["loss/total"] for m in steps],
        )
        del model, held, rec
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    ran = {k: v for k, v in out.items() if "skipped" not in v}
    bad = [k for k, v in ran.items() if not all(map(_finite, v["loss"]))]
    if bad:
        raise AssertionError(f"non-finite losses in {bad}")
    held_updates = [k for k in ran if k != "bf16-true/none" and ran[k]["moved_share"] < 0.99]
    if held_updates:
        raise AssertionError(
            "under 99% of the weights with a gradient moved in "
            + ", ".join(f"{k} ({ran[k]['moved_share']:.2%})" for k in held_updates)
        )
    return out


def mark_gradient(mask: torch.Tensor, param: torch.Tensor) -> None:
    """A gradient hook: ``mask`` marks the entries of ``param`` that have had a nonzero gradient."""
    mask.logical_or_(param.grad.reshape(-1) != 0)


def check_decode(ctx: Context) -> dict:
    """Decode ms/token at 8 rows: grpolab's hf engine beside transformers' generate (static cache, compiled on
    CUDA), on the Qwen model (bf16 on CUDA, fp32 on the CPU)."""
    from benchmarks.decode_gpu import runner, timed

    model, _ = qwen(ctx)
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    model = model.to(dtype).eval()
    T = 16 if ctx.cpu else 512
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, min(30000, model.config.vocab_size), (64,), generator=g).tolist()] * 8
    names = ("grpolab", "grpolab-fused", "generate") if ctx.cpu else ("grpolab", "grpolab-fused", "generate-static")
    out: dict = {"rows": 8, "T": T, "dtype": str(dtype).removeprefix("torch.")}
    if ctx.cpu:
        out["generate-static"] = {"skipped": "the static cache's compile takes minutes on a CPU; CUDA only"}
    for name in names:
        try:
            run = runner(name, model, prompts)
            # the compiled static cache warms up at the timed length: a shorter warm-up recompiles in the timed run
            warm = timed(lambda: run(T if name == "generate-static" else 16), ctx.device)  # noqa: B023
            ctx.reset_peak()
            seconds = timed(lambda: run(T), ctx.device)  # noqa: B023
            out[name] = {"ms_per_token": seconds / T * 1e3, "warmup_s": warm, "peak_gib": ctx.peak_gib()}
        except Exception as e:  # a configuration that cannot run here is said, and the others go on
            out[name] = {"error": first_line(e)}
    if "ms_per_token" not in out["grpolab"]:
        raise AssertionError(f"grpolab's hf engine: {out['grpolab']['error']}")
    return out


# ---------------------------------------------------------------- the checks that start processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BATCH = ROOT / "tools" / "torchrun_batch.py"
"""Runs a list of grpolab commands in one process, or in each of a torchrun launch's, importing torch once."""


class Launch:
    """``python ARGV`` in a process of its own (the environment's PYTHONPATH plus this checkout), its output kept in a
    log file."""

    def __init__(self, ctx: Context, name: str, argv: list[str], env: dict | None = None):
        self.name, self.log = name, ctx.work / f"{name}.log"
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        environ = {**os.environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200", **(env or {})}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env=environ,
                                         cwd=ctx.work)  # fmt: skip

    def wait(self, timeout: float) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name}: still running after {timeout:.0f} s (killed); {self.log}") from None
        if code != 0:
            raise AssertionError(f"{self.name}: exit code {code}: {self.tail()}")

    def tail(self) -> str:
        """The log's last exception line (``SomeError: ...``), else its last line naming an error, else its last."""
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        # torchrun's own summary (ChildFailedError) is left out: the child's error is the one to show
        raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)
                  and "ChildFailedError" not in line]  # fmt: skip
        named = [line for line in lines if "error" in line.lower() and "traceback" not in line.lower()]
        return (raised or named or lines or ["(no output)"])[-1][:300]


def batch(ctx: Context, name: str, commands: list[list[str]], processes: int = 1) -> list[str]:
    """The argv (after ``python``) that runs ``commands`` in one process, or in each of ``processes`` (torchrun)."""
    spec = ctx.work / f"{name}.json"
    spec.write_text(json.dumps(commands))
    if processes == 1:
        return [str(BATCH), str(spec)]
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", str(BATCH), str(spec)]


def finished(run: Path) -> bool:
    from grpolab.models.checkpoint import checkpoint_dirs

    return bool(checkpoint_dirs(run))


class Background:
    """The ``distributed`` and ``workers`` checks: their processes start at once and run beside the other checks;
    :meth:`finish` waits for them and compares. The one-process references run in one process, the two-process runs
    in one torchrun launch (tools/torchrun_batch.py), the trainer and its worker each in its own.

    Their backend is ``$GRPOLAB_DIST_BACKEND``'s, else NCCL on CUDA and gloo on the CPU. Where NCCL is asked for and
    fails (two ranks on one GPU), or this torch has none, the check runs on gloo and keeps why in its figures."""

    def __init__(self, ctx: Context, names: list[str]):
        self.ctx, self.names, self.t0 = ctx, names, time.perf_counter()
        self.launches: dict[str, Launch] = {}
        self.one = ctx.work / "p1"
        first = os.environ.get("GRPOLAB_DIST_BACKEND") or ("gloo" if ctx.cpu else "nccl")
        self.used = dict.fromkeys(BACKGROUND, first)
        self.nccl: dict[str, str] = {}
        if first == "nccl" and not torch.distributed.is_nccl_available():
            self.used = dict.fromkeys(BACKGROUND, "gloo")
            self.nccl = dict.fromkeys(BACKGROUND, f"this torch ({torch.__version__}) has no NCCL")
        if not names:
            return
        singles = [run_args(ctx, self.one, 2)]
        if "distributed" in names:
            singles.append(run_args(ctx, ctx.work / "p1-mixed", 2, precision="bf16-mixed"))
            self.start("pairs", batch(ctx, "pairs", self.pairs(""), 2), self.env("distributed"))
        self.start("single", batch(ctx, "single", singles))
        if "workers" in names:
            self.start_worker("")

    def env(self, check: str) -> dict | None:
        """The environment a check's processes get: gloo named when gloo is what it uses, else as it is."""
        return {"GRPOLAB_DIST_BACKEND": "gloo"} if self.used[check] == "gloo" else None

    def fall_back(self, check: str, error: AssertionError) -> None:
        """NCCL failed ``check``'s first try: keep why, and use gloo (raises ``error`` if gloo was what failed)."""
        if self.used[check] == "gloo":
            raise error
        self.used[check], self.nccl[check] = "gloo", first_line(error)

    def start_worker(self, suffix: str) -> None:
        """A trainer drawing through one generator worker, and the worker, into ``trainer + suffix``."""
        port, env = free_port(), self.env("workers")
        listen = ["--generators", "1", "--generator-listen", f"127.0.0.1:{port}"]
        self.start("trainer" + suffix, ["-m", "grpolab", *run_args(self.ctx, self.ctx.work / ("trainer" + suffix), 2,
                                                                   *listen)], env)  # fmt: skip
        self.start("worker" + suffix, ["-m", "grpolab", "generator", "--connect", f"127.0.0.1:{port}", "--device",
                                       self.ctx.dev, "--threads", "1"], env)  # fmt: skip

    def pairs(self, suffix: str) -> list[list[str]]:
        """The two-process runs' commands (:data:`PAIRS`), into ``KIND + suffix``."""
        return [run_args(self.ctx, self.ctx.work / (kind + suffix), 2, *extra, precision=precision)
                for kind, (precision, extra) in PAIRS.items()]  # fmt: skip

    def start(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.launches[name] = Launch(self.ctx, name, argv, env)

    def finish(self) -> dict[str, tuple[str, dict, str, float]]:
        out = {}
        timeout = 150 if self.ctx.cpu else 240
        try:
            self.launches["single"].wait(timeout)
            reference = None
        except AssertionError as e:
            reference = str(e)
        for name in self.names:
            try:
                if reference:
                    raise AssertionError(f"the one-process reference runs failed: {reference}")
                figures = self.distributed(timeout) if name == "distributed" else self.workers(timeout)
                out[name] = ("passed", figures, "", time.perf_counter() - self.t0)
            except AssertionError as e:
                out[name] = ("failed", getattr(e, "figures", {}), first_line(e), time.perf_counter() - self.t0)
        for launch in self.launches.values():
            if launch.proc.poll() is None:
                launch.proc.kill()
        return out

    def distributed(self, timeout: float) -> dict:
        suffix, error = "", None
        try:
            self.launches["pairs"].wait(timeout)
        except AssertionError as e:
            self.fall_back("distributed", e)
            suffix = "-gloo"
            retry = Launch(self.ctx, "pairs-gloo", batch(self.ctx, "pairs-gloo", self.pairs(suffix), 2),
                           self.env("distributed"))  # fmt: skip
            try:
                retry.wait(timeout)
            except AssertionError as again:
                error = first_line(again)  # the runs that finished before it are still compared
        figures: dict = {}
        for kind, (precision, _) in PAIRS.items():
            figures[kind] = {"backend": self.used["distributed"]} | self.why_not_nccl("distributed")
            run = self.ctx.work / (kind + suffix)
            if not finished(run):
                figures[kind]["error"] = error or "the run wrote no checkpoint"
                continue
            figures[kind] |= self.compare(run, self.one if precision == "32-true" else self.ctx.work / "p1-mixed")
        # fp32: the same rollouts and weights to float noise; bf16-mixed: the products' rounding differs with the
        # rows a process holds, so a sampled token may flip (the figure says how many), the weights stay close
        bad = [k for k, v in figures.items() if "error" in v or not self.holds(k, v)]
        if bad:
            error = AssertionError(f"{', '.join(bad)} on 2 processes: {[figures[k] for k in bad]}")
            error.figures = figures
            raise error
        return figures

    @staticmethod
    def holds(kind: str, figures: dict) -> bool:
        """fp32: the same rollouts and weights within 1e-4; bf16-mixed: weights within 1e-3."""
        if "mixed" in kind:
            return figures["weights_rel_diff"] <= 1e-3
        return figures["same_rollouts"] and figures["weights_rel_diff"] <= 1e-4

    def workers(self, timeout: float) -> dict:
        suffix = ""
        try:
            self.launches["trainer"].wait(timeout)
        except AssertionError as e:
            self.fall_back("workers", e)  # NCCL may refuse a trainer and a worker on one GPU
            suffix = "-gloo"
            self.launches["worker"].proc.kill()
            self.start_worker(suffix)
            self.launches["trainer" + suffix].wait(timeout)
        self.launches["worker" + suffix].wait(30)
        figures = self.compare(self.ctx.work / ("trainer" + suffix))
        figures |= {"backend": self.used["workers"]} | self.why_not_nccl("workers")
        if not (figures["same_rollouts"] and figures["weights_rel_diff"] <= 1e-5):
            error = AssertionError(f"the worker's run differs from the inline one: {figures}")
            error.figures = figures
            raise error
        return figures

    def why_not_nccl(self, check: str) -> dict:
        return {"nccl": self.nccl[check]} if check in self.nccl else {}

    def compare(self, run: Path, reference: Path | None = None) -> dict:
        reference = reference or self.one
        mine, theirs = rollouts(run), rollouts(reference)
        return dict(same_rollouts=mine == theirs, rollouts=len(mine),
                    rollouts_differing=sum(a != b for a, b in zip(mine, theirs)) + abs(len(mine) - len(theirs)),
                    weights_rel_diff=weight_difference(reference, run),
                    metrics_rel_diff=metric_difference(reference, run))  # fmt: skip


# ---------------------------------------------------------------- the driver

IN_PROCESS = {
    "checkpoint": check_checkpoint,
    "rewards": check_rewards,
    "vision": check_vision,
    "qwen-vl": check_qwen_vl,
    "vllm": check_vllm,
    "precisions": check_precisions,
    "decode": check_decode,
}


def _finite(x) -> bool:
    return x is not None and x == x and abs(x) != float("inf")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def summary(name: str, figures: dict) -> str:
    """A check's figures in a few words for its line (the JSON has them all)."""

    def peak(x) -> str:
        return "" if x is None else f", peak {x:.2f} GiB"

    def losses(xs) -> str:
        return ", ".join(f"{x:.3g}" for x in xs)

    if name == "precisions":
        parts = []
        for k, v in figures.items():
            if "skipped" in v:
                parts.append(f"{k} skipped ({v['skipped'].split(': ', 1)[-1][:70].rstrip(';.,')})")
                continue
            step = v["step_s"][1:] or v["step_s"]  # the first step warms up
            scaler = f", {v['overflow_skips']} overflow skips" if v["loss_scale"] is not None else ""
            parts.append(f"{k} moved {v['moved_share']:.2%}, {sum(step) / len(step):.2f} s/step{peak(v['peak_gib'])}"
                         f"{scaler}")  # fmt: skip
        return "; ".join(parts)
    if name == "decode":
        rates = [f"{k} {v['ms_per_token']:.2f}" if "ms_per_token" in v else f"{k} ({next(iter(v.values()))[:60]})"
                 for k, v in figures.items() if isinstance(v, dict)]  # fmt: skip
        return f"ms/token, {figures['rows']} rows, T={figures['T']}, {figures['dtype']}: " + ", ".join(rates)
    if name == "checkpoint":
        return (f"metrics, {figures['rollouts']} rollouts and {figures['tensors']} tensors equal; ops without a "
                f"deterministic algorithm: {len(figures['nondeterministic_ops'])}")  # fmt: skip
    if name == "rewards":
        components = ", ".join(f"{k} {v:.3g}" for k, v in figures["components"].items())
        return (f"reward model on {figures['reward_model_device']}: in fp32 "
                f"{figures['score_gap_fp32_vs_cpu_fp32']:.2g} "
                f"and in {figures['reward_model_dtype'].removeprefix('torch.')} {figures['score_gap_vs_cpu_fp32']:.2g} "
                f"from the CPU's fp32 scores (spread {figures['score_spread']:.2g}); {components}")  # fmt: skip
    if name == "vision":
        return f"3 steps, losses {losses(figures['loss'])}{peak(figures['peak_gib'])}"
    if name == "qwen-vl":
        n = figures["parameters"]
        size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        return (f"{size} parameters, {figures['pixels']}-pixel pictures, 3 steps, losses "
                f"{losses(figures['loss'])}{peak(figures['peak_gib'])}")  # fmt: skip
    if name == "vllm":
        return (f"engine vs trainer after each step {', '.join(f'{g:.1e}' for g in figures['sync_gap_per_step'])} "
                f"(the steps moved them {figures['moved_by_the_steps']:.2g})")  # fmt: skip
    if name == "distributed":
        nccl = next((v["nccl"] for v in figures.values() if "nccl" in v), None)
        return "; ".join(f"{k} ({v['backend']}) {v['rollouts'] - v['rollouts_differing']}/{v['rollouts']} rollouts "
                         f"equal, weights within {v['weights_rel_diff']:.1e}" for k, v in figures.items()) + (
                         f" [NCCL failed first: {nccl[:120]}]" if nccl else "")  # fmt: skip
    if name == "workers":
        nccl = figures.get("nccl")
        return (f"({figures['backend']}) {figures['rollouts'] - figures['rollouts_differing']}/{figures['rollouts']} "
                f"rollouts equal, weights within {figures['weights_rel_diff']:.1e}"
                + (f" [NCCL failed first: {nccl[:120]}]" if nccl else ""))  # fmt: skip
    return ""


def say(result: dict) -> None:
    status, name, seconds = result["status"], result["name"], result["seconds"]
    text = result.get("reason") or result.get("error") or result.get("summary", "")
    print(f"{status:<7} {name:<12} {seconds:6.1f} s  {text}", flush=True)


def run_in_process(ctx: Context, name: str) -> dict:
    t0 = time.perf_counter()
    result: dict = {"name": name}
    try:
        figures = IN_PROCESS[name](ctx)
        result |= {"status": "passed", "figures": figures}
        try:
            result["summary"] = summary(name, figures)
        except Exception as e:  # a figure the line could not show: the JSON still has them all
            result["summary"] = f"(figures in the JSON; {first_line(e)})"
    except Skip as e:
        result |= {"status": "skipped", "reason": str(e)}
    except Exception as e:
        result |= {"status": "failed", "error": first_line(e), "traceback": traceback.format_exc()[-6000:]}
    result["seconds"] = time.perf_counter() - t0
    return result


def _nccl_version() -> str:
    """NCCL's version as torch reports it (a tuple, or an int in some builds), or why there is none."""
    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # the facts line must not stop the checks
        return f"unknown ({first_line(e)})"
    return ".".join(map(str, version)) if isinstance(version, tuple | list) else str(version)


def environment(ctx: Context) -> dict:
    import transformers

    facts = {"mode": "cpu" if ctx.cpu else "cuda", "torch": torch.__version__, "cuda": torch.version.cuda,
             "transformers": transformers.__version__, "python": platform.python_version(),
             "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}  # fmt: skip
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        facts |= {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
                  "nccl": _nccl_version()}  # fmt: skip
    with contextlib.suppress(Exception):
        facts["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True).stdout.strip()  # fmt: skip
    return facts


def selected(only: str, skip: str) -> list[str]:
    chosen = [n for n in ORDER if not only or n in only.split(",")]
    unknown = {n for n in (only + "," + skip).split(",") if n} - set(ORDER)
    if unknown:
        raise SystemExit(f"gpu-check: no check named {', '.join(sorted(unknown))}; the checks: {', '.join(ORDER)}")
    return [n for n in chosen if n not in skip.split(",")]


def run_checks(ctx: Context, names: list[str], background: Background, record, budget: float, started: float) -> None:
    """Each check of ``names`` in :data:`ORDER`, the background's joined before the first that times things; a
    check not started within ``budget`` seconds (0: none) of ``started`` is skipped, said so."""

    def join_background() -> None:
        for bg, (status, figures, error, seconds) in background.finish().items():
            line = {"name": bg, "status": status, "figures": figures, "seconds": seconds}
            record(line | ({"error": error} if error else {"summary": summary(bg, figures)}))
        background.names = []

    for name in names:
        if name in TIMED and background.names:
            join_background()
        if name not in IN_PROCESS:
            continue
        spent = time.monotonic() - started
        if budget and spent > budget:  # what is left is said, and the JSON is whole
            record({"name": name, "status": "skipped", "seconds": 0.0,
                    "reason": f"out of time: {spent:.0f} s spent of --budget {budget:g}"})  # fmt: skip
            continue
        record(run_in_process(ctx, name))
    if background.names:
        join_background()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cpu", action="store_true", help="run every check on the CPU (small shapes)")
    p.add_argument("--only", default="", help=f"comma-separated checks to run (of {', '.join(ORDER)})")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out")
    p.add_argument("--json", default="", help="where the figures go (default: $OUT/gpu-check.json when $OUT is set)")
    p.add_argument("--work", default="", help="a directory for the runs (default: a temporary one, removed after)")
    p.add_argument("--budget", type=float, default=None, help="seconds after which the checks not yet started are "
                   "skipped, said so (default: 420 on CUDA, a device lent for minutes; none with --cpu)")  # fmt: skip
    args = p.parse_args(argv)
    names = selected(args.only, args.skip)
    started = time.monotonic()
    if args.budget is None:
        args.budget = 0.0 if args.cpu else 420.0
    import transformers

    transformers.utils.logging.disable_progress_bar()  # loading and saving bars between the checks' lines
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; --cpu runs the checks on the CPU", file=sys.stderr)
        return 2
    target = args.json or (os.path.join(os.environ["OUT"], "gpu-check.json") if os.environ.get("OUT") else "")
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        device = torch.device("cpu" if args.cpu else "cuda:0")
        ctx = Context(device, args.cpu, work)
        if device.type == "cuda":
            from grpolab.common.devices import prepare_device

            torch.cuda.set_device(device)
            prepare_device(device)
        facts = environment(ctx)
        print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
        report = {"environment": facts, "checks": {}}
        background = Background(ctx, [n for n in names if n in BACKGROUND])
        results = []

        def record(result: dict) -> None:
            say(result)
            results.append(result)
            report["checks"][result["name"]] = {k: v for k, v in result.items() if k != "name"}
            if target:  # written after every check: a run cut short keeps what it reached
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                Path(target).write_text(json.dumps(report, indent=2, default=str))

        run_checks(ctx, names, background, record, args.budget, started)
    counts = {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "skipped")}
    print(f"gpu-check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
          + (f"; figures in {target}" if target else ""), flush=True)  # fmt: skip
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
