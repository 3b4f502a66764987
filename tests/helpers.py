"""What the tests share: small models of each layout, configs and runs as a command builds them, the command line
in a subprocess, and the checks two runs are compared with. Test files import from here, never from each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from grpolab.common.batch import Batch, left_pad
from grpolab.config import fields
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.sampler import Sampled

# ---------------------------------------------------------------- the command line


def run_cli(args: list[str], cwd, timeout: int = 300, process: bool | None = None) -> subprocess.CompletedProcess:
    """``grpolab ARGS`` as a user would run it: its exit status, stdout and stderr.

    In a subprocess (``process`` True, or a command that starts processes of its own: ``--nproc``), with a
    ``timeout`` of minutes; otherwise ``grpolab.commands.cli.main`` in this process, in ``cwd``, its output captured:
    the same code from the parsed command line on, without an interpreter's and torch's start-up (seconds a call).
    """
    if process is None:
        args = [str(a) for a in args]
        process = "--nproc" in args and args[args.index("--nproc") + 1] != "1"
    if not process:
        return run_main(args, cwd, timeout)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "grpolab", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def torchrun_batch(commands: list[list[str]], cwd, nproc: int = 2, timeout: int = 600) -> None:
    """``grpolab ARGS`` for each of ``commands``, in order, on ``nproc`` processes of one torchrun launch
    (tools/torchrun_batch.py): what ``grpolab ARGS --nproc P`` runs in each of its processes, without starting P
    interpreters (and importing torch and transformers) per command. The relaunch from ``--nproc`` itself is tested
    by the commands that still use it."""
    spec = Path(cwd) / "torchrun_batch.json"
    spec.write_text(json.dumps([[str(a) for a in args] for args in commands]))
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200", "PYTHONPATH": path}
    script = Path(__file__).resolve().parents[1] / "tools" / "torchrun_batch.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    res = subprocess.run([*cmd, str(spec)], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


class RanPastDeadline(BaseException):
    """Raised in a command run in this process (:func:`run_main`) that ran past its deadline: a BaseException, so
    that no ``except Exception`` of the command's turns it into an ordinary error line."""


def run_main(args: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    """``grpolab ARGS`` through ``main`` in this process (see :func:`run_cli`); torch's thread count is restored after.

    A command still running after ``timeout`` seconds is interrupted (SIGALRM, in the main thread: pytest-timeout
    watches from a thread of its own, at 600 s) and the test fails naming the command, instead of stalling."""
    import contextlib
    import io
    import signal

    from grpolab.commands.cli import main

    def past(signum, frame):
        raise RanPastDeadline(f"grpolab {' '.join(map(str, args))} still running after {timeout:g} s")

    out, err = io.StringIO(), io.StringIO()
    threads, old_cwd, old_columns = torch.get_num_threads(), os.getcwd(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"
    code = 0
    timed = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
    if timed:
        before = signal.signal(signal.SIGALRM, past)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        os.chdir(old_cwd)
        torch.set_num_threads(threads)
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


# ---------------------------------------------------------------- a scripted rollout engine

RIGHT, WRONG = "#### 7", "#### 0"


class ScriptedEngine:
    """A real rollout engine (the :class:`grpolab.rollout.engine.RolloutEngine` contract), not a model: rollout g
    of any prompt is ``answers[g % len(answers)]`` then EOS; log-prob -0.5 and entropy 1.5 per token."""

    def __init__(self, tokenizer, answers=(RIGHT, WRONG)):
        self.tokenizer, self.answers = tokenizer, answers
        self.calls: list[tuple[list, list, SamplingSettings]] = []
        self.weight_updates = 0

    def generate(self, prompts, keys, settings, media=None) -> Sampled:
        self.calls.append((prompts, keys, settings))
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        completions = [
            self.tokenizer(self.answers[key[-1] % len(self.answers)], add_special_tokens=False)["input_ids"] + [eos]
            for key in keys
        ]
        prompt_ids, prompt_mask = left_pad(prompts, pad)  # [N, P]
        T = max(len(c) for c in completions)
        ids = torch.full((len(keys), T), pad, dtype=torch.long)
        mask = torch.zeros((len(keys), T), dtype=torch.long)
        for i, c in enumerate(completions):
            ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
        batch = Batch(prompt_ids, prompt_mask, ids, mask)
        return Sampled(batch, -0.5 * mask.float(), 1.5 * mask.float())

    def weights_changed(self) -> None:
        self.weight_updates += 1


# ---------------------------------------------------------------- small models


def tiny_llama(tokenizer, seed: int = 0, **spec):
    """A randomly initialised tiny Llama of grpolab's built-in layout (1 layer, hidden 32 unless ``spec`` says
    otherwise), seeded, in eval mode."""
    from grpolab.models.builtin import TinyLlamaSpec, build_tiny_llama

    torch.manual_seed(seed)
    shape = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64) | spec
    return build_tiny_llama(TinyLlamaSpec(**shape), tokenizer).eval()


def gpt2(vocab: int, seed: int | None = None, dropout: float = 0.0, **config):
    """A random GPT-2 layout model (learned absolute positions, fused QKV), 2 layers of width 32 unless ``config``
    says otherwise; ``dropout`` everywhere (0: train mode is deterministic)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    shape = dict(n_positions=128, n_embd=32, n_layer=2, n_head=2) | config
    cfg = GPT2Config(vocab_size=vocab, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **shape)
    return GPT2LMHeadModel(cfg)


def qwen2(vocab: int, **config):
    """A random Qwen2 layout model (grouped-query attention, QKV bias, rotary positions)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **(shape | config)))


