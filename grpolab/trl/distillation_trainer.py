"""TRL's ``DistillationTrainer``, run by grpolab: TRL 1.16's constructor and surface over :func:`grpolab.train`.

It is :class:`grpolab.trl.GRPOTrainer` with the distillation's config and translation
(:mod:`grpolab.trl.distillation_config`) and the teacher handed to grpolab's ``--teacher`` (``teacher_model=`` through
the API): the same run, callbacks, ``state.log_history`` (under the names TRL's DistillationTrainer logs: ``loss``,
``grad_norm``, ``learning_rate``, ``num_tokens``, ``completions/*``, ``entropy``, ``step_time``, beside grpolab's own,
``distill/kl`` and ``time/teacher_s`` among them) and ``save_model``; no loop of its own.

TRL's distillation has no reward. grpolab's run scores every rollout with a reward all the same (its books and the
doctor read one), so without ``reward_funcs`` it runs one that pays nothing (:func:`no_reward`); with them (a grpolab
keyword beyond TRL's), their rewards are computed and logged, not trained on.
"""

from __future__ import annotations

from grpolab.trl.arguments import processing_class_for
from grpolab.trl.distillation_config import DistillationConfig, translate_distillation
from grpolab.trl.logs import DISTILL_ABSENT, NO_REWARD
from grpolab.trl.trainer import GRPOTrainer, model_name


def no_reward(completions, **kwargs) -> list[float]:
    """0.0 for every completion: the reward of a distillation run given none (TRL's has no reward)."""
    return [0.0] * len(completions)


no_reward.__name__ = NO_REWARD


class DistillationTrainer(GRPOTrainer):
    """TRL's DistillationTrainer: ``DistillationTrainer(model, teacher_model, args=DistillationConfig(...),
    train_dataset=...).train()``.

    Args:
        model, train_dataset, processing_class, callbacks, optimizers, quantization_config, peft_config: as
            :class:`grpolab.trl.GRPOTrainer` takes them (``train_dataset``'s ``prompt`` column is read; one
            completion a prompt is sampled).
        teacher_model (str | transformers.PreTrainedModel | None): the teacher: a path or Hub id, or a loaded causal
            LM of the student's vocabulary (its tokenizer loaded from its path, else the student's). None:
            ``args.teacher_model_name_or_path``.
        args (DistillationConfig | None): TRL's distillation config (:mod:`grpolab.trl.distillation_fields` says what
            each field becomes). Default: ``DistillationConfig(output_dir="<model>-Distillation")``.
        eval_dataset: None only (grpolab does not build TRL's distillation evaluation).
        tools: None only.
        reward_funcs (Callable | list | None): grpolab's keyword beyond TRL's: reward functions whose rewards are
            computed and logged (not trained on). None: :func:`no_reward`.

    Raises:
        ValueError: no teacher; ``teacher_model_init_kwargs`` with a loaded teacher (TRL's); ``eval_dataset`` or
            ``tools`` given; what GRPOTrainer's constructor refuses.
    """

    method = "Distillation"
    absent_log_names = DISTILL_ABSENT

    def __init__(
        self,
        model,
        teacher_model=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        *,
        reward_funcs=None,
    ):
        args = args if args is not None else DistillationConfig(output_dir=f"{model_name(model)}-Distillation")
        if eval_dataset is not None:
            raise ValueError("DistillationTrainer(eval_dataset=...): TRL's distillation evaluation is not built here")
        if tools:
            raise ValueError("DistillationTrainer(tools=...): tool calls in distillation are not built here")
        self.teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if self.teacher_model is None:
            raise ValueError("A teacher model is required for distillation training: give teacher_model= or "
                             "DistillationConfig(teacher_model_name_or_path=...)")  # fmt: skip
        if not isinstance(self.teacher_model, str) and args.teacher_model_init_kwargs is not None:
            raise ValueError("You passed teacher_model_init_kwargs to the config, but your teacher_model is already "
                             "instantiated.")  # fmt: skip
        super().__init__(
            model,
            reward_funcs if reward_funcs is not None else no_reward,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    def translate(self, world_size: int, train_rows: int | None, **kwargs):
        """grpolab's options for ``self.args`` (:func:`grpolab.trl.distillation_config.translate_distillation`) and
        the teacher: ``teacher`` (a path or id) or ``teacher_model`` (a loaded model and its tokenizer)."""
        plan = translate_distillation(self.args, world_size, train_rows, **kwargs)
        return plan._replace(options=plan.options | self._teacher_option())

    def _teacher_option(self) -> dict:
        teacher = self.teacher_model
        if isinstance(teacher, str):
            return {"teacher": teacher}
        try:
            tokenizer = processing_class_for(teacher)
        except (ValueError, OSError):  # no path to load it from: the student's (a teacher shares its vocabulary)
            tokenizer = self.processing_class
        return {"teacher_model": (teacher, tokenizer)}

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Not built: TRL's distillation evaluation is the divergence on held-out prompts."""
        raise ValueError("DistillationTrainer.evaluate: TRL's distillation evaluation is not built here")
