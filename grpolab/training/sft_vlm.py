"""The built-in vision-language model: a tiny LLaVA that counts coloured shapes.

A CLIP vision tower reads the picture in patches; LLaVA's two-layer projector maps each patch's
features into the width of a tiny Llama, where they replace the ``<image>`` placeholder tokens
that the processor expands (one per patch; the tower's CLS feature is dropped, LLaVA's
``"default"`` strategy). The tokenizer is grpolab's character tokenizer plus ``<image>``.

:func:`sft` fine-tunes it on :mod:`grpolab.data.shapes` to answer ``#### <count>``, the format
the arithmetic rewards read, and evaluates it on the held-out set;
``python -m grpolab.training.sft_vlm --out grpolab/assets/shapes-vlm`` makes the shipped asset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from transformers import LlavaProcessor

from grpolab.data.answers import extract_final_number, numbers_equal
from grpolab.data.shapes import ShapesSpec, draw, question_key, test_set
from grpolab.models.builtin_vlm import (
    WARM_START,
    TinyVLMSpec,
    build_processor,
    build_tiny_vlm,
    build_tokenizer,
    warm_start_text,
)
from grpolab.training.sft_loop import sft_loop


def prompt_text(processor: LlavaProcessor, question: str) -> str:
    """The chat-template rendering of a user turn showing the picture, then the question: ``<image>{question}\\n``."""
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)


@dataclasses.dataclass
class ShapesSFTConfig:
    """Supervised fine-tuning of the tiny LLaVA on the shapes task (all of it is written to ``sft_config.json``)."""

    out: str = "runs/shapes-sft"
    """Directory for the model, the processor, ``sft_config.json``, ``sft_eval.json`` and ``README.md``."""
    steps: int = 600
    """Optimizer steps."""
    seed: int = 0
    """Seeds weight initialisation, the question stream and the sampled evaluation."""
    batch_size: int = 32
    """Questions per step."""
    lr: float = 1e-3
    """Peak learning rate (linear warm-up, then cosine decay to 10%)."""
    warmup_steps: int = 100
    """Warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    label_smoothing: float = 0.03
    """Cross-entropy label smoothing: as for the built-in text model (grpolab/assets/arith-sft/README.md), it
    leaves the policy under-confident, so that sampling at T=1 is right less often than greedy decoding."""
    warm_start: bool = False
    """Start the language model from the shipped built-in text model (``grpolab/assets/arith-sft``) instead of random
    weights. Off: it buys nothing here (seed 0, 600 steps: greedy 0.535, sampled 0.458 with it; 0.585 and 0.476
    without), as the answer format is learnt within the warm-up, and without it this asset depends on no other."""
    threads: int = 1
    """Torch intra-op threads (0 = torch's default)."""
    eval_questions: int = 200
    """Held-out questions for the final evaluation (the first of :func:`grpolab.data.shapes.test_set`)."""
    eval_samples: int = 4
    """Samples per question at temperature 1 for the sampled accuracy."""
    max_new_tokens: int = 8
    """Longest completion in the evaluation (``#### 4<eos>`` is 7 tokens)."""
    model: TinyVLMSpec = dataclasses.field(default_factory=TinyVLMSpec)
    """Shape of the model."""
    task: ShapesSpec = dataclasses.field(default_factory=ShapesSpec)
    """Difficulty of the questions."""
    progress: bool = True
    """Show a progress bar."""


def target_text(record: dict) -> str:
    """What the model is taught to answer, the format of the arithmetic rewards (EOS follows)."""
    return f"#### {record['answer']}"


def sft_batch(processor: LlavaProcessor, records: list[dict]) -> dict[str, torch.Tensor]:
    """Processor inputs of prompt + target + EOS, right-padded, with ``labels`` [B, L] equal to the ids on the
    target and EOS tokens and -100 elsewhere (prompt, image placeholders, padding)."""
    eos = processor.tokenizer.eos_token
    texts = [prompt_text(processor, r["question"]) + target_text(r) + eos for r in records]
    inputs = processor(
        text=texts, images=[[r["image"]] for r in records], padding=True, padding_side="right", return_tensors="pt"
    )
    ids, mask = inputs["input_ids"], inputs["attention_mask"]  # [B, L]
    lengths = mask.sum(1)  # [B]
    # the character tokenizer gives one token per character of the target, then one for EOS
    starts = lengths - torch.tensor([len(target_text(r)) + 1 for r in records])  # [B]
    pos = torch.arange(ids.shape[1])  # [L]
    on_target = (pos >= starts[:, None]) & (pos < lengths[:, None])  # [B, L]
    inputs["labels"] = torch.where(on_target, ids, -100)
    return inputs


