"""Reward models: a transformers sequence-classification model scoring prompt + completion, as one reward component.

A reward model is named by a directory or a Hub id (``--reward-model``; TRL's ``reward_funcs="org/name"``) or given
to the Python API as a loaded ``PreTrainedModel``. It is loaded with ``AutoModelForSequenceClassification`` and its
own ``AutoTokenizer``, kept in eval mode with its gradients off, and never trains: the policy's optimizer and
checkpoints do not see it. A :class:`RewardModel` is a reward function in grpolab's form, so it is weighted
(``--reward-weights``), normalised (GDPO) and logged (``reward/<name>``) as any function is.

What it reads, as TRL's GRPOTrainer reads a reward model:

- the text: for chat prompts, the reward tokenizer's own chat template over the prompt's messages plus the
  completion as the assistant's message; otherwise the prompt's text followed by the completion's. Tokenized as it
  is (``add_special_tokens=False``: a template writes its own special tokens);
- the score (:func:`head_score`): a one-label head's logit; a two-label head's logit of label 1 minus that of label 0
  (the log-odds of label 1, the "positive" or "chosen" label of a binary classifier); a head of more labels needs the
  label named (``ID_OR_DIR@LABEL``: an index or a name of the model's ``id2label``), as may any head.

Rows are scored in batches of at most ``--reward-model-batch-tokens`` padded tokens (:func:`token_batches`), right
padded with an attention mask; the model reads each row at its last token that is not the pad token, as
transformers' sequence-classification heads do.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given, is_description
from grpolab.common.precision import bf16_units

FLAG = "--reward-model"


def names_a_model(entry: object) -> bool:
    """Whether an entry of the Python API's ``reward_funcs`` is a reward model rather than a reward function.

    A loaded ``torch.nn.Module`` is a model (TRL's test too). A string is a model when it names an existing
    directory (whatever its name holds) or has no colon (a Hub id ``org/name``, a directory that is missing: its
    error says so), with an optional ``@LABEL`` after it; a string with a colon is a function, ``module:function`` or
    ``path/to/file.py:function`` (and a malformed one is the function loader's error).
    """
    if isinstance(entry, torch.nn.Module):
        return True
    if not isinstance(entry, str) or is_description(entry):
        return False
    return Path(split_label(entry)[0]).expanduser().is_dir() or ":" not in entry


def split_label(spec: str) -> tuple[str, str]:
    """``(model, label)`` of ``ID_OR_DIR@LABEL``; ``(spec, "")`` when it names no label (or an existing path holds
    the ``@``)."""
    model, at, label = spec.rpartition("@")
    if is_description(spec) or not at or not model or not label or "/" in label or Path(spec).expanduser().exists():
        return spec, ""
    return model, label


def model_name(spec: str) -> str:
    """The short name of a reward model spec, which its ``reward/<name>`` metric takes: a directory's base name, a
    Hub id's last part (TRL names them so), a model object's path's (its description's), else its class name."""
    if is_description(spec):  # "reward model object: LlamaForSequenceClassification (path)"
        inner = re.search(r"\(([^()]*)\)\s*(?:#\d+)?$", spec)
        if inner is None:
            return spec.split(": ", 1)[1].split()[0]
        spec = inner.group(1)
    return Path(split_label(spec)[0].rstrip("/\\")).name or spec


# ---------------------------------------------------------------- the math: batches and the score


def token_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of rows of ``lengths`` tokens in batches whose padded size (rows x the longest) stays within
    ``budget`` tokens: the rows sorted by length (the shortest first, ties in their order), each batch filled while
    the next row still fits; a row longer than the budget on its own goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= budget:  # sorted: row i is the batch's longest
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def head_score(logits: torch.Tensor, label: int | None = None) -> torch.Tensor:
    """The reward of each row from a sequence-classification head's logits ``[N, L]``: ``[N]``.

    ``label`` given: that label's logit. Otherwise one label: its logit; two labels: ``logit_1 - logit_0``, the
    log-odds of label 1 (``log p_1 / p_0`` under the head's softmax). More labels need ``label`` (ValueError).
    """
    n_labels = logits.shape[-1]
    if label is not None:
        return logits[:, label]
    if n_labels == 1:
        return logits[:, 0]
    if n_labels == 2:
        return logits[:, 1] - logits[:, 0]
    raise ValueError(f"a head of {n_labels} labels: name the label to read")


def label_index(label: str, n_labels: int, id2label: dict | None) -> int | None:
    """The index ``label`` names (``""``: None, the head's default reading) among ``n_labels``: an index, or one of
    ``id2label``'s names; a ValueError saying which there are otherwise."""
    if not label:
        if n_labels > 2:
            raise ValueError(f"its head has {n_labels} labels ({_labels(id2label)}); name one: {FLAG} ID_OR_DIR@LABEL")
        return None
    if re.fullmatch(r"\d+", label):
        if int(label) >= n_labels:
            raise ValueError(f"label {label}: its head has {n_labels} label(s) ({_labels(id2label)})")
        return int(label)
    found = [int(i) for i, name in (id2label or {}).items() if name == label]
    if not found:
        raise ValueError(f"no label named {label!r} (its labels: {_labels(id2label)})")
    return found[0]


def _labels(id2label: dict | None) -> str:
    return ", ".join(f"{i}: {name}" for i, name in sorted((id2label or {}).items(), key=lambda kv: int(kv[0])))


def same_prompt(prompts: Sequence[str | list[dict]]) -> list[list[int]]:
    """The rows of each distinct prompt, in first-seen order: a GRPO group's rows share theirs."""
    rows: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        rows.setdefault(p if isinstance(p, str) else json.dumps(p, sort_keys=True), []).append(i)
    return list(rows.values())


def model_texts(
    prompts: Sequence[str | list[dict]], completions: Sequence[str | list[dict]], template: Callable | None
) -> list[str]:
    """The text a reward model reads for each (prompt, completion), as TRL builds it: a conversational prompt (a
    list of messages) with the completion as the assistant's message (or the messages after the prompt) through
    ``template`` (a chat template, ``messages -> text``); a text prompt followed by the completion's text."""
    out = []
    for p, c in zip(prompts, completions):
        if isinstance(p, list):
            after = list(c) if isinstance(c, list) else [{"role": "assistant", "content": c}]
            out.append(template(list(p) + after))
        else:
            out.append(p + (c if isinstance(c, str) else "".join(m["content"] for m in c)))
    return out


# ---------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class RewardModelSettings:
    """Where and how reward models run (the ``--reward-model-*`` options, the device resolved)."""

    device: torch.device = torch.device("cpu")
    dtype: str = "auto"
    """auto: float32 on a CPU, bfloat16 on a CUDA device that computes it (else float32); a model object keeps its
    own."""
    batch_tokens: int = 8192

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device.type == "cuda" and bf16_units(self.device):
            return torch.bfloat16
        return torch.float32


class RewardModel:
    """A sequence-classification model as a reward function in grpolab's form: ``(completions, records) ->``
    scores (:mod:`grpolab.rewards.model`). ``prompt_of(record)``: the prompt as the policy saw it (text, or chat
    messages); ``label``: the head's label to read (None: :func:`head_score`'s default)."""

    takes_conversations = True

    def __init__(self, model, tokenizer, prompt_of: Callable[[dict], Any], *, label: int | None = None,
                 batch_tokens: int = 8192, name: str = "reward_model", origin: dict | None = None):  # fmt: skip
        self.model, self.tokenizer, self.prompt_of = model, tokenizer, prompt_of
        self.label, self.batch_tokens, self.__name__, self.origin = label, batch_tokens, name, origin

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, completions: list[str], records: list[dict], conversations: list | None = None) -> list[float]:
        if conversations is not None:  # episodes: the opening messages and every message after them
            prompts = [c[0] for c in conversations]
            completions = [list(c[1]) if isinstance(c[0], list) else t for c, t in zip(conversations, completions)]
        else:
            prompts = [self.prompt_of(r) for r in records]
        texts = model_texts(prompts, completions, self._template)
        return self.score_texts(texts, same_prompt(prompts)).tolist()

    def _template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.no_grad()
    def score_texts(self, texts: Sequence[str], groups: list[list[int]] | None = None) -> torch.Tensor:
        """The score of each text, ``[N]`` float64 (from the model's own dtype), in batches within the token
        budget. ``groups``: rows that share a prompt (a GRPO group): their common first tokens are computed once
        (:meth:`_score_group`) where the model keeps a cache; the scores are the same (to rounding)."""
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        out = torch.zeros(len(ids), dtype=torch.float64)
        if groups and self._caches():
            for rows in groups:
                out[rows] = self._score_group([ids[i] for i in rows])
            return out
        for rows in token_batches([len(x) for x in ids], self.batch_tokens):
            out[rows] = self._score_rows([ids[i] for i in rows])
        return out

    def _score_rows(self, ids: list[list[int]], prefix=None, prefix_len: int = 0) -> torch.Tensor:
        """``[b]`` scores of whole rows, or of the rows after a cached ``prefix`` of ``prefix_len`` tokens
        (``past_key_values``), right padded: the head reads each row at its last token that is not the pad token."""
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, padding_side="right", return_tensors="pt")
        mask = batch["attention_mask"]  # [b, T]
        if prefix is not None:
            mask = torch.cat([torch.ones(len(ids), prefix_len, dtype=mask.dtype), mask], dim=1)  # [b, P + T]
        logits = self.model(
            input_ids=batch["input_ids"].to(self.device), attention_mask=mask.to(self.device), past_key_values=prefix
        ).logits  # [b, L]
        return head_score(logits.double(), self.label).cpu()

    def _caches(self) -> bool:
        """Whether the model is a decoder that takes a cache of keys and values (Llama, Qwen, GPT-2, ...)."""
        return "past_key_values" in inspect.signature(self.model.forward).parameters

    def _score_group(self, ids: list[list[int]]) -> torch.Tensor:
        """``[n]`` scores of rows that share a prompt: their longest common first tokens (all but each row's last)
        in one forward whose keys and values every row then reads, the rest of the rows batched within the token
        budget. A GRPO group of 8 on a short answer computes its prompt once instead of 8 times."""
        P = min(len(x) for x in ids) - 1
        P = next((k for k in range(P) if len({x[k] for x in ids}) > 1), P)  # the common first tokens
        rests = [x[P:] for x in ids]
        if P == 0 or len(ids) == 1:
            return torch.cat([self._score_rows([ids[i] for i in b]) for b in token_batches(list(map(len, ids)),
                                                                                             self.batch_tokens)])  # fmt: skip
        prefix = torch.tensor([ids[0][:P]], device=self.device)  # [1, P]
        out = torch.zeros(len(ids), dtype=torch.float64)
        for rows in token_batches([len(r) + P for r in rests], self.batch_tokens):
            cache = self.model(input_ids=prefix, use_cache=True).past_key_values
            cache.batch_repeat_interleave(len(rows))  # [b, heads, P, d] per layer
            out[rows] = self._score_rows([rests[i] for i in rows], cache, P)
        return out


def load_reward_model(
    spec: str, settings: RewardModelSettings, prompt_of: Callable[[dict], Any], chat: bool, given: Given = NOTHING
) -> RewardModel:
    """The reward model ``spec`` names (a directory, a Hub id from the Hub or the cache, or an object ``given`` to
    the Python API; ``@LABEL`` after it: the label read), on ``settings``' device and in its dtype, in eval mode
    with its gradients off. A spec that names no model, a causal LM's weights without a trained head, a head whose
    label is not named, a chat run with a tokenizer that has no chat template: one line (ConfigError or
    :class:`grpolab.common.hub.HubError`)."""
    source, label = split_label(spec)
    live = given.lookup(source, FLAG)
    if live is not None and isinstance(live[0], str):  # a path or id with the tokenizer to score with (TRL's)
        source, label = split_label(live[0])
        path, origin = _directory(source, spec)
        model, tokenizer = _load(path, settings, spec), live[1]
    elif live is not None:
        model, tokenizer = live
        if tokenizer is None:  # loaded from where the model was (TRL does the same)
            tokenizer = _tokenizer(_directory(model.config._name_or_path, spec)[0], spec)
        dtype = None if settings.dtype == "auto" else settings.torch_dtype()  # auto: the object's own
        model = model.to(settings.device, dtype)
        origin = None
    else:
        path, origin = _directory(source, spec)
        model, tokenizer = _load(path, settings, spec), _tokenizer(path, spec)
    model.eval().requires_grad_(False)
    config = model.config
    try:
        index = label_index(label, config.num_labels, config.id2label)
    except ValueError as e:
        raise ConfigError(f"{FLAG} {spec}: {e}") from None
    if tokenizer.pad_token_id is None:  # right padding needs one; the head finds each row's end by it
        if tokenizer.eos_token is None:
            raise ConfigError(f"{FLAG} {spec}: its tokenizer has neither a pad token nor an end-of-sequence token")
        tokenizer.pad_token = tokenizer.eos_token
    config.get_text_config().pad_token_id = tokenizer.pad_token_id
    if chat and not tokenizer.chat_template:
        raise ConfigError(f"{FLAG} {spec}: the run's prompts are chat messages and its tokenizer has no chat template")
    return RewardModel(model, tokenizer, prompt_of, label=index, batch_tokens=settings.batch_tokens,
                       name=model_name(spec), origin=origin)  # fmt: skip


def _directory(source: str, spec: str) -> tuple[Path, dict | None]:
    """``(directory, Hub record or None)`` of a reward model's ``source``: an existing directory, or a Hub id's
    files (downloaded, or from the cache offline)."""
    from grpolab.common.hub import MODEL_FILES_SKIPPED, is_hub_id, snapshot

    if is_hub_id(source):
        snap = snapshot(source, flag=FLAG, ignore_patterns=MODEL_FILES_SKIPPED)
        path, origin = snap.path, snap.record()
    else:
        path, origin = Path(source).expanduser(), None
        if not path.is_dir():
            raise ConfigError(f"{FLAG} {spec}: no such directory, nor a Hub id (org/name)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{FLAG} {spec}: {path} holds no model (no config.json)")
    return path, origin


def _load(path: Path, settings: RewardModelSettings, spec: str):
    """The sequence-classification model in ``path``; a ConfigError when its weights lack what the head needs
    (transformers would start those at random: a causal LM's directory, not a reward model)."""
    from transformers import AutoModelForSequenceClassification

    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=settings.torch_dtype(), output_loading_info=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"{FLAG} {spec}: cannot load a sequence-classification model: {str(e).splitlines()[0]}"
        ) from None
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"{FLAG} {spec}: its weights lack {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: not a "
            "trained sequence-classification model (transformers would start them at random)"
        )
    return model.to(settings.device)


def _tokenizer(path: Path | str, spec: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{FLAG} {spec}: cannot load its tokenizer: {str(e).splitlines()[0]}") from None