CAUSAL_LM_FAMILIES = ("nemotron_h", "mamba", "qwen3_moe", "gpt_oss", "glm4_moe", "cohere2", "gemma2")
"""Causal-LM layouts beyond plain attention, each built tiny and random by :func:`tiny_causal_lm`: a hybrid of Mamba
and attention layers, Mamba alone, three mixtures of experts (GPT-OSS's with sliding-window layers and attention
sinks), and two with sliding-window layers beside full attention."""


def tiny_causal_lm(family: str, tokenizer, seed: int = 0):
    """A random ``family`` model (one of :data:`CAUSAL_LM_FAMILIES`) of 2 layers, hidden 32, over ``tokenizer``'s
    vocabulary, seeded. Every expert of a mixture is routed to on every token (``num_experts_per_tok`` = the number
    of experts), so that every expert's weights get a gradient; sliding windows of 8 tokens, shorter than a prompt and
    its completion, so that the window matters."""
    import transformers as tf

    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    attn = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                max_position_embeddings=256, **ids)  # fmt: skip
    layers, experts, window = dict(num_hidden_layers=2, **attn), dict(num_experts_per_tok=4), dict(sliding_window=8)
    alternating = dict(layer_types=["sliding_attention", "full_attention"], **window, **layers)
    mamba = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=16)
    rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # not GPT-OSS's YaRN at 256 tokens
    configs = {
        "nemotron_h": lambda: tf.NemotronHConfig(layers_block_type=["mamba", "attention"], **mamba, **attn),
        "mamba": lambda: tf.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, **ids),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, **experts, **layers),
        "gpt_oss": lambda: tf.GptOssConfig(num_local_experts=4, **rope, **experts, **window, **layers),
        "glm4_moe": lambda: tf.Glm4MoeConfig(
            n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, **experts, **layers
        ),
        "cohere2": lambda: tf.Cohere2Config(**alternating),
        "gemma2": lambda: tf.Gemma2Config(**alternating),
    }
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(configs[family]())


# ---------------------------------------------------------------- vision-language models
VLM_FAMILIES = ("llava", "idefics3", "qwen2-vl")
"""The vision-language families grpolab has an adapter for, each built tiny and random by :func:`tiny_vlm`."""

_VLM_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
)