@torch.no_grad()
def answers(model, processor: LlavaProcessor, records: list[dict], sample: bool, max_new_tokens: int) -> list[str]:
    """Completions (special tokens removed) for ``records``: greedy, or sampled at temperature 1 with no top-k or
    top-p truncation. The prompts are left-padded, as ``generate`` expects."""
    prompts = [prompt_text(processor, r["question"]) for r in records]
    inputs = processor(
        text=prompts, images=[[r["image"]] for r in records], padding=True, padding_side="left", return_tensors="pt"
    )
    tokenizer = processor.tokenizer
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # [B, P + T]
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def accuracy(completions: list[str], records: list[dict]) -> float:
    """Share of completions whose ``#### <n>`` answer equals the record's."""
    right = [numbers_equal(extract_final_number(c), r["answer"]) for c, r in zip(completions, records)]
    return sum(right) / len(right)


def evaluate(model, processor: LlavaProcessor, records: list[dict], cfg: ShapesSFTConfig) -> dict[str, float]:
    """Greedy and sampled (T=1, ``cfg.eval_samples`` per question) held-out accuracy."""
    model.eval()
    greedy = answers(model, processor, records, sample=False, max_new_tokens=cfg.max_new_tokens)
    torch.manual_seed(cfg.seed)  # the sampled figure reproduces with the weights
    repeated = [r for r in records for _ in range(cfg.eval_samples)]
    chunk = 200  # rows per generate call: bounds the memory of the key-value cache
    sampled = [
        c
        for i in range(0, len(repeated), chunk)
        for c in answers(model, processor, repeated[i : i + chunk], True, cfg.max_new_tokens)
    ]
    return {
        "eval/accuracy_greedy": accuracy(greedy, records),
        "eval/accuracy_sampled": accuracy(sampled, repeated),
        "eval/n": len(records),
        "eval/samples": cfg.eval_samples,
    }


def train(model, processor: LlavaProcessor, cfg: ShapesSFTConfig) -> list[dict]:
    """The SFT loop: AdamW, warm-up then cosine decay to 10%, loss on the answers only. Returns logged metrics."""
    exclude = frozenset(question_key(r) for r in test_set(spec=cfg.task))  # never train on a test question
    log: list[dict] = []
    sft_loop(model, lambda step: sft_batch(processor, draw(cfg.seed, step, cfg.batch_size, cfg.task, exclude)), cfg,
             log.append)  # fmt: skip
    return log


