"""Every field of TRL 1.16's ``GRPOConfig`` (its ``TrainingArguments`` included), by TRL's name and default, and what
grpolab does with it: one table.

Each field is one of three kinds:

- ``mapped``: it becomes a grpolab option of the same meaning (:func:`grpolab.trl.config.to_options` converts it;
  ``to`` names the option or the place it goes);
- ``inert``: accepted without effect, because it does not change what is trained (a data loader's workers, a Hub
  token, a log level); a value other than TRL's default is said once in the log;
- ``refused``: grpolab does not do it; a value other than TRL's default is one ``ValueError`` line naming the field
  and ``why``.

``docs/coming-from-trl.md``'s field table is generated from this one (``python -m grpolab.trl.fields``), and a test
holds it against TRL's own dataclass, so that a field TRL adds fails the test until it is classified here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

Kind = Literal["mapped", "inert", "refused"]


@dataclasses.dataclass(frozen=True)
class TrlField:
    """One field of TRL's GRPOConfig."""

    name: str
    default: Any
    """TRL 1.16's default (a list default is copied per config)."""
    kind: Kind
    to: str = ""
    """mapped: the grpolab option(s) or place it goes."""
    note: str = ""
    """mapped: how it converts; inert: why it changes nothing trained; refused: why grpolab refuses it."""
    accepts: tuple = ()
    """refused: the values grpolab takes besides TRL's default (a default grpolab cannot do is refused where the run
    starts, so that the config itself still builds with TRL's defaults)."""


def _m(name, default, to, note=""):
    return TrlField(name, default, "mapped", to, note)


def _i(name, default, note):
    return TrlField(name, default, "inert", "", note)


def _r(name, default, note, accepts=()):
    return TrlField(name, default, "refused", "", note, accepts)


_LOADER = "data loading: grpolab reads the rows itself"
_LOG = "logging only"
_HUB = "used by push_to_hub()"
_DDP = "torch.distributed's settings are grpolab's own (DDP or FSDP2, NCCL on CUDA, gloo on the CPU)"
_EVAL = "evaluation's mechanics: grpolab draws and batches an evaluation its own way (docs/coming-from-trl.md)"
_VLLM_SERVER = "only with vllm_mode='server', which grpolab refuses (it runs vLLM in the trainer's process)"
_NO_EFFECT_GRPO = "TRL's GRPO loss does not read it either"

