"""Every field of TRL 1.16's ``DistillationConfig`` (its ``TrainingArguments`` included), by TRL's name and default,
and what grpolab does with it: one table, of :mod:`grpolab.trl.fields`' kinds (mapped, inert, refused).

DistillationConfig shares TrainingArguments and its generation and model fields with GRPOConfig, and those mean here
what they mean there (the entries are GRPO's own). What is TRL's DistillationTrainer's own:

- the student samples one completion per prompt (no group): grpolab's ``--group-size 1`` with the ``vanilla``
  estimator, and the generation batch (per_device_train_batch_size x gradient_accumulation_steps x processes prompts)
  is one optimizer step;
- the teacher (``teacher_model_name_or_path``, or the trainer's ``teacher_model``) is grpolab's ``--teacher``;
- ``beta`` chooses the divergence over the whole vocabulary (TRL's generalized JSD): 0.0 the forward KL
  (``--distill-loss fkl``), 1.0 the reverse KL (``rkl``), between them the JSD with ``--distill-beta beta``;
- the loss is the divergence alone, summed over the completion tokens and divided by their number
  (``--aggregation token-mean``), with no reward (``--no-task-reward``).

``docs/coming-from-trl.md``'s distillation field table is generated from this one (``python -m
grpolab.trl.distillation_fields``), and a test holds it against TRL's own dataclass.
"""

from __future__ import annotations

from typing import Any

from grpolab.trl.fields import BY_NAME, FIELDS, TrlField, types

# DistillationConfig's own fields after TrainingArguments', in TRL 1.16's order
_DISTILL_NAMES = """
model_init_kwargs trust_remote_code teacher_model_name_or_path teacher_model_revision teacher_model_init_kwargs
disable_dropout max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of temperature top_p
top_k min_p generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode
vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host
vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length
vllm_tensor_parallel_size beta max_tool_calling_iterations log_completions num_completions_to_print log_unique_prompts
""".split()

TEACHER_KEYS = ("revision", "dtype", "torch_dtype", "trust_remote_code", "attn_implementation", "device_map",
                "low_cpu_mem_usage")  # fmt: skip
"""teacher_model_init_kwargs' keys grpolab takes (TRL's distillation script fills them in): the teacher's revision;
the rest load it and change nothing trained (the teacher runs in the run's compute dtype; trust_remote_code False)."""

_WHOLE = "grpolab's full-vocabulary divergence compares the whole next-token distributions: sampled with "
_NO_EVAL = "grpolab's DistillationTrainer evaluates nothing: TRL's distillation evaluation (the divergence on held-out "
_NO_EVAL += "prompts) is not built"

# Where the distillation field differs from GRPO's entry: its default, or what grpolab does with it
_DISTILL_OWN: dict[str, TrlField] = {
    f.name: f
    for f in (
        TrlField("teacher_model_name_or_path", None, "mapped", "teacher", "the trainer's teacher_model comes first"),
        TrlField("teacher_model_revision", None, "mapped", "teacher_revision"),
        TrlField(
            "teacher_model_init_kwargs",
            None,
            "mapped",
            "teacher_revision",
            "revision; " + ", ".join(TEACHER_KEYS[1:]) + ": no effect (the teacher runs in the run's compute dtype; "
            "trust_remote_code False only); any other key refused",
        ),
        TrlField(
            "beta",
            1.0,
            "mapped",
            "distill_loss, distill_beta",
            "0.0: fkl (forward KL); 1.0: rkl (reverse KL); between: jsd with distill_beta = beta",
        ),
        TrlField("top_p", 1.0, "refused", "", _WHOLE + "top-p 1"),
        TrlField("top_k", 0, "refused", "", _WHOLE + "top-k 0"),
        TrlField("min_p", None, "refused", "", _WHOLE + "min-p None"),
        TrlField("repetition_penalty", 1.0, "refused", "", _WHOLE + "no repetition penalty"),
        TrlField("generation_kwargs", None, "refused", "", _WHOLE + "no generation_kwargs"),
        TrlField(
            "max_tool_calling_iterations",
            None,
            "refused",
            "",
            "read only with tools, which grpolab's DistillationTrainer does not take",
        ),
        TrlField("eval_strategy", "no", "refused", "", _NO_EVAL),
        TrlField("per_device_eval_batch_size", 8, "inert", "", _NO_EVAL),
    )
}

_TRAINING_ARGUMENTS = FIELDS[: [f.name for f in FIELDS].index("model_init_kwargs")]

DISTILL_FIELDS: tuple[TrlField, ...] = tuple(_DISTILL_OWN.get(f.name, f) for f in _TRAINING_ARGUMENTS) + tuple(
    _DISTILL_OWN.get(n) or BY_NAME[n] for n in _DISTILL_NAMES
)
DISTILL_BY_NAME = {f.name: f for f in DISTILL_FIELDS}
assert len(DISTILL_BY_NAME) == len(DISTILL_FIELDS), "a field listed twice"


def distill_types() -> dict[str, object]:
    """Every field's type annotation, as TRL 1.16's DistillationConfig has it (GRPOConfig's for the fields they
    share)."""
    grpo = types()
    own = {"teacher_model_name_or_path": str | None, "teacher_model_revision": str | None,
           "teacher_model_init_kwargs": dict[str, Any] | str | None}  # fmt: skip
    return {f.name: own[f.name] if f.name in own else grpo[f.name] for f in DISTILL_FIELDS}


if __name__ == "__main__":  # python -m grpolab.trl.distillation_fields > table.md
    from grpolab.trl.fields import markdown_table

    print(markdown_table(DISTILL_FIELDS))
