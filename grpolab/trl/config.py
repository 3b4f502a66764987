"""TRL's ``GRPOConfig`` by TRL 1.16's names and defaults, and its translation into grpolab's options.

``GRPOConfig`` is a dataclass made from the table of :mod:`grpolab.trl.fields`: every field TRL has (an unknown
keyword is a ``TypeError``, as TRL's dataclass gives), each with TRL's default. Its ``__post_init__`` resolves what
TRL's resolves (``bf16``, the generation batch) and refuses, in one ``ValueError`` line, a field grpolab does not do
when it is set to anything but TRL's default.

:func:`translate` turns a config into the options of ``grpolab train`` (:class:`grpolab.config.train.TrainConfig`'s
flat names): TRL's batch geometry (prompts per generation = per_device_train_batch_size x gradient_accumulation_steps
x processes / num_generations), its schedule and its objective, with the lines to say once in the log (the inert
fields that were set, what a precision ran as).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import logging
import math
import os
from typing import Any, NamedTuple

from grpolab.config.objective import TRL_AGGREGATION_LOSS_TYPES, TRL_LOSS_AGGREGATION
from grpolab.trl.fields import BY_NAME, FIELDS, PARSER_OPTIONS, help_text, types
from grpolab.trl.generation import sampling_options, unknown_generation_kwargs

SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
CORRECTIONS = {
    "token_truncate": "token-truncate",
    "token_mask": "token-mask",
    "sequence_truncate": "sequence-truncate",
    "sequence_mask": "sequence-mask",
}


def _refuse(name: str, value: Any, why: str, config: str = "GRPOConfig") -> ValueError:
    return ValueError(f"{config}.{name}={value!r}: {why} (grpolab.trl; docs/coming-from-trl.md)")


def refusal(config, name: str, value: Any, why: str) -> ValueError:
    """The one-line ValueError refusing ``config``'s field ``name`` set to ``value``, saying ``why``."""
    return _refuse(name, value, why, type(config).__name__)


def _differs(name: str, value: Any, use_cpu: bool = False, table: dict | None = None) -> bool:
    """``value`` is not TRL's default for ``name`` (in ``table``, GRPOConfig's by default), as given or as TRL's
    __post_init__ reads it (``use_cpu``: the config's, which turns pinned memory off)."""
    default = (table or BY_NAME)[name].default
    if name == "dataloader_pin_memory" and use_cpu:
        default = False
    read = NORMALISE.get(name)
    return value != default and (read is None or value != read(default))


# The dict fields a command line gives as JSON strings (TrainingArguments' own, those TRL's configs add).
GRPO_DICT_FIELDS = ("model_init_kwargs", "transformers_continuous_batching_config", "generation_kwargs",
                    "chat_template_kwargs", "teacher_model_init_kwargs")  # fmt: skip


