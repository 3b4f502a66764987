"""TRL's ``RLOOConfig`` by TRL 1.16's names and defaults, and its translation into grpolab's options.

``RLOOConfig`` is made from the table of :mod:`grpolab.trl.rloo_fields` as ``GRPOConfig`` is from its own
(:func:`grpolab.trl.config.make_config_class`): TRL's fields and defaults, TRL's __post_init__ resolutions, the
refusals in one line.

:func:`translate_rloo` reads it through GRPOConfig's translation: the fields the two share mean the same, so an
RLOOConfig is first written as the GRPOConfig of the same run (:func:`grpo_view`: its own fields as they are, GRPO's
objective fields where they say nothing RLOO does not), and that translation's objective is then RLOO's: the
leave-one-out advantage, and the completion's whole ratio clipped, one term a completion (RLOO's loss, value and
gradient: :mod:`grpolab.trl.rloo_fields`).
"""

from __future__ import annotations

import dataclasses

from grpolab.trl.config import GRPOConfig, Translation, make_config_class, refusal, translate
from grpolab.trl.fields import FIELDS
from grpolab.trl.rloo_fields import RLOO_BY_NAME, RLOO_FIELDS, rloo_types

RLOOConfig = make_config_class(
    "RLOOConfig",
    RLOO_FIELDS,
    rloo_types(),
    "TRL 1.16's RLOOConfig: every field by TRL's name and with TRL's default (grpolab.trl.rloo_fields says what each "
    "becomes). An unknown keyword is a TypeError; a field grpolab does not do, set to anything but TRL's default, is "
    "a ValueError of one line; TRL's default beta=0.05 (a KL in the reward) is refused when the run starts.",
)
RLOOConfig.__module__ = __name__

# GRPOConfig's objective fields, set to what says nothing beyond RLOO's objective (the rest stay GRPO's defaults,
# which change nothing: no entropy bonus, no masks, no engine correction, no tool rounds)
_GRPO_OBJECTIVE = dict(beta=0.0, loss_type="grpo", scale_rewards="none", use_bias_correction_kl=False,
                       vllm_importance_sampling_correction=False)  # fmt: skip

RLOO_OBJECTIVE = {
    "estimator": "rloo",  # A_i = r_i - mean_{j != i} r_j, as TRL's RLOOTrainer computes it
    "aggregation": "seq-mean-token-mean",  # each completion's one term (constant over its tokens), the mean over them
    "loss_type": "clip",
    "importance_sampling": "sequence-sum",  # the completion's whole ratio prod_t pi / pi_old, clipped: TRL's
    "kl_ratio": False,
    "beta": 0.0,
}
"""grpolab's objective options for TRL's RLOO (under the checks of :func:`check_rloo`)."""


def check_rloo(args) -> None:
    """What grpolab refuses of an RLOOConfig when the run starts: a KL in the reward (``beta`` other than 0, TRL's
    default included) and more than one minibatch a generation (the ratio would leave 1)."""
    if args.beta != 0.0:
        raise refusal(args, "beta", args.beta, RLOO_BY_NAME["beta"].note)
    if args.steps_per_generation != args.gradient_accumulation_steps:
        raise refusal(
            args,
            "steps_per_generation",
            args.steps_per_generation,
            f"must equal gradient_accumulation_steps ({args.gradient_accumulation_steps}) here: "
            + RLOO_BY_NAME["num_iterations"].note,
        )


def grpo_view(args) -> GRPOConfig:
    """The GRPOConfig of the run ``args`` (an RLOOConfig) describes: every field they share as ``args`` holds it,
    GRPO's objective fields as :data:`_GRPO_OBJECTIVE`."""
    grpo_names = {f.name for f in FIELDS}
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in grpo_names}
    shared["generation_batch_size"] = None  # resolved again from steps_per_generation, as TRL's replace() needs
    return GRPOConfig(**(shared | _GRPO_OBJECTIVE))


def translate_rloo(args, world_size: int = 1, train_rows: int | None = None, **kwargs) -> Translation:
    """grpolab's options for ``args`` (an RLOOConfig): :func:`grpolab.trl.config.translate` of its
    :func:`grpo_view`, with RLOO's objective (:data:`RLOO_OBJECTIVE`); ``kwargs`` as translate's."""
    check_rloo(args)
    try:
        view = grpo_view(args)
        plan = translate(view, world_size, train_rows, **kwargs)
    except ValueError as e:  # a shared field's refusal, named by the config the user wrote
        raise ValueError(str(e).replace("GRPOConfig", "RLOOConfig")) from None
    options = {k: v for k, v in plan.options.items() if k != "reward_std"} | RLOO_OBJECTIVE
    return plan._replace(options=options)
