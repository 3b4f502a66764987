"""TRL's ``DistillationConfig`` by TRL 1.16's names and defaults, and its translation into grpolab's options.

``DistillationConfig`` is made from the table of :mod:`grpolab.trl.distillation_fields` as ``GRPOConfig`` is from
its own (:func:`grpolab.trl.config.make_config_class`), with TRL's own check of ``beta`` (in [0, 1]).

:func:`translate_distillation` reads it through GRPOConfig's translation, as RLOO's does: the fields they share mean
the same, so a DistillationConfig is first written as the GRPOConfig of the same run (:func:`grpo_view`), whose
translation gives the schedule, the precision, the sampling, the logging and the checkpoints; then the objective is
TRL's distillation's: one completion a prompt (group size 1, the ``vanilla`` estimator), the teacher, the divergence
``beta`` names, summed over the completion tokens and divided by their number, and no task reward.
"""

from __future__ import annotations

import dataclasses

from grpolab.trl.config import GRPOConfig, Translation, make_config_class, post_init, refusal, translate
from grpolab.trl.distillation_fields import DISTILL_BY_NAME, DISTILL_FIELDS, TEACHER_KEYS, distill_types
from grpolab.trl.fields import FIELDS

DistillationConfig = make_config_class(
    "DistillationConfig",
    DISTILL_FIELDS,
    distill_types(),
    "TRL 1.16's DistillationConfig: every field by TRL's name and with TRL's default "
    "(grpolab.trl.distillation_fields says what each becomes). An unknown keyword is a TypeError; a field grpolab "
    "does not do, set to anything but TRL's default, is a ValueError of one line.",
)
DistillationConfig.__module__ = __name__


def _distill_post_init(self) -> None:
    """GRPOConfig's resolutions and refusals, then TRL's check of ``beta``."""
    post_init(self)
    if not 0.0 <= self.beta <= 1.0:
        raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")  # TRL's message


DistillationConfig.__post_init__ = _distill_post_init

DISTILL_OBJECTIVE = {
    "estimator": "vanilla",  # one completion a prompt: no group, no baseline (its advantage is dropped anyway)
    "group_size": 1,
    "aggregation": "token-mean",  # TRL: the divergence summed over the batch's completion tokens / their number
    "loss_type": "clip",
    "beta": 0.0,
    "kl_ratio": False,
    "task_reward": False,  # TRL's distillation has no reward: the teacher's divergence alone trains the student
    "distill_coef": 1.0,
}
"""grpolab's objective options for TRL's on-policy distillation (the divergence itself: :func:`divergence_options`)."""

# GRPOConfig's objective fields, set to what says nothing beyond the distillation's
_GRPO_OBJECTIVE = dict(beta=0.0, loss_type="dapo", scale_rewards="none", use_bias_correction_kl=False,
                       vllm_importance_sampling_correction=False, num_generations=2)  # fmt: skip


def divergence_options(beta: float) -> dict:
    """TRL's ``beta`` as grpolab's ``--distill-loss`` (and ``--distill-beta``): 0.0 fkl, 1.0 rkl, else jsd."""
    if beta == 0.0:
        return {"distill_loss": "fkl"}
    if beta == 1.0:
        return {"distill_loss": "rkl"}
    return {"distill_loss": "jsd", "distill_beta": float(beta)}


def teacher_options(args) -> dict:
    """``teacher_model_revision`` and ``teacher_model_init_kwargs`` as grpolab's ``--teacher-revision``; a key of
    teacher_model_init_kwargs grpolab does not take is one line."""
    kwargs = dict(args.teacher_model_init_kwargs or {})
    if kwargs.get("trust_remote_code"):
        raise refusal(args, "teacher_model_init_kwargs", {"trust_remote_code": True},
                      "grpolab runs no code from a model's files")  # fmt: skip
    other = {k: v for k, v in kwargs.items() if k not in TEACHER_KEYS}
    if other:
        raise refusal(args, "teacher_model_init_kwargs", other, DISTILL_BY_NAME["teacher_model_init_kwargs"].note)
    revision = kwargs.get("revision") or args.teacher_model_revision
    return {"teacher_revision": str(revision)} if revision not in (None, "main") else {}


def grpo_view(args) -> GRPOConfig:
    """The GRPOConfig of the run ``args`` (a DistillationConfig) describes, for its geometry, schedule, sampling,
    precision, logging and checkpoints: every field they share as ``args`` holds it, GRPO's objective fields as
    :data:`_GRPO_OBJECTIVE`. Its groups are of 2 completions and its per-device batch twice ``args``', so that its
    generation holds ``args``' prompts (TRL's distillation: per_device_train_batch_size x gradient_accumulation_steps
    x processes, one completion each); :func:`translate_distillation` makes the group 1 again."""
    grpo_names = {f.name for f in FIELDS}
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in grpo_names}
    shared["per_device_train_batch_size"] = 2 * args.per_device_train_batch_size
    return GRPOConfig(**(shared | _GRPO_OBJECTIVE))


def translate_distillation(args, world_size: int = 1, train_rows: int | None = None, **kwargs) -> Translation:
    """grpolab's options for ``args`` (a DistillationConfig), less the teacher itself (the trainer's ``teacher_model``
    or ``teacher_model_name_or_path``, which the trainer adds): :func:`grpolab.trl.config.translate` of its
    :func:`grpo_view`, with the distillation's objective (:data:`DISTILL_OBJECTIVE`, :func:`divergence_options`);
    ``kwargs`` as translate's."""
    teacher = teacher_options(args)
    try:
        plan = translate(grpo_view(args), world_size, train_rows, **kwargs)
    except ValueError as e:  # a shared field's refusal, named by the config the user wrote
        raise ValueError(str(e).replace("GRPOConfig", "DistillationConfig")) from None
    options = {k: v for k, v in plan.options.items() if k not in ("reward_std", "scale_rewards")}
    if options["micro_batch"]:  # the view's per-device batch was twice args'
        options["micro_batch"] = args.per_device_train_batch_size
    options |= DISTILL_OBJECTIVE | divergence_options(args.beta) | teacher
    return plan._replace(options=options)
