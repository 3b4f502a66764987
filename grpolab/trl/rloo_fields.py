"""Every field of TRL 1.16's ``RLOOConfig`` (its ``TrainingArguments`` included), by TRL's name and default, and what
grpolab does with it: one table, of :mod:`grpolab.trl.fields`' kinds (mapped, inert, refused).

RLOOConfig shares TrainingArguments and most generation and model fields with GRPOConfig, and those mean here what
they mean there (the entries are GRPO's own). The objective is RLOO's (TRL's ``RLOOTrainer``):

- the advantage of completion i is its reward minus the mean of its group's other rewards (grpolab's
  ``--estimator rloo``), with no division by a spread;
- the loss is ``-min(r A, clip(r) A)`` per completion, averaged over completions, ``r`` the completion's whole
  ratio ``exp(sum_t logp - old_logp)``: grpolab's ``--importance-sampling sequence-sum`` with ``--aggregation
  seq-mean-token-mean``, the same value and gradient. Only ``num_iterations=1`` with one minibatch a generation
  (``steps_per_generation == gradient_accumulation_steps``), TRL's defaults, is taken: grpolab's passes and
  minibatches over a generation have not been compared with RLOO's there;
- ``beta`` puts the KL in the reward (``r - beta * sum_t (old_logp - ref_logp)`` before the leave-one-out
  baseline); grpolab's KL is a term of the loss, so only ``beta=0.0`` is taken (TRL's default 0.05 is refused when
  the run starts: the config still builds);
- ``reward_clip_range`` and ``normalize_advantages`` are refused.

``docs/coming-from-trl.md``'s RLOO field table is generated from this one (``python -m grpolab.trl.rloo_fields``),
and a test holds it against TRL's own dataclass.
"""

from __future__ import annotations

from grpolab.trl.fields import BY_NAME, FIELDS, TrlField, types

_RATIO_ONE = (
    "one pass of one minibatch a generation only: grpolab's passes and minibatches with RLOO's whole-completion ratio "
    "away from 1 have not been compared with TRL's"
)

# RLOOConfig's own fields after TrainingArguments', in TRL 1.16's order
_RLOO_NAMES = """
model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout num_generations num_generations_eval
max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of generation_batch_size
steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs repetition_penalty
cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex
vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization
vllm_max_model_length vllm_tensor_parallel_size beta num_iterations epsilon epsilon_high reward_weights
normalize_advantages reward_clip_range mask_truncated_completions sync_ref_model ref_model_mixup_alpha
ref_model_sync_steps log_completions log_multimodal num_completions_to_print log_unique_prompts
use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged
""".split()

# Where RLOO's field differs from GRPO's entry: its default, or what grpolab does with it under RLOO's objective
_RLOO_OWN: dict[str, TrlField] = {
    f.name: f
    for f in (
        TrlField("num_generations", 2, "mapped", "group_size"),
        TrlField(
            "steps_per_generation",
            None,
            "mapped",
            "prompts_per_step",
            "must equal gradient_accumulation_steps (one minibatch a generation): " + _RATIO_ONE,
        ),
        TrlField(
            "generation_batch_size",
            None,
            "mapped",
            "prompts_per_step",
            "the geometry; per_device_train_batch_size x gradient_accumulation_steps x processes (one minibatch)",
        ),
        TrlField(
            "beta",
            0.05,
            "refused",
            "",
            "RLOO subtracts beta x each completion's summed log-ratio to the reference from its reward; grpolab's KL "
            "is a term of the loss: give beta=0.0",
            accepts=(0.0,),
        ),
        TrlField("num_iterations", 1, "refused", "", _RATIO_ONE + " (one pass a generation)"),
        TrlField(
            "epsilon", 0.2, "mapped", "clip_low", "on the completion's whole ratio (--importance-sampling sequence-sum)"
        ),
        TrlField("epsilon_high", None, "mapped", "clip_high", "None: epsilon; on the completion's whole ratio"),
        TrlField(
            "normalize_advantages",
            False,
            "refused",
            "",
            "grpolab's rloo advantage is not standardised over the batch",
        ),
        TrlField("reward_clip_range", None, "refused", "", "grpolab does not clip rewards"),
    )
}

_TRAINING_ARGUMENTS = FIELDS[: [f.name for f in FIELDS].index("model_init_kwargs")]

RLOO_FIELDS: tuple[TrlField, ...] = _TRAINING_ARGUMENTS + tuple(_RLOO_OWN.get(n) or BY_NAME[n] for n in _RLOO_NAMES)
RLOO_BY_NAME = {f.name: f for f in RLOO_FIELDS}
assert len(RLOO_BY_NAME) == len(RLOO_FIELDS), "a field listed twice"


def rloo_types() -> dict[str, object]:
    """Every field's type annotation, as TRL 1.16's RLOOConfig has it (GRPOConfig's for the fields they share)."""
    grpo = types()
    own = {"normalize_advantages": bool, "reward_clip_range": tuple[float, float] | None}
    return {f.name: own[f.name] if f.name in own else grpo[f.name] for f in RLOO_FIELDS}


if __name__ == "__main__":  # python -m grpolab.trl.rloo_fields > table.md
    from grpolab.trl.fields import markdown_table

    print(markdown_table(RLOO_FIELDS))
