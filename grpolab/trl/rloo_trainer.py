"""TRL's ``RLOOTrainer``, run by grpolab: TRL 1.16's constructor and surface over :func:`grpolab.train`.

It is :class:`grpolab.trl.GRPOTrainer` with RLOO's config and translation (:mod:`grpolab.trl.rloo_config`): the
same run, callbacks, ``state.log_history`` (under the names TRL's RLOOTrainer logs), ``save_model`` and
``evaluate``; no loop of its own.
"""

from __future__ import annotations

from grpolab.trl.logs import RLOO_ABSENT
from grpolab.trl.rloo_config import RLOOConfig, check_rloo, translate_rloo
from grpolab.trl.trainer import GRPOTrainer, model_name


class RLOOTrainer(GRPOTrainer):
    """TRL's RLOOTrainer: ``RLOOTrainer(model, reward_funcs, args=RLOOConfig(beta=0.0, ...), train_dataset=...)
    .train()``.

    Args:
        model, reward_funcs, train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks,
            optimizers, quantization_config, peft_config: as :class:`grpolab.trl.GRPOTrainer` takes them (TRL's
            RLOOTrainer takes no tools, environment or rollout function).
        args (RLOOConfig | None): TRL's RLOO config (:mod:`grpolab.trl.rloo_fields` says what each field becomes).
            Default: ``RLOOConfig(output_dir="<model>-RLOO")``, which is refused as it stands: its ``beta=0.05`` puts
            a KL in the reward, which grpolab does not do (give ``beta=0.0``).

    Raises:
        ValueError: ``beta`` other than 0.0, ``steps_per_generation`` other than ``gradient_accumulation_steps``
            (one line each: :func:`grpolab.trl.rloo_config.check_rloo`); what GRPOTrainer's constructor refuses.
    """

    method = "RLOO"
    absent_log_names = RLOO_ABSENT

    def __init__(
        self,
        model,
        reward_funcs,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        args = args if args is not None else RLOOConfig(output_dir=f"{model_name(model)}-RLOO")
        check_rloo(args)  # before the model loads: what the run would refuse when it starts
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def translate(self, world_size: int, train_rows: int | None, **kwargs):
        """grpolab's options for ``self.args`` (:func:`grpolab.trl.rloo_config.translate_rloo`)."""
        return translate_rloo(self.args, world_size, train_rows, **kwargs)
