"""Supervised warm start of the built-in model on worked solutions [RLVR essay, Sec. 4.3].

GRPO learns only from groups whose rewards differ, so it needs a policy that is
sometimes right. The default budget gives one that solves a moderate share of
held-out questions when sampling at temperature 1.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from grpolab.common.rng import seed_everything, set_threads
from grpolab.config.rollout import EngineSection
from grpolab.data.arithmetic import ArithmeticSpec, TrainSampler, test_set
from grpolab.eval.accuracy import evaluate
from grpolab.models.builtin import TinyLlamaSpec, build_char_tokenizer, build_tiny_llama
from grpolab.models.policy import Policy
from grpolab.rollout.engine import EngineSpec
from grpolab.rollout.placement import build_engine
from grpolab.rollout.service import RolloutService
from grpolab.training.sft_loop import sft_loop


@dataclasses.dataclass
class SFTConfig:
    """Supervised fine-tuning of the built-in tiny Llama on worked arithmetic solutions."""

    out: str = "runs/sft"
    """Directory for the model (``save_pretrained``), ``sft_config.json`` and ``sft_metrics.jsonl``."""
    steps: int = 3000
    """Optimizer steps."""
    batch_size: int = 32
    """Questions per step."""
    lr: float = 1e-3
    """Peak learning rate (linear warm-up, then cosine decay to 10%)."""
    warmup_steps: int = 100
    """Warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    label_smoothing: float = 0.03
    """Cross-entropy label smoothing. The default 0.03 leaves the policy under-confident:
    its greedy answer is often right while sampling at T=1 often is not, the gap GRPO closes first."""
    seed: int = 0
    """Seeds weight initialisation and the question stream."""
    threads: int = 1
    """Torch intra-op threads (0 = torch's default)."""
    eval_questions: int = 500
    """Held-out questions for the final evaluation."""
    eval_samples: int = 4
    """Samples per question at temperature 1 for the sampled accuracy."""
    model: TinyLlamaSpec = dataclasses.field(default_factory=TinyLlamaSpec)
    """Shape of the model."""
    task: ArithmeticSpec = dataclasses.field(default_factory=ArithmeticSpec)
    """Difficulty of the questions."""
    progress: bool = True
    """Show a progress bar."""

    def validate(self) -> None:
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"sft: lr must be > 0, got {self.lr}")


def _batch(policy: Policy, records: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+solution+EOS with labels on the solution only (-100 elsewhere)."""
    seqs, labels = [], []
    for r in records:
        prompt = policy.prompt_ids(r)
        target = policy.tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [policy.eos_id]
        seqs.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), policy.pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), L), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, y) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(y)] = torch.tensor(y)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """Train, evaluate on the held-out set, save. Returns the evaluation metrics."""
    cfg.validate()
    set_threads(cfg.threads)
    seed_everything(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(cfg.model, tokenizer)
    policy = Policy(model, tokenizer, source="scratch")
    held_out = test_set(cfg.eval_questions, cfg.task)
    sampler = TrainSampler(
        cfg.seed, cfg.task, exclude={r["question"] for r in test_set(500, cfg.task)} | {r["question"] for r in held_out}
    )

    t0 = time.perf_counter()
    with open(out / "sft_metrics.jsonl", "w") as log:
        sft_loop(model, lambda step: _batch(policy, sampler.draw(step, cfg.batch_size)), cfg,
                 lambda row: log.write(json.dumps(row) + "\n"))  # fmt: skip
    service = RolloutService(build_engine(EngineSpec.of(EngineSection(), cfg.seed, policy), policy.model), policy)
    metrics, _ = evaluate(service, held_out, samples=cfg.eval_samples, seed=cfg.seed)
    metrics["time/sft_s"] = time.perf_counter() - t0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "sft_eval.json").write_text(json.dumps(metrics, indent=2))
    return metrics
