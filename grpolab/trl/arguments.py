"""What TRL's ``GRPOTrainer`` holds of its arguments, read as TRL reads them: the reward functions' names, weights and
tokenizers (``reward_func_names``, ``reward_weights``, ``reward_processing_classes``), and the tokenizer of a model
object given without one (TRL loads it from the model's path)."""

from __future__ import annotations

import functools

import torch


def as_list(value, n: int) -> list:
    """TRL's reading of ``reward_processing_classes``: None is ``n`` Nones, one object a list of it."""
    if value is None:
        return [None] * n
    return list(value) if isinstance(value, list | tuple) else [value]


def reward_func_names(reward_funcs: list) -> list[str]:
    """Each entry's name as TRL names it: a model's path's last part, a function's ``__name__`` (a partial's
    function's; a callable object's class name); a string: the path or id's last part (TRL loads it as a model and
    names that), ``module:function``'s function."""
    from grpolab.rewards.model import names_a_model

    names = []
    for f in reward_funcs:
        if isinstance(f, torch.nn.Module):
            names.append(str(getattr(f.config, "_name_or_path", "")).split("/")[-1])
        elif isinstance(f, str):
            names.append(f.split("/")[-1] if names_a_model(f) else f.rsplit(":", 1)[-1])
        else:
            while isinstance(f, functools.partial):
                f = f.func
            names.append(getattr(f, "__name__", type(f).__name__))
    return names


def reward_weights(args, n: int) -> torch.Tensor:
    """``[n]`` float32: ``args.reward_weights``, or ones."""
    if getattr(args, "reward_weights", None) is not None:  # a config without them (distillation): ones
        return torch.tensor(args.reward_weights, dtype=torch.float32)
    return torch.ones(n, dtype=torch.float32)


def reward_processing_classes(reward_funcs: list, given) -> list:
    """TRL's list of one tokenizer a reward function: the one given; for a loaded reward model given none, the one
    at its path (TRL's ``AutoTokenizer.from_pretrained``; one with no path stays None, and grpolab's loader says so
    at ``train()``); None for a function, and for a reward model named by a path or id (grpolab loads its tokenizer
    with it, at ``train()``)."""
    from transformers import AutoTokenizer

    out = as_list(given, len(reward_funcs))
    for i, (f, tok) in enumerate(zip(reward_funcs, out)):
        path = getattr(getattr(f, "config", None), "_name_or_path", "")
        if tok is None and isinstance(f, torch.nn.Module) and path:
            out[i] = AutoTokenizer.from_pretrained(path)
    return out


def processing_class_for(model):
    """The tokenizer (or processor) TRL loads for a model object given without one: ``AutoProcessor`` at the model's
    path, padding and truncating on the left (no code from the model's files is run: grpolab refuses
    ``trust_remote_code``).

    Raises:
        ValueError: the model names no path (``config._name_or_path``) to load it from.
    """
    from transformers import AutoProcessor

    path = getattr(getattr(model, "config", None), "_name_or_path", "")
    if not path:
        raise ValueError(
            f"GRPOTrainer: the {type(model).__name__} names no path (config._name_or_path) to load its tokenizer "
            "from; pass it as processing_class="
        )
    return AutoProcessor.from_pretrained(path, truncation_side="left", padding_side="left")
