"""The report's header: the run at a glance (:func:`facts_html`): the model (with a vision-language model's family),
what it trained on (the data, or the built-in task with its settings) and its rewards, sizes, optimiser, code."""

from __future__ import annotations

import json
from pathlib import Path

from grpolab.models.checkpoint import checkpoint_dirs
from grpolab.report.markup import escape, table


def _model_fact(config: dict, run_dir: Path) -> str:
    """The model as the run named it, its GGUF file and LoRA rank, and a vision-language model's family (read from the
    model config its checkpoints keep)."""
    out = str(config.get("model", "?"))
    if config.get("gguf_file"):
        out += f" ({config['gguf_file']})"
    if config.get("lora_rank"):
        out += f" · LoRA rank {config['lora_rank']}"
    family = model_family(run_dir)
    return out + (f" · vision-language, {family} family" if family else "")


def model_family(run_dir: Path) -> str | None:
    """The vision-language family of the model a run's newest complete checkpoint holds (its config.json), None for a
    text model or a run without one; the model type itself for a type grpolab has no adapter for."""
    import types

    from grpolab.vision.families import family_of

    for _, path in reversed(checkpoint_dirs(run_dir)):
        try:
            model = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            continue  # a LoRA checkpoint keeps only its adapter's config
        if "model_type" not in model:
            continue
        try:
            family = family_of(
                types.SimpleNamespace(model_type=model["model_type"], vision_config=model.get("vision_config"))
            )
        except ValueError:
            return model["model_type"]
        return family.name if family else None
    return None


def trained_on(config: dict) -> list[tuple[str, str]]:
    """What the run trained on, as the header names it: the data (path or Hub id, its config and split, the prompt
    column) and its held-out set, or the built-in task with the settings it used; the reward functions and models."""
    if config.get("data"):
        detail = [f"{k} {config[f]}" for k, f in (("config", "data_config"), ("revision", "data_revision"),
                                                  ("split", "data_split")) if config.get(f)]  # fmt: skip
        detail.append(f"prompt column {config.get('prompt_column', 'prompt')!r}")
        facts = [("data", f"{config['data']} ({', '.join(detail)})")]
        if config.get("eval_data"):
            split = f" (split {config['eval_split']})" if config.get("eval_split") else ""
            facts.append(("held-out data", f"{config['eval_data']}{split}"))
        elif config.get("eval_fraction"):
            facts.append(("held-out data", f"{config['eval_fraction']:.0%} of the data, set aside"))
    elif config.get("env"):
        facts = []  # an environment that samples its own task: its row below says what
    else:
        task = config.get("task", "arith")
        settings = [f"operands up to {config.get('max_operand', '?')}", f"products up to {config.get('mul_max', '?')}",
                    f"categories {', '.join(config.get('categories') or []) or '?'}"]  # fmt: skip
        if task == "arith-multiturn":
            settings.insert(0, f"{config.get('stages', '?')} stages")
        facts = [("task", f"built-in {task}: {'; '.join(settings)}")]
    functions = [*(config.get("reward_fn") or []), *(f"reward model {m}" for m in config.get("reward_model") or [])]
    weights = config.get("reward_weights") or []
    if weights and len(weights) == len(functions):
        functions = [f"{f} × {w:g}" for f, w in zip(functions, weights)]
    facts.append(("rewards", ", ".join(functions) or "the task's answer check"))
    return facts


def facts_html(config: dict, rows: list[dict], run_dir: Path) -> str:
    """The run at a glance: the model, what it trained on (:func:`trained_on`; an environment's episodes and their
    credit), sizes, optimiser, code."""
    env = config.get("env") or (", ".join(config.get("tools") or []) and "tools: " + ", ".join(config["tools"]))
    facts = [
        ("model", _model_fact(config, run_dir)),
        *trained_on(config),
        *([("environment", env), ("credit across turns", config.get("advantage", "grpo"))] if env else []),
        ("steps", max((r["step"] for r in rows), default=0)),
        ("prompts × group size", f"{config.get('prompts_per_step', '?')} × {config.get('group_size', '?')}"),
        ("estimator", config.get("estimator", "?")),
        ("learning rate", config.get("lr", "?")),
        ("processes", config.get("world_size", 1)),
        ("code", config.get("code_version", "?")),
    ]
    return table(None, [[escape(k), escape(v)] for k, v in facts], left=2)