def _vlm_tokenizer(specials: list[str]):
    from grpolab.models.builtin import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def _vlm_text(tok, **extra) -> dict:
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    return dict(vocab_size=len(tok), max_position_embeddings=512, **shape, **ids, **extra)


def tiny_vlm(family: str, seed: int = 0):
    """``(model, processor)``: a random vision-language model of ``family`` (one of :data:`VLM_FAMILIES`; width 32, 2
    layers in the tower and the language model, 28-pixel images of 14-pixel patches) in eval mode, and its processor
    over the built-in character tokenizer with the image placeholder tokens added and a plain chat template (an
    image part is the family's placeholder, a turn ends with a newline). Processors that need torchvision are not
    used: transformers' PIL image processors, and grpolab's :class:`grpolab.vision.processing.QwenProcessor`."""
    from transformers import (
        CLIPVisionConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14)
    if family == "llava":
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        tok = _vlm_tokenizer(["<image>"])
        torch.manual_seed(seed)
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(image_size=28, projection_dim=32, **vision),
            text_config=LlamaConfig(**_vlm_text(tok)),
            image_token_id=tok.convert_tokens_to_ids("<image>"),
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
        )
        images = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        template = _VLM_TEMPLATE.replace("IMAGE", "<image>")
        processor = LlavaProcessor(
            image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
            image_token="<image>", num_additional_image_tokens=1, chat_template=template,
        )  # fmt: skip
        return LlavaForConditionalGeneration(config).eval(), processor
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        tok = _vlm_tokenizer(["<image>", "<fake_token_around_image>", "<global-img>"])
        torch.manual_seed(seed)
        config = Idefics3Config(
            vision_config=dict(image_size=28, **vision),
            text_config=_vlm_text(tok, model_type="llama"),
            image_token_id=tok.convert_tokens_to_ids("<image>"),
            scale_factor=2,  # 2 x 2 patches -> 1 token per image (tile)
        )
        images = Idefics3ImageProcessorPil(
            size={"longest_edge": 28}, max_image_size={"longest_edge": 28}, do_image_splitting=False
        )
        template = _VLM_TEMPLATE.replace("IMAGE", "<image>")
        processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=1, chat_template=template)
        return Idefics3ForConditionalGeneration(config).eval(), processor
    if family == "qwen2-vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from grpolab.vision.processing import QwenProcessor

        tok = _vlm_tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
        torch.manual_seed(seed)
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        config = Qwen2VLConfig(
            text_config=_vlm_text(tok, rope_parameters=rope),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14),
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        )
        images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
        template = _VLM_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
        return Qwen2VLForConditionalGeneration(config).eval(), QwenProcessor(images, tok, template)
    raise ValueError(f"no tiny {family!r}; choose from {VLM_FAMILIES}")


def save_tiny_vlm(family: str, path: Path, seed: int = 0) -> Path:
    """:func:`tiny_vlm` saved as a model directory (weights, config, processor) that ``--model`` loads."""
    model, processor = tiny_vlm(family, seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def picture(colour=(255, 0, 0), size=(40, 30)):
    """A plain RGB picture of ``colour`` and ``size`` (width, height)."""
    from PIL import Image

    return Image.new("RGB", size, colour)


def model_and_batch():
    """A tiny Llama (seed 7, train mode) on the built-in character tokenizer, and a seeded batch of 6 rows for it:
    left-padded prompts [6, 6] (lengths 3, 5, 4, 6, 2, 5) and right-padded completions [6, 6] (lengths 4, 1, 6, 3,
    5, 2; the even rows end in EOS, the odd ones are cut off)."""
    from grpolab.models.builtin import build_char_tokenizer

    tok = build_char_tokenizer()
    model = tiny_llama(tok, seed=7).train()
    g = torch.Generator().manual_seed(8)
    prompt_lens, comp_lens = [3, 5, 4, 6, 2, 5], [4, 1, 6, 3, 5, 2]
    prompts = [[tok.bos_token_id] + torch.randint(4, len(tok), (n - 1,), generator=g).tolist() for n in prompt_lens]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)  # [N, 6]
    T = max(comp_lens)
    comp_ids = torch.full((len(comp_lens), T), tok.pad_token_id, dtype=torch.long)
    comp_mask = torch.zeros((len(comp_lens), T), dtype=torch.long)
    for i, n in enumerate(comp_lens):
        comp_ids[i, :n] = torch.randint(4, len(tok), (n,), generator=g)
        comp_ids[i, n - 1] = tok.eos_token_id if i % 2 == 0 else comp_ids[i, n - 1]
        comp_mask[i, :n] = 1
    return model, Batch(prompt_ids, prompt_mask, comp_ids, comp_mask)