def _scalar(text: str):
    """A JSON object's string value as transformers reads it from a command line: "true"/"false", digits, a decimal."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.isdigit():
        return int(text)
    if text.replace(".", "", 1).isdigit():
        return float(text)
    return text


def _json_object(value):
    """A dict field given as a JSON object in a string (a command line's, a YAML recipe's) as the dict, its string
    values read as transformers reads them; a string that is not an object stays (a file's path)."""
    if not (isinstance(value, str) and value.startswith("{")):
        return value

    def typed(d: dict) -> dict:
        return {k: typed(v) if isinstance(v, dict) else _scalar(v) if isinstance(v, str) else v for k, v in d.items()}

    return typed(json.loads(value))


def _report_to(value):
    if value in ("all", ["all"]):
        from transformers.integrations import get_available_reporting_integrations

        return get_available_reporting_integrations()
    if value in ("none", ["none"]):
        return []
    return value if isinstance(value, list) else [value]


def _debug(value):
    from transformers.debug_utils import DebugOption

    if isinstance(value, str):
        return [DebugOption(s) for s in value.split()]
    return [] if value is None else value


def _pad_to_multiple_of(value):
    if isinstance(value, str) and value != "auto":
        return None if value.lower() in ("none", "null") else int(value)
    return None if value == "auto" else value  # "auto": 128 on Neuron devices only, which grpolab does not run on


def _accelerator_config(value):
    from transformers.trainer_pt_utils import AcceleratorConfig

    if value is None:
        value = AcceleratorConfig()
    elif isinstance(value, dict):
        value = AcceleratorConfig(**value)
    elif not isinstance(value, AcceleratorConfig):
        value = AcceleratorConfig.from_json_file(value)
    value.pop("use_configured_state", None)  # read and removed by transformers' device setup (grpolab has none)
    return value


NORMALISE: dict[str, Any] = {
    "include_num_input_tokens_seen": lambda v: ("all" if v else "no") if isinstance(v, bool) else v,
    "report_to": _report_to,
    "debug": _debug,
    "pad_to_multiple_of": _pad_to_multiple_of,
    "accelerator_config": _accelerator_config,
}
"""How TRL's __post_init__ (transformers' TrainingArguments' and its own) reads a field's value, where it reads it
otherwise than as given: a config built here holds what TRL's would hold for the same arguments (a test compares
them field by field). Written here, not inherited: TrainingArguments' __post_init__ also sets up accelerate's state
and the device, which grpolab does itself."""


def post_init(self) -> None:
    """What TRL's __post_init__ resolves, and the refusals."""
    from transformers import TrainingArguments

    for name in (*TrainingArguments._VALID_DICT_FIELDS, *GRPO_DICT_FIELDS):
        if hasattr(self, name):  # a config without the field (DistillationConfig has no continuous batching)
            setattr(self, name, _json_object(getattr(self, name)))
    config, table = type(self).__name__, type(self)._trl_table
    for f in table.values():
        value = getattr(self, f.name)
        if f.kind == "refused" and _differs(f.name, value, table=table) and value not in f.accepts:
            raise _refuse(f.name, value, f.note, config)
    if other := unknown_generation_kwargs(getattr(self, "generation_kwargs", None), table.get("generation_kwargs")):
        raise _refuse("generation_kwargs", other, table["generation_kwargs"].note, config)
    for name, read in NORMALISE.items():
        setattr(self, name, read(getattr(self, name)))
    if self.disable_tqdm is None:  # transformers: no progress bar when its log says less than warnings
        self.disable_tqdm = logging.getLogger("transformers.training_args").getEffectiveLevel() > logging.WARN
    if self.use_cpu:
        self.dataloader_pin_memory = False
    if self.bf16 is None:  # TRL: bf16 unless fp16
        self.bf16 = not self.fp16
    if self.fp16 and self.bf16:
        raise ValueError(f"{config}: at most one of fp16 and bf16 can be True")
    if isinstance(getattr(self, "scale_rewards", None), bool):  # TRL takes True/False for group/none
        self.scale_rewards = "group" if self.scale_rewards else "none"
    if self.output_dir is None:
        self.output_dir = "trainer_output"
    if getattr(self, "vllm_importance_sampling_cap", None) is not None:  # TRL's deprecated name (GRPO's)
        self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
    if hasattr(self, "num_generations"):  # GRPO's and RLOO's groups (TRL's distillation samples one a prompt)
        _generation_batch(self, config)


def _generation_batch(self, config: str) -> None:
    """TRL's resolution of the generation batch (``generation_batch_size``, ``steps_per_generation``) and its checks
    against ``num_generations``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = self.per_device_train_batch_size * world
    if self.generation_batch_size is not None and self.steps_per_generation is not None:
        raise ValueError(f"{config}: generation_batch_size and steps_per_generation can not both be set")
    if self.steps_per_generation is None and self.generation_batch_size is None:
        self.steps_per_generation = self.gradient_accumulation_steps
    elif self.steps_per_generation is None:
        if self.generation_batch_size % per_step:
            raise ValueError(
                f"{config}: generation_batch_size ({self.generation_batch_size}) must be divisible by the global "
                f"batch size ({per_step})"
            )
        self.steps_per_generation = self.generation_batch_size // per_step
    self.generation_batch_size = per_step * self.steps_per_generation
    if self.generation_batch_size % self.num_generations:
        raise ValueError(
            f"{config}: generation_batch_size ({self.generation_batch_size}) must be divisible by num_generations "
            f"({self.num_generations})"
        )
    if self.num_generations < 2:
        raise ValueError(f"{config}: num_generations must be >= 2 to compare a group, got {self.num_generations}")


def _to_dict(self) -> dict[str, Any]:
    """Every field by name, as transformers' ``TrainingArguments.to_dict`` gives it: enums as their values, a
    ``*_token`` field's value hidden as ``<FIELD_TOKEN>``, nested configs as their own dicts."""
    out = {}
    for f in dataclasses.fields(self):
        value = getattr(self, f.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, list) and value and isinstance(value[0], enum.Enum):
            value = [v.value for v in value]
        elif hasattr(value, "to_dict") and not isinstance(value, dict):  # an AcceleratorConfig, a quantization one
            value = value.to_dict()
        if f.name.endswith("_token"):
            value = f"<{f.name.upper()}>"
        out[f.name] = value
    return out


def _to_json_string(self) -> str:
    """:meth:`to_dict` as indented JSON, as transformers writes it."""
    return json.dumps(self.to_dict(), indent=2)


def make_config_class(name: str, fields: tuple, annotations: dict, doc: str) -> type:
    """A dataclass named ``name`` with a field per entry of ``fields`` (a table of :mod:`grpolab.trl.fields`' kind),
    each of TRL's type (``annotations``) and default, and what TRL's __post_init__ resolves and grpolab refuses."""
    specs = []
    for f in fields:
        default = f.default
        metadata = {"help": help_text(f), **PARSER_OPTIONS.get(f.name, {})}
        spec = (
            dataclasses.field(default_factory=lambda d=default: copy.copy(d), metadata=metadata)
            if isinstance(default, list | dict)
            else dataclasses.field(default=default, metadata=metadata)
        )
        specs.append((f.name, annotations[f.name], spec))
    namespace = {"__post_init__": post_init, "to_dict": _to_dict, "to_json_string": _to_json_string}
    namespace["_trl_table"] = {f.name: f for f in fields}  # read by __post_init__; no dataclass field
    cls = dataclasses.make_dataclass(name, specs, namespace=namespace)
    cls.__module__ = __name__
    cls.__doc__ = doc
    return cls


GRPOConfig = make_config_class(
    "GRPOConfig",
    FIELDS,
    types(),
    "TRL 1.16's GRPOConfig: every field by TRL's name and with TRL's default (grpolab.trl.fields says what each "
    "becomes). An unknown keyword is a TypeError; a field grpolab does not do, set to anything but TRL's "
    "default, is a ValueError of one line.",
)


class Translation(NamedTuple):
    """A config as grpolab's options."""

    options: dict
    """``grpolab train`` options by their flat names."""
    notes: list[str]
    """Lines to say once in the log: inert fields that were set, what a precision ran as, a rounded step count."""
    optimizer_steps_per_step: int
    """TRL's optimizer steps in one grpolab step (a generation): num_iterations x steps_per_generation /
    gradient_accumulation_steps."""
    log_every: int
    """grpolab steps between two log_history entries (0: never)."""
    steps_per_epoch: int
    """grpolab steps in one pass over the training rows (0: no training rows)."""


def translate(
    args,
    world_size: int = 1,
    train_rows: int | None = None,
    has_eval: bool = False,
    device: str | None = None,
    checkpoint_dtype: str | None = None,
    resumes: bool = False,
) -> Translation:
    """grpolab's options for ``args`` on ``world_size`` processes; ``train_rows``: the training data's rows (for
    num_train_epochs; None: no data); ``has_eval``: whether an eval_dataset is given; ``device``: where it runs
    (None: CUDA where torch sees one, as transformers picks); ``checkpoint_dtype``: the model's own dtype, which
    ``model_init_kwargs={"dtype": "auto"}`` asks for; ``resumes``: ``train`` was given ``resume_from_checkpoint`` (as
    TRL's scripts pass ``args.resume_from_checkpoint``, which is then not a field left unread)."""
    inert = [f for f in _inert_set(args) if not (resumes and f.name == "resume_from_checkpoint")]
    notes = [f"{f.name}={getattr(args, f.name)!r} has no effect here: {f.note}" for f in inert]
    geometry, per_epoch = _geometry(args, world_size, train_rows, notes)
    steps = geometry["steps"]
    per_step = geometry["mu"] * geometry["minibatches"]  # optimizer steps in one grpolab step (mu: its iterations)
    options = {**geometry, **_schedule(args, steps * per_step)}
    options |= _objective(args) | _generation(args) | _model(args, checkpoint_dtype)
    options |= _precision(args, device, notes, checkpoint_dtype)
    every = _every(args.logging_strategy, args.logging_steps, steps, per_step, per_epoch)
    options |= _checkpoints(args, steps, per_step, per_epoch)
    options |= _evaluation(args, steps, per_step, per_epoch, has_eval, every)
    options |= _logging(args, every, notes) | _sharding(args)
    return Translation(options, notes, per_step, every, per_epoch)


def to_options(args, world_size: int = 1, train_rows: int | None = None, has_eval: bool = False) -> dict:
    """grpolab's options for ``args`` (:func:`translate`'s ``options``)."""
    return translate(args, world_size, train_rows, has_eval).options


def _inert_set(args) -> list:
    return [f for f in FIELDS if f.kind == "inert" and _differs(f.name, getattr(args, f.name), args.use_cpu)]


def _fraction_or_count(value: float, total: int) -> int:
    """transformers' rule for logging, saving, evaluation and warm-up steps: a value < 1 is a fraction of ``total``."""
    return math.ceil(value * total) if 0 < value < 1 else int(value)


def _geometry(args, world_size: int, train_rows: int | None, notes: list[str]) -> tuple[dict, int]:
    """Prompts per step, mu, the number of steps (generations), the micro-batch and the data's order; and the steps
    of one epoch over ``train_rows`` (0 without rows)."""
    G, per_device = args.num_generations, args.per_device_train_batch_size
    accum, spg = args.gradient_accumulation_steps, args.steps_per_generation
    if spg % accum:
        raise _refuse(
            "steps_per_generation",
            spg,
            f"must be a multiple of gradient_accumulation_steps ({accum}) here: a generation feeds whole optimizer steps",
        )
    completions = per_device * world_size * spg  # the generation batch, all processes
    prompts = completions // G
    mu, minibatches = args.num_iterations, spg // accum  # optimizer steps a generation: mu x minibatches
    if args.max_steps > 0:
        steps = math.ceil(args.max_steps / (mu * minibatches))
        if steps * mu * minibatches != args.max_steps:
            notes.append(
                f"max_steps={args.max_steps} is not a multiple of the {mu * minibatches} optimizer steps a generation "
                f"takes: {steps * mu * minibatches} optimizer steps ({steps} generations)"
            )
        per_epoch = (train_rows // prompts) if train_rows else 0
    else:
        if not train_rows:
            raise _refuse("max_steps", args.max_steps, "num_train_epochs needs a train_dataset: give max_steps")
        per_epoch = train_rows // prompts
        if per_epoch == 0:
            raise ValueError(
                f"GRPOConfig: the train_dataset's {train_rows} rows are fewer than one generation's {prompts} prompts"
            )
        steps = max(1, math.ceil(args.num_train_epochs * per_epoch))
    rollouts_per_rank = completions // world_size
    micro = per_device if per_device < rollouts_per_rank else 0
    order = "shuffle" if args.shuffle_dataset else "sequential"
    return {
        "prompts_per_step": prompts,
        "group_size": G,
        "mu": mu,
        "minibatches": minibatches,
        "steps": steps,
        "micro_batch": micro,
        "data_order": order if train_rows else "replacement",
    }, per_epoch


def _schedule(args, optimizer_steps: int) -> dict:
    kind = args.lr_scheduler_type
    kind = getattr(kind, "value", kind)  # transformers' SchedulerType
    if kind not in SCHEDULES:
        raise _refuse("lr_scheduler_type", kind, f"grpolab's schedules are {', '.join(SCHEDULES)}")
    warmup = _fraction_or_count(args.warmup_steps, optimizer_steps)
    if kind == "constant":  # transformers' constant schedule has no warm-up
        warmup = 0
    if args.optim not in ("adamw_torch", "adamw_torch_fused"):
        raise _refuse("optim", args.optim, "grpolab's optimizer is torch's AdamW (adamw_torch, adamw_torch_fused)")
    return {
        "lr": args.learning_rate,
        "lr_schedule": SCHEDULES[kind],
        "warmup_steps": warmup,
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm,
    }


def _objective(args) -> dict:
    loss = args.loss_type
    if loss not in TRL_LOSS_AGGREGATION:
        raise _refuse("loss_type", loss, f"TRL's loss types are {', '.join(TRL_LOSS_AGGREGATION)}")
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    out = {
        "aggregation": TRL_LOSS_AGGREGATION[loss],
        "loss_type": "clip" if loss in TRL_AGGREGATION_LOSS_TYPES else loss,  # else a policy term of grpolab's
        "clip_low": args.epsilon,
        "clip_high": eps_high,
        "clip_delta": args.delta or 0.0,
        "beta": args.beta,
        "kl": "k3",
        "kl_ratio": bool(args.use_bias_correction_kl),
        "importance_sampling": args.importance_sampling_level,
        "mask_truncated": bool(args.mask_truncated_completions),
        "top_entropy_quantile": args.top_entropy_quantile,
        "off_policy_mask_threshold": args.off_policy_mask_threshold or 0.0,
        "sapo_temperature_pos": args.sapo_temperature_pos,
        "sapo_temperature_neg": args.sapo_temperature_neg,
        "vespo_k_pos": args.vespo_k_pos,
        "vespo_lambda_pos": args.vespo_lambda_pos,
        "vespo_k_neg": args.vespo_k_neg,
        "vespo_lambda_neg": args.vespo_lambda_neg,
        "entropy_coef": args.entropy_coef,
        "adaptive_entropy": bool(args.use_adaptive_entropy),
        "entropy_target": args.entropy_target,
        "entropy_coef_delta": args.entropy_coef_delta,
        "entropy_coef_min": args.entropy_coef_min,
        "entropy_coef_max": args.entropy_coef_max,
    }
    if loss == "cispo":  # TRL's epsilon_high is CISPO's cap on the weight; the clip itself is not used
        out["cispo_cap"] = eps_high
    scale = args.scale_rewards
    if scale not in ("group", "batch", "none"):
        raise _refuse("scale_rewards", scale, "group, batch or none (True, False)")
    aggregation = {"sum_then_normalize": "sum-then-normalize", "normalize_then_sum": "normalize-then-sum"}
    if args.multi_objective_aggregation not in aggregation:
        raise _refuse("multi_objective_aggregation", args.multi_objective_aggregation, "sum_then_normalize or "
                      "normalize_then_sum")  # fmt: skip
    out["reward_normalisation"] = aggregation[args.multi_objective_aggregation]
    if out["reward_normalisation"] == "normalize-then-sum":  # GDPO is its own advantage: grpolab's defaults
        out |= {"estimator": "grpo_std", "scale_rewards": "group"}
    else:
        out |= {"estimator": "grpo" if scale == "none" else "grpo_std", "scale_rewards": scale if scale != "none"
                else "group"}  # fmt: skip
        if scale != "none":
            out["reward_std"] = "sample"  # TRL divides by torch's std: n - 1
    if args.reward_weights is not None:
        out["reward_weights"] = tuple(float(w) for w in args.reward_weights)
    return out


def _generation(args) -> dict:
    out = {
        "max_new_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        **sampling_options(args),
        "rollout_engine": "vllm" if args.use_vllm else "hf",
        "engine_correction": "none",  # TRL corrects vLLM's mismatch only (below); its own generate samples as it trains
        "keep_dropout": not args.disable_dropout,
        "fp32_head": bool(args.cast_lm_head_to_fp32),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "seed": args.seed,
    }
    if args.max_tool_calling_iterations is not None:
        out["max_turns"] = args.max_tool_calling_iterations + 1  # grpolab counts replies, the last without a call
    if args.num_generations_eval is not None:
        out["eval_samples"] = args.num_generations_eval
    if args.use_vllm:
        out |= {"vllm_memory": args.vllm_gpu_memory_utilization, "vllm_sleep": bool(args.vllm_enable_sleep_mode)}
        if args.vllm_max_model_length is not None:
            out["vllm_max_len"] = args.vllm_max_model_length
        mode = args.vllm_importance_sampling_mode
        if mode not in CORRECTIONS:
            raise _refuse("vllm_importance_sampling_mode", mode, f"one of {', '.join(CORRECTIONS)}")
        out["engine_correction"] = CORRECTIONS[mode] if args.vllm_importance_sampling_correction else "none"
        out["engine_correction_cap"] = args.vllm_importance_sampling_clip_max
    return out


# model_init_kwargs keys that change nothing trained (TRL's ModelConfig fills several of them in every script): a
# kernel's choice (grpolab picks sdpa, flash-attention on GPUs), where and how the weights are loaded.
LOADING_KEYS = ("attn_implementation", "device_map", "low_cpu_mem_usage")


def asks_checkpoint_dtype(args) -> bool:
    """Whether ``model_init_kwargs`` asks for the checkpoint's own dtype: ``"auto"``, or None as TRL's scripts pass it
    (no dtype given at all means float32)."""
    kwargs = dict(args.model_init_kwargs or {})
    return kwargs.get("dtype", kwargs.get("torch_dtype", "float32")) in ("auto", None)


def model_dtype(args, checkpoint_dtype: str | None = None) -> str:
    """The dtype ``model_init_kwargs`` asks the weights in ("float32" unless given); the checkpoint's own
    (``checkpoint_dtype``, its config's; float32 when it names none) where it asks for that."""
    if asks_checkpoint_dtype(args):
        return checkpoint_dtype or "float32"
    kwargs = dict(args.model_init_kwargs or {})
    return str(kwargs.get("dtype", kwargs.get("torch_dtype", "float32"))).removeprefix("torch.")


def _model(args, checkpoint_dtype: str | None = None) -> dict:
    out: dict = {"chat": "rows"}  # TRL's rule: chat messages through the template, a text prompt as it is
    kwargs = dict(args.model_init_kwargs or {})
    if "revision" in kwargs:
        revision = kwargs.pop("revision")
        if revision not in (None, "main"):
            out["revision"] = str(revision)
    for key in LOADING_KEYS:
        kwargs.pop(key, None)
    if kwargs.pop("trust_remote_code", False):
        raise _refuse("model_init_kwargs", {"trust_remote_code": True}, "grpolab runs no code from a model's files")
    for key in ("dtype", "torch_dtype"):  # read by model_dtype
        kwargs.pop(key, None)
    dtype = model_dtype(args, checkpoint_dtype)
    if dtype == "bfloat16":  # TRL trains the bf16 weights with plain AdamW
        out |= {"precision": "bf16-true", "compensation": "none"}
    elif dtype != "float32":
        raise _refuse("model_init_kwargs", {"dtype": dtype}, "dtype float32 or bfloat16")
    if kwargs:
        raise _refuse(
            "model_init_kwargs",
            kwargs,
            f"grpolab takes revision, dtype, trust_remote_code=False and {', '.join(LOADING_KEYS)}",
        )
    return out


def _precision(args, device: str | None, notes: list[str], checkpoint_dtype: str | None = None) -> dict:
    """bf16/fp16 as --precision: bf16-mixed where the device computes bf16, 16-mixed on CUDA; else 32-true, said."""
    import torch

    from grpolab.common.machine import machine
    from grpolab.common.precision import bf16_units

    where = torch.device("cpu" if args.use_cpu else device or ("cuda" if machine().gpu() else "cpu"))
    out = {"device": "cpu" if args.use_cpu else (device or "auto")}
    if model_dtype(args, checkpoint_dtype) == "bfloat16":
        return out  # the weights themselves are bf16 (_model)
    if args.bf16:
        if bf16_units(where):
            out["precision"] = "bf16-mixed"
        else:
            out["precision"] = "32-true"
            notes.append(f"bf16=True: {where.type} computes no bf16 here; training in fp32 (precision 32-true)")
    elif args.fp16:
        if where.type == "cuda":
            out["precision"] = "16-mixed"
        else:
            out["precision"] = "32-true"
            notes.append("fp16=True: fp16 autocast with a gradient scaler needs CUDA; training in fp32 (32-true)")
    else:
        out["precision"] = "32-true"
    return out


def set_tf32(args) -> None:
    """TRL's ``tf32``: torch's TF32 matmuls on CUDA on or off, set when a run starts (:meth:`GRPOTrainer.train`), as
    transformers sets it in its device setup; nothing on a CPU run or when left None."""
    import torch

    if args.tf32 is None or args.use_cpu or not torch.cuda.is_available():
        return
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)


def _every(strategy, value, steps: int, per_step: int, per_epoch: int) -> int:
    """grpolab steps between two events of a transformers interval strategy (``no``: 0)."""
    strategy = getattr(strategy, "value", strategy)
    if strategy == "no":
        return 0
    if strategy == "epoch":
        return max(per_epoch, 1)
    if strategy != "steps":
        raise ValueError(f"GRPOConfig: interval strategy {strategy!r}: grpolab takes no, steps or epoch")
    optimizer_steps = _fraction_or_count(value, steps * per_step)
    return max(1, math.ceil(optimizer_steps / per_step))


def _checkpoints(args, steps: int, per_step: int, per_epoch: int) -> dict:
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy == "best":
        raise _refuse("save_strategy", "best", "grpolab keeps the last weights; pick a checkpoint with grpolab eval")
    out = {"save_every": _every(strategy, args.save_steps, steps, per_step, per_epoch), "out": str(args.output_dir)}
    if args.save_total_limit is not None:
        out["keep_checkpoints"] = int(args.save_total_limit)
    return out


def _evaluation(args, steps: int, per_step: int, per_epoch: int, has_eval: bool, log_every: int) -> dict:
    """With an eval_dataset: held-out accuracy at the start, every eval interval and the end; without one, none (TRL
    trains on every row and evaluates nothing)."""
    if not has_eval:
        return {"eval_fraction": 0.0, "eval_every": 0}
    strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
    if strategy == "steps" and args.eval_steps is None:
        return {"eval_every": log_every}
    return {"eval_every": _every(strategy, args.eval_steps or 0, steps, per_step, per_epoch)}


def _sharding(args) -> dict:
    """fsdp: 'full_shard' (with or without 'auto_wrap') is FSDP2 over the processes."""
    value = args.fsdp
    modes = value.split() if isinstance(value, str) else [getattr(v, "value", v) for v in value or []]
    if not modes:
        return {}
    if "full_shard" not in modes or set(modes) - {"full_shard", "auto_wrap"}:
        raise _refuse("fsdp", value, "grpolab's FSDP2 shards fully: 'full_shard' (with or without 'auto_wrap')")
    return {"fsdp": True}


def _logging(args, every: int, notes: list[str]) -> dict:
    reporters = args.report_to
    reporters = [reporters] if isinstance(reporters, str) else list(reporters or [])
    out = {"log_every": max(every, 1), "log_rollouts": bool(args.log_completions)}
    if args.disable_tqdm:
        out["progress"] = False
    for name in reporters:
        if name in ("tensorboard", "wandb"):
            out[name] = True
        elif name not in ("none", "all"):
            notes.append(f"report_to={name!r} has no effect here: grpolab logs to tensorboard and wandb (offline)")
        elif name == "all":
            out |= {"tensorboard": True, "wandb": True}
    return out