FIELDS: tuple[TrlField, ...] = (
    # ---------------------------------------------------------------- TrainingArguments: the run and its length
    _m("output_dir", None, "out", "None: 'trainer_output', as transformers"),
    _m("per_device_train_batch_size", 8, "prompts_per_step", "completions per device per micro-step (the geometry)"),
    _m("num_train_epochs", 3.0, "steps", "with max_steps = -1: epochs over the training rows"),
    _m(
        "max_steps",
        -1,
        "steps",
        "optimizer steps; grpolab's steps are generations (max_steps / optimizer steps a generation)",
    ),
    _m("learning_rate", 1e-6, "lr"),
    _m("lr_scheduler_type", "linear", "lr_schedule", "linear, cosine, constant, constant_with_warmup"),
    _r("lr_scheduler_kwargs", None, "the schedules take no arguments here"),
    _m("warmup_steps", 0, "warmup_steps", "a value < 1 is a fraction of the optimizer steps, as transformers"),
    _m("optim", "adamw_torch_fused", "AdamW", "adamw_torch and adamw_torch_fused: torch's AdamW; no other optimizer"),
    _r("optim_args", None, "grpolab's AdamW takes no extra arguments"),
    _m("weight_decay", 0.0, "weight_decay"),
    _r("adam_beta1", 0.9, "grpolab's AdamW has betas (0.9, 0.999)"),
    _r("adam_beta2", 0.999, "grpolab's AdamW has betas (0.9, 0.999)"),
    _r("adam_epsilon", 1e-8, "grpolab's AdamW has eps 1e-8"),
    _r("optim_target_modules", None, "for GaLore-style optimizers, which grpolab does not build"),
    _m("gradient_accumulation_steps", 1, "prompts_per_step", "the geometry; accumulation never changes the gradient"),
    _i("average_tokens_across_devices", True, "GRPO's loss computes its own normalisers"),
    _m("max_grad_norm", 1.0, "max_grad_norm"),
    _i("label_smoothing_factor", 0.0, _NO_EFFECT_GRPO),
    # ---------------------------------------------------------------- precision and compute
    _m("bf16", None, "precision", "None or True: bf16-mixed where the device computes bf16, else 32-true (said once)"),
    _m("fp16", False, "precision", "16-mixed on CUDA (a gradient scaler); on a CPU, 32-true (said once)"),
    _i("bf16_full_eval", False, "evaluation runs in the training precision"),
    _i("fp16_full_eval", False, "evaluation runs in the training precision"),
    _m("tf32", None, "torch.backends", "True/False sets torch's TF32 matmuls on CUDA before training"),
    _m("gradient_checkpointing", True, "gradient_checkpointing"),
    _r("gradient_checkpointing_kwargs", None, "grpolab checkpoints each decoder layer with transformers' defaults"),
    _r("torch_compile", False, "grpolab's training forward is not compiled"),
    _r("torch_compile_backend", None, "grpolab's training forward is not compiled"),
    _r("torch_compile_mode", None, "grpolab's training forward is not compiled"),
    _r("use_liger_kernel", False, "grpolab computes the log-probs in its own chunked fp32 head, not Liger's kernel"),
    _r("liger_kernel_config", None, "grpolab computes the log-probs in its own chunked fp32 head, not Liger's kernel"),
    _i("use_cache", False, "the training forward keeps no cache; the samplers keep their own"),
    _r("neftune_noise_alpha", None, "NEFTune's embedding noise is for supervised fine-tuning; not built"),
    _i("torch_empty_cache_steps", None, "memory housekeeping only"),
    _r("auto_find_batch_size", False, "TRL refuses it too: a halved batch would split groups"),
    # ---------------------------------------------------------------- logging
    _m("logging_strategy", "steps", "log_history", "steps: every logging_steps; epoch; no"),
    _m("logging_steps", 10, "log_history, log_every", "a value < 1 is a fraction of the steps"),
    _m("logging_first_step", False, "log_history"),
    _i("log_on_each_node", True, "only rank 0 logs"),
    _i("logging_nan_inf_filter", True, _LOG),
    _i("include_num_input_tokens_seen", "no", _LOG),
    _i("log_level", "passive", _LOG),
    _i("log_level_replica", "warning", _LOG),
    _m("disable_tqdm", None, "progress"),
    _m("report_to", "none", "tensorboard, wandb", "tensorboard and wandb (offline); others are said once and skipped"),
    _i("run_name", None, _LOG),
    _i("project", "huggingface", _LOG),
    _i("trackio_space_id", None, _LOG),
    _i("trackio_bucket_id", None, _LOG),
    _i("trackio_static_space_id", None, _LOG),
    # ---------------------------------------------------------------- evaluation
    _m("eval_strategy", "no", "eval_every", "no: at the start and the end only (with an eval_dataset); steps; epoch"),
    _m("eval_steps", None, "eval_every", "None: logging_steps, as transformers; a value < 1 is a fraction"),
    _i("eval_delay", 0, _EVAL),
    _m(
        "per_device_eval_batch_size",
        8,
        "evaluate()",
        "rows of one evaluation batch, whose metrics an evaluation averages (TRL's)",
    ),
    _i("prediction_loss_only", False, _EVAL),
    _i("eval_on_start", False, "grpolab evaluates at step 0 whenever it evaluates"),
    _i("eval_do_concat_batches", True, _EVAL),
    _i("eval_use_gather_object", False, _EVAL),
    _i("eval_accumulation_steps", None, _EVAL),
    _i("include_for_metrics", [], _EVAL),
    _i("batch_eval_metrics", False, _EVAL),
    # ---------------------------------------------------------------- checkpoints and the Hub
    _i("save_only_model", False, "grpolab's checkpoints always hold the optimizer and random state (exact resume)"),
    _m("save_strategy", "steps", "save_every", "steps: every save_steps; epoch; no (the last step is still saved)"),
    _m("save_steps", 500, "save_every", "optimizer steps; a value < 1 is a fraction of the steps"),
    _i("save_on_each_node", False, "rank 0 saves"),
    _m("save_total_limit", None, "keep_checkpoints"),
    _i("enable_jit_checkpoint", False, "grpolab always saves the step on SIGTERM and SIGINT"),
    _m("push_to_hub", False, "push_to_hub()", "pushes output_dir after training"),
    _m("hub_token", None, "push_to_hub()", _HUB),
    _m("hub_private_repo", None, "push_to_hub()", _HUB),
    _m("hub_model_id", None, "push_to_hub()", _HUB),
    _i("hub_strategy", "every_save", "push_to_hub() pushes the finished run"),
    _i("hub_always_push", False, "push_to_hub() pushes the finished run"),
    _m("hub_revision", None, "push_to_hub()", _HUB),
    _r("load_best_model_at_end", False, "grpolab keeps the last weights; pick a checkpoint with grpolab eval"),
    _i("metric_for_best_model", None, "read only with load_best_model_at_end"),
    _i("greater_is_better", None, "read only with load_best_model_at_end"),
    _i("ignore_data_skip", False, "a resumed run draws each step's prompts from the step's own key"),
    _i("restore_callback_states_from_checkpoint", False, "callbacks keep their own state"),
    _i("full_determinism", False, "every rollout is seeded by its key; at one thread a run repeats exactly"),
    _m("seed", 42, "seed"),
    _i("data_seed", None, "TRL's GRPO sampler reads seed, not data_seed"),
    # ---------------------------------------------------------------- devices and processes
    _m("use_cpu", False, "device", "True: cpu; False: CUDA where there is one"),
    _r("accelerator_config", None, "grpolab does not run through accelerate"),
    _r("parallelism_config", None, "tensor, context and sequence parallelism are not built"),
    _i("dataloader_drop_last", False, _LOADER),
    _i("dataloader_num_workers", 0, _LOADER),
    _i("dataloader_pin_memory", True, _LOADER),
    _i("dataloader_persistent_workers", False, _LOADER),
    _i("dataloader_prefetch_factor", None, _LOADER),
    _i("dataloader_multiprocessing_context", None, _LOADER),
    _i("dataloader_in_order", True, _LOADER),
    _i("remove_unused_columns", False, "every column reaches the reward functions, as TRL's default"),
    _i("label_names", None, _NO_EFFECT_GRPO),
    _i("train_sampling_strategy", "random", "TRL's GRPO sampler ignores it; shuffle_dataset decides"),
    _i("length_column_name", "length", _NO_EFFECT_GRPO),
    _i("ddp_find_unused_parameters", None, _DDP),
    _i("ddp_bucket_cap_mb", None, _DDP),
    _i("ddp_broadcast_buffers", None, _DDP),
    _i("ddp_static_graph", None, _DDP),
    _i("ddp_backend", None, _DDP),
    _i("ddp_timeout", 1800, _DDP),
    _m("fsdp", None, "fsdp", "full_shard (with or without auto_wrap): FSDP2 over the processes; other modes refused"),
    _r("fsdp_config", None, "grpolab's FSDP2 shards each decoder layer with its own settings"),
    _r("deepspeed", None, "DeepSpeed is not built; fsdp='full_shard' shards the model"),
    _i("debug", "", _LOG),
    _i("skip_memory_metrics", True, _LOG),
    _i("do_train", False, "read by scripts, not by the trainer"),
    _i("do_eval", False, "read by scripts, not by the trainer"),
    _i("do_predict", False, "read by scripts, not by the trainer"),
    _i("resume_from_checkpoint", None, "read by scripts, not by the trainer: pass it to train()"),
    _i("local_rank", -1, "torchrun sets the rank"),
    # ---------------------------------------------------------------- GRPO: the model
    _m(
        "model_init_kwargs",
        None,
        "revision, precision",
        "revision; dtype/torch_dtype ('auto': the checkpoint's); attn_implementation, device_map, low_cpu_mem_usage, "
        "trust_remote_code=False: no effect",
    ),
    _r("trust_remote_code", False, "grpolab loads transformers' own architectures"),
    _r("router_aux_loss_coef", None, "a mixture-of-experts router loss is not built"),
    _m("disable_dropout", False, "keep_dropout", "keep_dropout = not disable_dropout"),
    _m("cast_lm_head_to_fp32", False, "fp32_head"),
    # ---------------------------------------------------------------- GRPO: generation
    _m("num_generations", 8, "group_size"),
    _m("num_generations_eval", None, "eval_samples", "and the completions of each prompt in TRL's evaluation"),
    _m("max_completion_length", 512, "max_new_tokens"),
    _i("ds3_gather_for_generation", True, "DeepSpeed only"),
    _m("shuffle_dataset", True, "data_order", "True: shuffle (an epoch a seeded permutation); False: sequential"),
    _i("pad_to_multiple_of", "auto", "padding only"),
    _m("generation_batch_size", None, "prompts_per_step, minibatches", "the geometry"),
    _m("steps_per_generation", None, "prompts_per_step, minibatches", "/ gradient_accumulation_steps: minibatches"),
    _m("temperature", 1.0, "temperature"),
    _m("top_p", 1.0, "top_p"),
    _m("top_k", 0, "top_k", "None, 0 or -1: off (0)"),
    _m("min_p", None, "min_p", "None: 0 (off)"),
    _m(
        "generation_kwargs",
        None,
        "top_k, min_p, repetition_penalty",
        "its keys top_k, min_p and repetition_penalty over the fields of those names, as TRL; any other key refused "
        "(grpolab samples with temperature, top-p, top-k, min-p and the repetition penalty only)",
    ),
    _r("chat_template_kwargs", None, "the chat template is rendered with its own defaults"),
    _m("repetition_penalty", 1.0, "repetition_penalty", "on the prompt's and the completion's tokens, as vLLM"),
    _i("cache_implementation", None, "grpolab's sampler keeps its own cache"),
    _m("use_vllm", False, "rollout_engine", "True: vllm, in the trainer's process"),
    _r("vllm_mode", "colocate", "grpolab runs vLLM in the trainer's process (colocate); see generator workers"),
    _r("vllm_model_impl", "vllm", "vLLM's own model implementation only"),
    _m("vllm_enable_sleep_mode", False, "vllm_sleep"),
    _r("vllm_structured_outputs_regex", None, "structured outputs change the sampling policy; not built"),
    _i("vllm_server_base_url", None, _VLLM_SERVER),
    _i("vllm_server_host", "0.0.0.0", _VLLM_SERVER),
    _i("vllm_server_port", 8000, _VLLM_SERVER),
    _i("vllm_server_timeout", 240.0, _VLLM_SERVER),
    _i("vllm_group_port", 51216, _VLLM_SERVER),
    _m("vllm_gpu_memory_utilization", 0.3, "vllm_memory"),
    _m("vllm_max_model_length", None, "vllm_max_len", "None: prompt + completion lengths (grpolab: 2048)"),
    _r("vllm_tensor_parallel_size", 1, "vLLM runs on one device per process here"),
    # ---------------------------------------------------------------- GRPO: the objective
    _m("beta", 0.0, "beta"),
    _m("num_iterations", 1, "mu"),
    _m("epsilon", 0.2, "clip_low"),
    _m("delta", None, "clip_delta"),
    _m("epsilon_high", None, "clip_high, cispo_cap", "None: epsilon; under loss_type='cispo' the weight's cap"),
    _m("sapo_temperature_neg", 1.05, "sapo_temperature_neg"),
    _m("sapo_temperature_pos", 1.0, "sapo_temperature_pos"),
    _m("vespo_k_pos", 2.0, "vespo_k_pos"),
    _m("vespo_lambda_pos", 3.0, "vespo_lambda_pos"),
    _m("vespo_k_neg", 3.0, "vespo_k_neg"),
    _m("vespo_lambda_neg", 2.0, "vespo_lambda_neg"),
    _m("importance_sampling_level", "token", "importance_sampling"),
    _m("reward_weights", None, "reward_weights"),
    _m("multi_objective_aggregation", "sum_then_normalize", "reward_normalisation"),
    _m("scale_rewards", "group", "estimator, scale_rewards", "group/True, batch: grpo_std; none/False: grpo"),
    _m("loss_type", "dapo", "aggregation, loss_type", "grpo, bnpo, dapo, dr_grpo: aggregations; the rest: terms"),
    _m("mask_truncated_completions", False, "mask_truncated"),
    _r("sync_ref_model", False, "a moving KL reference (TR-DPO) is not built: the reference is the starting model"),
    _i("ref_model_mixup_alpha", 0.6, "read only with sync_ref_model"),
    _i("ref_model_sync_steps", 512, "read only with sync_ref_model"),
    _m("top_entropy_quantile", 1.0, "top_entropy_quantile"),
    _m("entropy_coef", 0.0, "entropy_coef"),
    _m("use_adaptive_entropy", False, "adaptive_entropy"),
    _m("entropy_coef_min", 0.0, "entropy_coef_min"),
    _m("entropy_coef_max", 1.0, "entropy_coef_max"),
    _m("entropy_coef_delta", 0.005, "entropy_coef_delta"),
    _m("entropy_target", 0.2, "entropy_target"),
    _m("max_tool_calling_iterations", None, "max_turns", "tool rounds + 1 (grpolab counts replies)"),
    _m("vllm_importance_sampling_correction", True, "engine_correction", "with use_vllm"),
    _m("vllm_importance_sampling_mode", "sequence_mask", "engine_correction", "token/sequence, truncate/mask"),
    _m("vllm_importance_sampling_clip_max", 3.0, "engine_correction_cap"),
    _r("vllm_importance_sampling_clip_min", None, "grpolab's mask bounds are [1/cap, cap]"),
    _m("off_policy_mask_threshold", None, "off_policy_mask_threshold", "None: 0 (off)"),
    _m("use_bias_correction_kl", True, "kl_ratio", "the KL estimate times the importance ratio"),
    _m("log_completions", False, "log_rollouts", "every rollout to rollouts.jsonl"),
    _i("log_multimodal", True, _LOG),
    _i("num_completions_to_print", None, _LOG),
    _i("log_unique_prompts", False, _LOG),
    _r("log_completions_hub_repo", None, "needs the Hub; rollouts.jsonl holds every completion"),
    _i("use_transformers_continuous_batching", False, "a sampler's mechanics: grpolab's own decode loop or vLLM"),
    _i("transformers_continuous_batching_config", None, "a sampler's mechanics: grpolab's own decode loop or vLLM"),
    _i("use_transformers_paged", False, "a sampler's mechanics: grpolab's own decode loop or vLLM"),
    _m("vllm_importance_sampling_cap", None, "engine_correction_cap", "TRL's deprecated name of the clip_max"),
)

