"""The supervised fine-tuning loop both built-in models are warm-started with (:mod:`grpolab.training.sft`, the text
model; :mod:`grpolab.training.sft_vlm`, the vision-language one): AdamW, a linear warm-up then cosine decay to 10% of
the peak learning rate, the next-token loss on the labelled tokens only, gradients clipped to norm 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from transformers import get_scheduler

from grpolab.common.progress import progress_bar


class SFTSettings(Protocol):
    """What the loop reads of a warm start's config."""

    steps: int
    lr: float
    weight_decay: float
    warmup_steps: int
    label_smoothing: float
    progress: bool


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens: ``logits`` [B, L, V], ``labels`` [B, L] (-100: not
    trained on)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=label_smoothing
    )


def sft_loop(
    model: torch.nn.Module,
    batch_of: Callable[[int], dict[str, torch.Tensor]],
    cfg: SFTSettings,
    on_log: Callable[[dict], None],
    log_every: int = 50,
) -> None:
    """Train ``model`` for ``cfg.steps`` steps on ``batch_of(step)`` (the model's inputs and their ``labels``);
    ``on_log`` gets ``{"step", "loss/sft", "charts/lr"}`` every ``log_every`` steps and at the last. A non-finite loss
    stops it in one line."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = get_scheduler(
        "cosine_with_min_lr",
        opt,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=cfg.steps,
        scheduler_specific_kwargs={"min_lr_rate": 0.1},
    )
    model.train()
    with progress_bar("sft", cfg.steps, enabled=cfg.progress) as bar:
        for step in range(1, cfg.steps + 1):
            inputs = dict(batch_of(step))
            labels = inputs.pop("labels")
            loss = sft_loss(model(**inputs).logits, labels, cfg.label_smoothing)  # logits [B, L, V]
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"sft: non-finite loss at step {step}; lower --lr (now {cfg.lr})")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % log_every == 0 or step == cfg.steps:
                on_log({"step": step, "loss/sft": loss.item(), "charts/lr": sched.get_last_lr()[0]})
                bar.update(step, f"loss {loss.item():.3f}")