def sft(cfg: ShapesSFTConfig) -> dict[str, float]:
    """Build, train, evaluate on the held-out set, and save model, processor, config, metrics and a README in
    ``cfg.out``. The same config on the same machine gives the same weights. Returns the evaluation metrics."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer, cfg.model)
    # saved before any call: a call's padding_side sticks to the fast tokenizer and would be saved as its default
    processor.save_pretrained(out)
    model = build_tiny_vlm(cfg.model, tokenizer)
    if cfg.warm_start:
        warm_start_text(model, WARM_START)
    t0 = time.perf_counter()
    log = train(model, processor, cfg)
    metrics = evaluate(model, processor, test_set(cfg.eval_questions, cfg.task), cfg)
    metrics["time/sft_s"] = round(time.perf_counter() - t0, 1)

    model.save_pretrained(out)
    (out / "sft_metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    (out / "sft_eval.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "README.md").write_text(readme(cfg, metrics, sum(p.numel() for p in model.parameters())))
    return metrics


def readme(cfg: ShapesSFTConfig, metrics: dict[str, float], parameters: int) -> str:
    """The asset's README: what the model is, the command and settings that made it, its held-out figures."""
    m, t = cfg.model, cfg.task
    start = (
        "The language model started from `grpolab/assets/arith-sft`; the tower and the projector started at random."
        if cfg.warm_start
        else "All weights started at random (a warm start from `grpolab/assets/arith-sft` did no better)."
    )
    return f"""# The shipped built-in vision-language model

A tiny LLaVA (`LlavaForConditionalGeneration`, {parameters:,} parameters): a CLIP vision tower
(d={m.vision_hidden_size}, {m.vision_layers} layers, {m.image_size}x{m.image_size} pictures in
{m.patch_size}x{m.patch_size} patches, so one `<image>` is {m.image_tokens} tokens), LLaVA's GELU projector and
the built-in tiny Llama (d={m.hidden_size}, {m.num_layers} layers, tied embeddings) over grpolab's character
vocabulary plus `<image>` (id 100). {start}

It was fine-tuned on the shapes task (`grpolab.data.shapes`): a {t.image_size}x{t.image_size} picture of
1-{t.max_count} filled squares and circles of the asked colour among 0-{t.max_distractors} of other colours, and
the question `How many <colour> shapes are there?`. The prompt is the chat template's rendering of the user turn
`[{{"type": "image"}}, {{"type": "text", "text": question}}]`, `<image>How many red shapes are there?\\n`; the
target is `#### <count>` and EOS, the format the arithmetic rewards read. It was produced on a CPU, one thread, in
{metrics["time/sft_s"] / 60:.1f} minutes (training and evaluation), by exactly

    python -m grpolab.training.sft_vlm --out {cfg.out}

with the settings recorded in `sft_config.json` ({cfg.steps:,} steps of {cfg.batch_size} questions, AdamW at
{cfg.lr:g} with warm-up and cosine decay, label smoothing {cfg.label_smoothing}, seed {cfg.seed}). Run again on the
same machine type, that command reproduces `model.safetensors`. `sft_eval.json` holds its held-out accuracy
({metrics["eval/n"]} test questions): greedy {metrics["eval/accuracy_greedy"]:.3f}, sampled at temperature 1
({metrics["eval/samples"]} samples each) {metrics["eval/accuracy_sampled"]:.3f}.

Why label smoothing: as for the built-in text model (`grpolab/assets/arith-sft/README.md`), it leaves the policy
under-confident, so that sampling at temperature 1 is right less often than the greedy answer: a gap GRPO closes
first. The budget is small on purpose, so that GRPO has room to improve the greedy answer too.

Loading needs no torchvision (the processor's image processor is `LlavaImageProcessorPil`):

    from transformers import AutoModelForImageTextToText, AutoProcessor
    model = AutoModelForImageTextToText.from_pretrained("grpolab/assets/shapes-vlm")
    processor = AutoProcessor.from_pretrained("grpolab/assets/shapes-vlm")
"""


def main(argv: list[str] | None = None) -> dict[str, float]:
    """``python -m grpolab.training.sft_vlm --out DIR``: run :func:`sft` and print its evaluation."""
    d = ShapesSFTConfig()
    parser = argparse.ArgumentParser(prog="python -m grpolab.training.sft_vlm", description=sft.__doc__)
    parser.add_argument("--out", default=d.out, help="output directory (the asset: grpolab/assets/shapes-vlm)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=d.seed, help="weights, question stream and sampled evaluation")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="questions per step")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    parser.add_argument("--label-smoothing", type=float, default=d.label_smoothing, help="cross-entropy smoothing")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0 = torch's default)")
    parser.add_argument("--eval-questions", type=int, default=d.eval_questions, help="held-out questions")
    parser.add_argument("--warm-start", action="store_true", help="start the language model from arith-sft")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    cfg = ShapesSFTConfig(
        out=args.out,
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        label_smoothing=args.label_smoothing,
        threads=args.threads,
        eval_questions=args.eval_questions,
        warm_start=args.warm_start,
        progress=not args.no_progress,
    )
    metrics = sft(cfg)
    print(json.dumps(metrics, indent=2))
    return metrics


if __name__ == "__main__":
    main()