BY_NAME = {f.name: f for f in FIELDS}
assert len(BY_NAME) == len(FIELDS), "a field listed twice"


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Each field's type as TRL 1.16 annotates it: TRL's parser (transformers' HfArgumentParser) reads a command line and a
# YAML recipe by these, so they are TRL's exactly, its enums included (a test holds them to TRL's dataclass).
_TYPE_GROUPS: tuple[tuple[object, tuple[str, ...]], ...] = (
    (
        bool,
        _names("""
        average_tokens_across_devices fp16 bf16_full_eval fp16_full_eval gradient_checkpointing torch_compile
        use_liger_kernel use_cache auto_find_batch_size logging_first_step log_on_each_node logging_nan_inf_filter
        prediction_loss_only eval_on_start eval_do_concat_batches eval_use_gather_object batch_eval_metrics
        save_only_model save_on_each_node enable_jit_checkpoint push_to_hub hub_always_push load_best_model_at_end
        ignore_data_skip restore_callback_states_from_checkpoint full_determinism use_cpu dataloader_drop_last
        dataloader_pin_memory dataloader_persistent_workers dataloader_in_order skip_memory_metrics do_train do_eval
        do_predict trust_remote_code disable_dropout cast_lm_head_to_fp32 ds3_gather_for_generation use_vllm
        vllm_enable_sleep_mode mask_truncated_completions sync_ref_model use_adaptive_entropy
        vllm_importance_sampling_correction use_bias_correction_kl log_completions log_multimodal log_unique_prompts
        use_transformers_continuous_batching use_transformers_paged"""),
    ),
    (
        bool | None,
        _names("""
        bf16 tf32 disable_tqdm hub_private_repo greater_is_better remove_unused_columns ddp_find_unused_parameters
        ddp_broadcast_buffers ddp_static_graph shuffle_dataset"""),
    ),
    (
        int,
        _names("""
        per_device_train_batch_size max_steps gradient_accumulation_steps per_device_eval_batch_size seed
        dataloader_num_workers ddp_timeout local_rank top_k vllm_server_port vllm_group_port vllm_tensor_parallel_size
        num_iterations ref_model_sync_steps"""),
    ),
    (
        int | None,
        _names("""
        torch_empty_cache_steps eval_accumulation_steps save_total_limit data_seed dataloader_prefetch_factor
        ddp_bucket_cap_mb num_generations num_generations_eval max_completion_length generation_batch_size
        steps_per_generation vllm_max_model_length max_tool_calling_iterations num_completions_to_print"""),
    ),
    (
        float,
        _names("""
        num_train_epochs learning_rate warmup_steps weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm
        label_smoothing_factor logging_steps eval_delay save_steps temperature top_p repetition_penalty
        vllm_server_timeout vllm_gpu_memory_utilization beta epsilon sapo_temperature_neg sapo_temperature_pos
        vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg ref_model_mixup_alpha top_entropy_quantile
        entropy_coef entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target"""),
    ),
    (
        float | None,
        _names("""
        neftune_noise_alpha eval_steps router_aux_loss_coef min_p delta epsilon_high vllm_importance_sampling_clip_max
        vllm_importance_sampling_clip_min off_policy_mask_threshold vllm_importance_sampling_cap"""),
    ),
    (
        str,
        _names("""
        log_level log_level_replica project train_sampling_strategy length_column_name vllm_mode vllm_model_impl
        vllm_server_host importance_sampling_level multi_objective_aggregation scale_rewards loss_type
        vllm_importance_sampling_mode"""),
    ),
    (
        str | None,
        _names("""
        output_dir optim_args torch_compile_backend torch_compile_mode run_name trackio_space_id trackio_bucket_id
        hub_token hub_model_id hub_revision metric_for_best_model dataloader_multiprocessing_context ddp_backend fsdp
        resume_from_checkpoint cache_implementation vllm_structured_outputs_regex vllm_server_base_url
        log_completions_hub_repo"""),
    ),
    (str | bool, ("include_num_input_tokens_seen",)),
    (Union[str, None, Literal[False]], ("trackio_static_space_id",)),  # noqa: UP007 (TRL's spelling; `|` refuses it)
    (int | str | None, ("pad_to_multiple_of",)),
    (list[str], ("include_for_metrics",)),
    (list[str] | None, ("label_names",)),
    (list[float] | None, ("reward_weights",)),
    (None | str | list[str], ("optim_target_modules", "report_to")),
    (
        dict | str | None,
        _names("""
        lr_scheduler_kwargs accelerator_config deepspeed generation_kwargs chat_template_kwargs
        transformers_continuous_batching_config"""),
    ),
    (dict[str, Any] | str | None, ("gradient_checkpointing_kwargs", "fsdp_config", "model_init_kwargs")),
    (dict[str, bool] | None, ("liger_kernel_config",)),
)


def _library_types() -> dict[str, object]:
    """The fields whose types are transformers' (and accelerate's) own classes."""
    from transformers.debug_utils import DebugOption
    from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
    from transformers.training_args import OptimizerNames

    try:
        from accelerate.parallelism_config import ParallelismConfig

        parallelism: object = ParallelismConfig | None
    except ImportError:  # accelerate is peft's dependency; without it the field takes only its default
        parallelism = object | None
    return {
        "lr_scheduler_type": SchedulerType | str,
        "optim": OptimizerNames | str,
        "logging_strategy": IntervalStrategy | str,
        "eval_strategy": IntervalStrategy | str,
        "save_strategy": SaveStrategy | str,
        "hub_strategy": HubStrategy | str,
        "debug": str | list[DebugOption],
        "parallelism_config": parallelism,
    }


def types() -> dict[str, object]:
    """Every field's type annotation, as TRL 1.16's GRPOConfig has it."""
    out = {name: kind for kind, names in _TYPE_GROUPS for name in names}
    out.update(_library_types())
    return out


_LOG_LEVELS = ["detail", "debug", "info", "warning", "error", "critical", "passive"]
PARSER_OPTIONS: dict[str, dict] = {
    "log_level": {"choices": _LOG_LEVELS},
    "log_level_replica": {"choices": _LOG_LEVELS},
    "dataloader_multiprocessing_context": {"choices": ["fork", "spawn", "forkserver"]},
    "train_sampling_strategy": {"choices": ["random", "sequential", "group_by_length", "batch_rebalance"]},
    "ddp_backend": {"choices": ["nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl"]},
    "fsdp": {"nargs": "?", "const": True},
}
"""The argparse options TRL's fields carry beside their help (its choices; ``--fsdp`` alone meaning True)."""


def help_text(f: TrlField) -> str:
    """A field's ``--help`` line: what grpolab does with it (our own words; TRL's meaning is TRL's documentation)."""
    if f.kind == "mapped":
        return f"grpolab: {f.to}" + (f" ({f.note})" if f.note else "")
    if f.kind == "inert":
        return f"accepted; no effect in grpolab: {f.note}"
    if f.accepts:
        return f"refused by grpolab unless {' or '.join(map(repr, f.accepts))}: {f.note}"
    return f"refused by grpolab unless left at TRL's default: {f.note}"


def _note(f: TrlField) -> str:
    return f"{f.note} (takes {' or '.join(map(repr, f.accepts))})" if f.accepts else f.note


def markdown_table(fields: tuple[TrlField, ...] = FIELDS) -> str:
    """The table as docs/coming-from-trl.md shows it: a row per field, by kind (``fields``: GRPOConfig's by default,
    :data:`grpolab.trl.rloo_fields.RLOO_FIELDS` for RLOOConfig's)."""
    lines = ["| TRL field | TRL default | kind | grpolab | note |", "| --- | --- | --- | --- | --- |"]
    for f in fields:
        to = f"`{f.to}`" if f.to else ""
        lines.append(f"| `{f.name}` | `{f.default!r}` | {f.kind} | {to} | {_note(f)} |")
    counts = {k: sum(f.kind == k for f in fields) for k in ("mapped", "inert", "refused")}
    lines.append("")
    lines.append(
        f"{len(fields)} fields: {counts['mapped']} mapped, {counts['inert']} accepted without effect, "
        f"{counts['refused']} refused when set to anything but TRL's default"
        + (" (or the value its note names)." if any(f.accepts for f in fields) else ".")
    )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m grpolab.trl.fields > table.md
    print(markdown_table())
