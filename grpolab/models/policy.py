"""Load a policy (model + tokenizer) and turn records into prompt token ids."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.common.given import NOTHING, Given
from grpolab.data.jsonl import DataError
from grpolab.data.records import prompt_of
from grpolab.models.names import ASSET_DIR, BUILTIN, BUILTIN_VLM, VLM_ASSET_DIR  # noqa: F401 (re-exported)

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Work step by step, one short line per step, "
    "and end with a final line of the form '#### <answer>'."
)
MATH_SYSTEM_PROMPT = "Solve the problem step by step and put the final answer in \\boxed{}."


@dataclasses.dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    source: str
    """Where the weights came from (a path)."""
    origin: dict | None = None
    """The Hub repository the weights came from (id, revision, commit), when they did."""
    chat: bool = False
    """Prompt through the tokenizer's chat template (instruct models) instead of plain text."""
    text_as_is: bool = False
    """Each row by its prompt's own form, as TRL's trainer takes it (``--chat rows``): a prompt given as chat
    messages through the chat template, a prompt given as text tokenized as it is (no template, no system
    instruction, no few-shot examples, no newline added), its completions handed to reward functions as strings."""
    system: str = SYSTEM_PROMPT
    """The system instruction of chat prompts: how to format the final answer."""
    few_shot: list[dict] = dataclasses.field(default_factory=list)
    """Solved examples (question, answer) put before the question."""
    processor: object | None = None
    """A vision-language model's processor (images and text; ``tokenizer`` is its tokenizer); None for text models."""

    @property
    def family(self):
        """A vision-language model's adapter (:mod:`grpolab.vision.families`); None for a text model."""
        from grpolab.vision.families import family_of

        return family_of(self.model)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else pad

    def templated(self, record: dict) -> bool:
        """Whether ``record``'s prompt goes through the chat template: every record's in a chat run, except a text
        prompt's under :attr:`text_as_is`."""
        if not (self.chat and self.text_as_is):
            return self.chat
        return not isinstance(record.get("prompt", record.get("question")), str)

    def chat_messages(self, record: dict) -> list[dict]:
        """System instruction (when there is one), few-shot turns, then the question as the user turn. A record
        whose prompt is already a chat is used as it is, the system instruction put first only when it has none."""
        prompt = prompt_of(record)
        system = [{"role": "system", "content": self.system}] if self.system else []
        if isinstance(prompt, list):
            return (system if not any(m["role"] == "system" for m in prompt) else []) + list(prompt)
        msgs = system
        for ex in self.few_shot:
            msgs += [{"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]
        return msgs + [{"role": "user", "content": prompt}]

    def _text_prompt(self, record: dict) -> str:
        """The record's prompt, which must be text here: a chat's messages need the template this run does not use."""
        prompt = prompt_of(record)
        if not isinstance(prompt, str):
            off = "" if self.text_as_is else ", or --chat is off"
            raise DataError(f"a prompt given as chat messages needs a chat template: {self.source} has none{off}")
        return prompt

    def prompt_text(self, record: dict) -> str:
        """The plain-text prompt (no chat template): the few-shot examples (question, newline,
        answer, blank line), the question, newline."""
        shots = "".join(f"{ex['question']}\n{ex['answer']}\n\n" for ex in self.few_shot)
        return shots + self._text_prompt(record) + "\n"

    def shown_prompt(self, record: dict) -> str | list[dict]:
        """The prompt as the model is shown it: the chat messages for chat models, else the plain text (what TRL-form
        reward functions receive as ``prompts``)."""
        if self.templated(record):
            return self.chat_messages(record)
        return prompt_of(record) if self.text_as_is else self.prompt_text(record)

    def prompt_ids(self, record: dict) -> list[int]:
        """Chat models: the chat template with the generation prompt. Under :attr:`text_as_is`, a text prompt: the
        tokenizer's encoding of it, special tokens as the tokenizer adds them (TRL's ``processing_class(text=...)``).
        Others: BOS and :meth:`prompt_text`."""
        if self.templated(record):
            ids = self.tokenizer.apply_chat_template(
                self.chat_messages(record), add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in some versions
        if self.text_as_is:
            return list(self.tokenizer(self._text_prompt(record))["input_ids"])
        ids = self.tokenizer(self.prompt_text(record), add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + ids

    def prompt_inputs(self, record: dict) -> tuple[list[int], object | None]:
        """The prompt's ids and its images as the model takes them (a :class:`grpolab.vision.media.Media`; None for a
        text model or a record without images): :meth:`prompt_ids` for text models; for a vision-language model the
        processor's chat template over the record's messages with its images put in (TRL's forms:
        :mod:`grpolab.vision.processing`)."""
        if self.processor is None:
            return self.prompt_ids(record), None
        from grpolab.data.images import row_images
        from grpolab.data.records import question_of
        from grpolab.vision.processing import encode

        images = row_images(record, f"the row {question_of(record)[:60]!r}")
        return encode(self.processor, self.family, self.chat_messages(record), images)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Completion texts ``[N]`` from ids ``[N, T]``, special tokens removed."""
        return [self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True) for row, m in zip(ids, mask)]


def system_prompt_for(data_format: str, system_prompt: str = "") -> str:
    """The system instruction of chat prompts: ``--system-prompt`` when given; else for MATH data the \\boxed{}
    instruction, for prompt data none (the data's prompts say what they want), otherwise the '#### <answer>' one."""
    if system_prompt:
        return system_prompt
    return {"math": MATH_SYSTEM_PROMPT, "prompt": ""}.get(data_format, SYSTEM_PROMPT)


def _own_memory(model: torch.nn.Module) -> torch.nn.Module:
    """Give every parameter and buffer freshly allocated (64-byte aligned) storage of its own.

    safetensors can leave a loaded tensor as a view of the file at an 8-byte offset. CPU kernels may
    round differently for unaligned data, so the same weights loaded from a file and copied in memory
    (a resumed run's KL reference, the uninterrupted run's copy of the policy) would give log-probs
    that differ in the last bits. On a GPU, moving the model there already copied it.
    """
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cpu" and t.data_ptr() % 64:
            t.data = t.data.clone()
    return model


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn off every dropout of ``model`` (its ``nn.Dropout`` modules, and the ``attention_dropout`` rate that Llama-
    and Qwen-style attention applies functionally in training mode); returns how many were on.

    Why: the sampler runs the model in eval mode, so with dropout on in training the trainer's log-probs are of
    another, noisy distribution: the importance ratio is off 1 at mu = 1, and the KL gradient at the reference is
    not 0 (TRL's ``disable_dropout`` does the same for its policy). transformers has no switch for it.
    """
    on = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.p, on = 0.0, on + 1
        if isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0:
            m.attention_dropout, on = 0.0, on + 1
    return on


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing of every decoder layer (non-reentrant), under its new name where the
    installed version has it. The shared-prefix update keeps its cache under it (grpolab.models.shared_prefix)."""
    from grpolab.models.shared_prefix import keep_cache_under_checkpointing

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    keep_cache_under_checkpointing(model)


def checkpoint_dtype(spec: str, revision: str = "") -> str | None:
    """The dtype a model directory's (or Hub id's) config names for its weights ("bfloat16", "float32"; None for a
    GGUF file, a config that names none, or a directory without one): what transformers' ``dtype="auto"`` loads."""
    from grpolab.models.loading import resolve_gguf

    if resolve_gguf(spec, "", revision) is not None:
        return None
    path, _ = resolve_model_path(spec, revision)
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    dtype = data.get("dtype") or data.get("torch_dtype") or (data.get("text_config") or {}).get("dtype")
    return str(dtype).removeprefix("torch.") if dtype else None


def resolve_model_path(spec: str, revision: str = "", flag: str = "--model"):
    """``(directory, Hub snapshot or None)`` of ``spec``: ``builtin`` -> the shipped SFT warm start, an existing path
    -> itself, an ``org/name`` Hub id -> its files at ``revision`` (downloaded, or from the cache offline). The
    directory holds a model (config.json) or a LoRA adapter (adapter_config.json). ``flag``: the option that named it
    (--model, --teacher), for messages."""
    from grpolab.common.hub import MODEL_FILES_SKIPPED, is_hub_id, snapshot
    from grpolab.models.loading import gguf_flag

    if spec == BUILTIN:
        if not (ASSET_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in warm start is missing from {ASSET_DIR}; regenerate it with "
                f"`grpolab sft --out {ASSET_DIR}` (see grpolab/assets/arith-sft/README.md)"
            )
        return ASSET_DIR, None
    if spec == BUILTIN_VLM:
        return VLM_ASSET_DIR, None
    snap = (
        snapshot(spec, revision=revision, flag=flag, ignore_patterns=MODEL_FILES_SKIPPED) if is_hub_id(spec) else None
    )
    path = snap.path if snap else Path(spec).expanduser()
    if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
        what = f"{flag} {spec}: the Hub repository (commit {snap.commit}) holds" if snap else f"{flag} {spec!r}: not"
        raise FileNotFoundError(
            f"{what} a model directory (no config.json or adapter_config.json); use 'builtin', 'builtin-vlm', "
            f"'smollm2-135m-instruct', a Hugging Face model directory or Hub id, or a .gguf file (a GGUF repository: "
            f"{gguf_flag(flag)})"
        )
    return path, snap


def _load_directory(path: Path, dtype: torch.dtype):
    """Model and tokenizer of a model directory, or of a LoRA adapter's: its base (``base_model_name_or_path``, a
    path or a Hub id) with the adapter merged in, so that the run trains it like any model. A vision-language model
    (its config has a vision part) comes with its processor in place of the tokenizer."""
    if not (path / "config.json").is_file():
        import json

        from peft import PeftModel

        base_spec = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base_spec:
            raise FileNotFoundError(f"{path}/adapter_config.json names no base_model_name_or_path")
        base_path, _ = resolve_model_path(base_spec)
        model, tokenizer = _load_directory(base_path, dtype)
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(path)
        return PeftModel.from_pretrained(model, path).merge_and_unload(), tokenizer
    from transformers import AutoConfig

    from grpolab.vision.families import family_of

    if (family := family_of(AutoConfig.from_pretrained(path))) is not None:
        from transformers import AutoModelForImageTextToText

        from grpolab.vision.processing import load_processor

        processor = load_processor(path, family)
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype), processor
    tokenizer = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), tokenizer


def load_policy(
    spec: str,
    dtype: torch.dtype | None = None,
    *,
    gguf_file: str = "",
    revision: str = "",
    chat: str = "auto",
    few_shot: list[dict] | None = None,
    device: torch.device | str = "cpu",
    given: Given = NOTHING,
    flag: str = "--model",
) -> Policy:
    """Model and tokenizer from ``spec`` (see :mod:`grpolab.models.loading`), the model on ``device``; ``flag``: the
    option that named it, for messages (--model, --teacher).

    ``dtype`` None: fp32, the weights' dtype in every precision but bf16-true and 64-true (``grpolab.common.precision``;
    the run passes its own); a model object ``given`` to the Python API (as ``spec``) keeps its own dtype. Such an object is moved to ``device`` in
    place.
    ``chat``: ``"auto"`` uses the chat template when the tokenizer has one (instruct models)
    and the model is not the built-in one; ``"on"``/``"off"`` force it; ``"rows"`` decides per row, as TRL's trainer
    does: chat messages through the template, text as it is (:attr:`Policy.text_as_is`).
    """
    from grpolab.common.devices import prepare_device
    from grpolab.models.attention import use_grouped_sdpa
    from grpolab.models.loading import load_gguf, resolve_gguf

    device = torch.device(device)
    prepare_device(device)
    live = given.lookup(spec, flag)  # a model object given to the Python API: itself, not a copy
    gguf = None if spec == BUILTIN or live is not None else resolve_gguf(spec, gguf_file, revision, flag)
    origin = None
    if live is not None:
        model, tokenizer = live
        model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
        source = spec
    elif gguf is not None:
        dtype = dtype or torch.float32
        directory, file, snap = gguf
        model, tokenizer = load_gguf(directory, file, dtype=dtype)
        source, origin = str(directory / file), snap.record() if snap else None
    else:
        path, snap = resolve_model_path(spec, revision, flag)
        model, tokenizer = _load_directory(path, dtype or torch.float32)
        source, origin = str(path), snap.record() if snap else None
    model = _own_memory(model.to(device))
    use_grouped_sdpa(model)  # grouped heads without copying the keys and values under a mask (CPU)
    tokenizer, processor, use_chat = _prompting(model, tokenizer, source, chat, spec != BUILTIN)
    return Policy(model, tokenizer, source, origin, chat=use_chat, few_shot=list(few_shot or []), processor=processor,
                  text_as_is=chat == "rows")  # fmt: skip


def _prompting(model, loaded, source: str, chat: str, chat_by_default: bool):
    """(tokenizer, processor or None, whether prompts go through the chat template) of a model and what was loaded
    with it (``loaded``: its tokenizer, or a vision-language model's processor). ``chat``: auto, on or off."""
    from grpolab.config.train import ConfigError
    from grpolab.vision.families import family_of

    if chat not in ("auto", "on", "off", "rows"):
        raise ConfigError(f"--chat must be auto, on, off or rows, got {chat!r}")
    tokenizer, processor = loaded, None
    if family_of(model) is not None:  # a vision-language model: what came with it is its processor
        if not hasattr(loaded, "image_processor"):
            raise ConfigError(f"{source}: a vision-language model needs its processor (AutoProcessor), not a tokenizer")
        processor, tokenizer = loaded, loaded.tokenizer
        if chat == "off":
            raise ConfigError("--chat off: a vision-language model's prompts go through its processor's chat template")
    has_template = bool(getattr(processor or tokenizer, "chat_template", None))
    if processor is not None and not has_template:
        raise ConfigError(f"{source}: a vision-language model needs a chat template on its processor; it has none")
    if chat == "on" and not has_template:
        raise ConfigError(f"--chat on: the tokenizer of {source} has no chat template")
    return tokenizer, processor, has_template and (chat in ("on", "rows") or (chat == "auto" and chat_by_default))