def tiny_reward_model(
    directory: Path | None = None, num_labels: int = 1, seed: int = 0, template: str | None = None, **config
):
    """A random tiny LlamaForSequenceClassification (2 layers, hidden 32, rotary positions) on the built-in
    character tokenizer, ``num_labels`` logits, seeded, in eval mode, and its tokenizer (its chat template
    ``template``, default :data:`SIMPLE_TEMPLATE`; "" for none); saved with it to ``directory`` when one is given."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpolab.models.builtin import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = SIMPLE_TEMPLATE if template is None else template or None
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    cfg = LlamaConfig(vocab_size=len(tok), num_labels=num_labels, pad_token_id=tok.pad_token_id, **(shape | config))
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg).eval()
    if directory is not None:
        model.save_pretrained(directory)
        tok.save_pretrained(directory)
    return model, tok


# A chat template of the simplest shape: every message, then the assistant's turn.
SIMPLE_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def builtin_causal_lm():
    """The built-in model's weights (a tiny Llama) as a transformers causal LM and its tokenizer, given
    :data:`SIMPLE_TEMPLATE` as chat template: what grpolab.trl's tests hand TRL's own trainer and the drop-in alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(__file__).resolve().parents[1] / "grpolab" / "assets" / "arith-sft"
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = SIMPLE_TEMPLATE
    return AutoModelForCausalLM.from_pretrained(path), tokenizer


def docs_listed(page: str, lead: str, after: str) -> set[str]:
    """The backticked names that docs/``page`` lists in the bullet starting with ``lead`` (in bold), from the words
    ``after`` to the end of their sentence."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / page).read_text()
    bullet = text[text.index(f"- **{lead}**") :]
    listed = bullet[bullet.index(after) + len(after) :]
    return set(re.findall(r"`([^`]+)`", listed[: listed.index(". ")]))


# ---------------------------------------------------------------- configs and runs

# A few steps of the built-in model at one thread: small enough for the fast tier, deterministic.
SMALL = dict(
    model="builtin",
    prompts_per_step=4,
    group_size=4,
    eval_questions=16,
    eval_samples=2,
    max_new_tokens=48,
    progress=False,
    threads=1,
    device="cpu",
    # a generator process or worker that stalls fails its test in 2 minutes, naming it, well inside pytest-timeout's
    # 600 s (the default, 900 s, outlived the test: a stall looked like the suite hanging)
    generator_timeout=120.0,
)


def small_cfg(out: Path, **over):
    """A :class:`grpolab.config.train.TrainConfig` of the built-in model in ``SMALL``'s shape, writing to ``out``."""
    from grpolab.config.train import TrainConfig

    return TrainConfig(out=str(out), **{**SMALL, **over})


def quiet(*args, **kwargs) -> None:
    """A ``log`` that says nothing."""


def for_run(cls, spec: str, model_field: str, **options):
    """A ``cls`` config as ``grpolab`` builds one for the model or run ``spec``: the run's own options as the
    defaults (:func:`grpolab.eval.runs.run_defaults`), then ``options``."""
    from grpolab.eval.runs import run_defaults

    base = run_defaults(cls, spec) or cls()
    return fields.replace(base, **{model_field: spec}, **options)


def task_of(cfg):
    """The :class:`grpolab.eval.runs.RunTask` of a training config: what a probe of its run measures on."""
    from grpolab.eval.runs import RunTask, Target
    from grpolab.training.setup import checked_config

    checked = checked_config(cfg)
    return RunTask.of(Target(checked.policy.model, None, checked.to_dict()))


# ---------------------------------------------------------------- reading and comparing runs


def by_step(rows: list[dict]) -> dict[int, dict]:
    """Metrics rows by step, each step once."""
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate rows for steps {steps}"
    return {r["step"]: r for r in rows}


def metrics_by_step(out: Path) -> dict[int, dict]:
    """A run's metrics by step, times left out."""
    from grpolab.training.runlog import read_metrics

    return {s: {k: v for k, v in r.items() if not k.startswith("time/")} for s, r in by_step(read_metrics(out / "metrics.jsonl")).items()}  # fmt: skip


def state_dict(path) -> dict[str, torch.Tensor]:
    """The weights of a saved model directory (a checkpoint)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def rollouts_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


def assert_same_metrics(a: Path, b: Path) -> None:
    """Two runs' metrics agree step by step (``rel`` 1e-4): the float noise of differently batched forwards
    (``engine/*``), the rank-0 records (``credit/*``) and the times aside."""
    from grpolab.training.runlog import read_metrics

    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(len(ra)))  # one row per step
    for x, y in zip(ra, rb):
        for k, v in x.items():
            if k.startswith(("time/", "engine/", "credit/")) or v is None:
                continue
            if k == "doctor/weights_unmoved_frac":  # a few of ~1e5 sampled fp32 weights sit at the edge of rounding
                assert y[k] == pytest.approx(v, abs=1e-3), (x["step"], k, v, y[k])  # and flip with float noise
                continue
            # a loss is a difference of larger terms: its float noise is theirs (1.4e-6 on 2.2e-3 held to AVX2)
            tol = 1e-5 if k.startswith("loss/") else 1e-6
            assert y[k] == pytest.approx(v, rel=1e-4, abs=tol), (x["step"], k, v, y[k])


# ---------------------------------------------------------------- the token view's page


class TokenCards(HTMLParser):
    """The rollout cards of the token view's HTML: each card's column, data attributes and token spans."""

    def __init__(self):
        super().__init__()
        self.cards: list[dict] = []
        self.column = ""
        self.tags: list[str] = []
        self.open: list[dict | None] = []
        self.in_text = False  # inside a card's div.tc-text (the legend has a marker too)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        cls = (a.get("class") or "").split()
        if "tc-col" in cls:
            self.column = "pos" if "tc-pos" in cls else "neg"
        if "tc-roll" in cls:
            self.cards.append({"column": self.column, **{k[5:]: int(v) for k, v in a.items() if k.startswith("data-")}})
            self.cards[-1]["tokens"] = []
        self.in_text = self.in_text or "tc-text" in cls
        span = None
        if tag == "span" and self.in_text and ("tok" in cls or "tok-mark" in cls):
            span = {"text": "", "mark": "tok-mark" in cls, "style": a.get("style", ""), "title": a.get("title", "")}
            self.cards[-1]["tokens"].append(span)
        self.open.append(span)

    def handle_endtag(self, tag):
        self.open.pop()
        self.in_text = self.in_text and tag != "div"

    def handle_data(self, data):
        span = next((s for s in reversed(self.open) if s is not None), None)  # a newline sits in a nested span
        if span is not None:
            span["text"] += data


def token_cards(page: str) -> TokenCards:
    cards = TokenCards()
    cards.feed(page)
    return cards


# ---------------------------------------------------------------- the sandbox


def bwrap_runs() -> bool:
    from grpolab.sandbox import runner

    return runner.available("bwrap", os.path.realpath(sys.executable))


needs_bwrap = pytest.mark.skipif(
    not bwrap_runs() and not os.environ.get("GRPOLAB_REQUIRE_BWRAP"),
    reason="bubblewrap is not installed or does not run here (make test installs it)",
)


# ---------------------------------------------------------------- runs on one process and on several

# The flags of the multi-process comparisons' runs (the held-out questions: split over 2 processes, 4 each).
CLI_BASE = [
    *("--prompts-per-step", "4", "--group-size", "4", "--eval-questions", "8", "--eval-samples", "2"),
    *("--warmup-steps", "0", "--log-rollouts", "--no-progress", "--device", "cpu"),
]
# The KL reference, importance ratios (mu = 2), micro-batches and token-mean's global token count.
# Every run also records 2 rollouts a step token by token (rank 0's own: its block of the step's prompts).
EACH_CPU = pytest.mark.parametrize("units", [True, False], ids=["cpu-bf16-units", "cpu-no-bf16-units"])
"""A test run once on a CPU with bf16 units and once without (``units``; with the ``machine_kind`` fixture)."""

KL_MU = [
    *("--beta", "0.04", "--mu", "2", "--micro-batch", "2", "--estimator", "rloo", "--aggregation", "token-mean"),
    *("--log-token-credit", "2"),
]
REL_TOL = 1e-5


def train_args(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False) -> list[str]:
    """The arguments of ``grpolab train`` of ``steps`` steps in ``CLI_BASE``'s shape (plus ``extra``) into
    ``tmp/name``."""
    return ["train", "--out", str(tmp / name), "--steps", str(steps), *CLI_BASE, *extra] + (
        ["--resume"] if resume else []
    )


def train_cli(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False) -> Path:
    """``grpolab train`` of ``steps`` steps in ``CLI_BASE``'s shape (plus ``extra``) into ``tmp/name``."""
    res = run_cli(train_args(tmp, name, steps, *extra, resume=resume), cwd=tmp, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / name


def assert_same_params(a: Path, b: Path, step: int = 3) -> None:
    """Two runs' weights at ``step`` agree to ``REL_TOL`` (relative, per tensor), and they did move from the start."""
    from safetensors.torch import load_file

    from grpolab.models.policy import ASSET_DIR

    pa = load_file(str(a / "checkpoints" / f"step_{step}" / "model.safetensors"))
    pb = load_file(str(b / "checkpoints" / f"step_{step}" / "model.safetensors"))
    start = load_file(str(ASSET_DIR / "model.safetensors"))
    moved = max(float((pa[k] - start[k]).norm() / start[k].norm()) for k in start)
    assert moved > 100 * REL_TOL, f"the runs barely trained (moved {moved:.2e}): the comparison would prove nothing"
    assert pa.keys() == pb.keys() == start.keys()  # FSDP's gathered checkpoint too: the tied head saved once
    for k in start:
        rel = float((pa[k] - pb[k]).norm() / pa[k].norm())
        assert rel <= REL_TOL, f"{k}: relative difference {rel:.2e} between {a.name} and {b.name}"


# ---------------------------------------------------------------- a Hugging Face Hub cache, offline

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def hub_repo(hub: Path, repo_id: str, repo_type: str, commit: str, files: dict, refs=("main",)) -> Path:
    """A repository in a Hugging Face cache at ``hub`` (``$HF_HOME/hub``), laid out as huggingface_hub lays it out:
    ``<type>s--<org>--<name>/refs/<ref>`` holding the commit (no newline) and ``snapshots/<commit>/<files>``.
    ``files`` maps a path in the repository to its text, bytes, or a local file (a Path: linked, not copied, as the
    cache links snapshots to blobs). Returns the snapshot directory."""
    folder = hub / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = snap / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            path.symlink_to(content.resolve())
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return snap


def offline_hub(home: Path, monkeypatch) -> Path:
    """An empty Hugging Face cache under ``home`` used offline, in this process (huggingface_hub reads its settings
    once, at import: its constants are set here) and in the processes it starts (the environment). Returns the hub
    directory that :func:`hub_repo` fills."""
    from huggingface_hub import constants

    hub = home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(hub)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return hub


# ---------------------------------------------------------------- generator workers


def within(seconds: float, call):
    """``call()`` in a thread: what it returned or raised, or an AssertionError after ``seconds`` (a regression to a
    wait without a deadline fails here, naming itself, instead of hanging the suite)."""
    got: dict = {}

    def target():
        try:
            got["value"] = call()
        except BaseException as e:  # handed to the test's thread
            got["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a wait without a deadline"
    if "error" in got:
        raise got["error"]
    return got.get("value")


def free_port() -> int:
    """A TCP port free on localhost now (a trainer's --generator-listen)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(port: int, *extra: str, cwd=None) -> subprocess.Popen:
    """``grpolab generator --connect 127.0.0.1:PORT`` in a process of its own, one thread."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "grpolab", "generator", "--connect", f"127.0.0.1:{port}", "--threads", "1", *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def assert_identical_runs(a: Path, b: Path, step: int) -> None:
    """Two runs are the same bit for bit: every metric (times and the generators' own books aside), every
    logged rollout, and the weights saved at ``step``."""
    from safetensors.torch import load_file

    def books(run: Path) -> dict:
        return {s: {k: v for k, v in r.items() if not k.startswith("generators/")} for s, r in metrics_by_step(run).items()}  # fmt: skip

    assert books(a) == books(b)
    assert rollouts_of(a) == rollouts_of(b)
    wa = load_file(str(a / "checkpoints" / f"step_{step}" / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / f"step_{step}" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------- TRL's trainer, scored in float64


def trl_scores_in_float64(trainer) -> None:
    """Make ``trainer`` (TRL's GRPOTrainer) score its completions with grpolab's float64 forward from here on.

    TRL's forward runs the LM head fused (transformers' ``fused_lm_head``) and returns float32 log-probs whatever the
    model's dtype, so its loss carries float32 rounding (about 1e-7 relative) before any objective is applied. Each call
    still runs TRL's own forward, whose log-probs and entropies must equal grpolab's (``completion_logprobs`` of the
    same ids and attention mask) to float32 rounding; then grpolab's float64 ones, with their own graph, stand in, so
    that a comparison measures the objective: TRL's loss from the log-probs on against grpolab's."""
    from grpolab.models.logprobs import completion_logprobs

    forward = trainer._get_per_token_logps_and_entropies

    def in_float64(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux = forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        P = input_ids.shape[1] - logits_to_keep
        batch = Batch(input_ids[:, :P], attention_mask[:, :P], input_ids[:, P:], attention_mask[:, P:])
        ours = completion_logprobs(model, batch, entropy=True)  # [N, T, 2]: log-probs and entropies
        m = batch.completion_mask.bool()
        assert (logps.double()[m] - ours[..., 0][m]).abs().max() < 1e-5  # TRL's fp32 head: the same, rounded
        if entropies is not None:
            assert (entropies.double()[m] - ours[..., 1][m]).abs().max() < 1e-5
        return ours[..., 0], ours[..., 1], aux

    trainer._get_per_token_logps_and_entropies = in_float64


# ---------------------------------------------------------------- two ranks of a gloo group, spawned


def rank_of_two_failing_on_main(rank: int, port: int, timeout: float, said, done) -> None:
    """One of two gloo ranks running :func:`grpolab.common.distributed.on_main` with a call that raises on rank 0 (an
    error that is not a checkpoint's); puts (rank, the error's type and text, seconds it took) in ``said``. Rank 0
    stays until rank 1 has said (``done``, at most ``timeout``), as a run closing its engines would: its exit does not
    end rank 1's wait."""
    import datetime
    import time

    import torch.distributed as dist

    from grpolab.common.distributed import World, on_main

    span = datetime.timedelta(seconds=timeout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=span)

    def save():
        raise RuntimeError("the disk went away")

    t0 = time.monotonic()
    try:
        on_main(save, World(rank, 2), lambda: ValueError("failed on rank 0"))
        said.put((rank, None, "", time.monotonic() - t0))
    except Exception as e:
        said.put((rank, type(e).__name__, str(e), time.monotonic() - t0))
    if rank == 1:
        done.set()
    done.wait(timeout)
    dist.destroy_process_group()
