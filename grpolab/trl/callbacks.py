"""TRL's callbacks and ``state.log_history`` for :class:`grpolab.trl.GRPOTrainer`: grpolab's run hooks
(:class:`grpolab.training.recipe.RunHooks`) told of each step, as transformers' ``TrainerState``, ``CallbackHandler``
and the ``checkpoint-N`` directories ``get_last_checkpoint`` looks for."""

from __future__ import annotations

import math
from pathlib import Path

from grpolab.trl.evaluation import eval_batch_prompts, eval_group_size, evaluation_metrics
from grpolab.trl.logs import accuracy_keys, trl_entry

CHECKPOINT_PREFIX = "checkpoint-"
"""transformers' name for a checkpoint directory (``get_last_checkpoint`` finds ``checkpoint-N`` in output_dir)."""


def link_checkpoint(out: Path, step: int, optimizer_steps: int) -> None:
    """``out/checkpoint-N`` (N: TRL's count, the optimizer steps) for grpolab's ``checkpoints/step_<step>``, where
    transformers' ``get_last_checkpoint`` looks: a relative symlink, made once the checkpoint is whole (so a run killed
    mid-save leaves no link to a partial one), and the links to checkpoints that rotation removed are taken away."""
    target = Path("checkpoints") / f"step_{step}"
    link = out / f"{CHECKPOINT_PREFIX}{optimizer_steps}"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)
    for old in out.glob(f"{CHECKPOINT_PREFIX}*"):
        if old.is_symlink() and not old.exists():  # its checkpoint was rotated out (save_total_limit)
            old.unlink()


def tokens_seen(metrics_file: Path, step: int) -> int:
    """The prompt and completion tokens of the run's rollouts up to ``step`` (``sampling/tokens`` summed over
    metrics.jsonl): TRL's ``num_input_tokens_seen`` where a resumed run starts."""
    if step == 0 or not metrics_file.is_file():
        return 0
    from grpolab.training.runlog import read_metrics

    return int(sum(m.get("sampling/tokens") or 0 for m in read_metrics(metrics_file) if m.get("step", 0) <= step))


def trainer_state():
    """A new transformers ``TrainerState``: what callbacks read and ``log_history`` lives in."""
    from transformers import TrainerState

    return TrainerState()


def callback_handler(callbacks: list):
    """transformers' ``CallbackHandler`` over its ``DefaultFlowCallback`` and ``callbacks``, as Trainer builds it."""
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

    return CallbackHandler([DefaultFlowCallback, *callbacks], None, None, None, None)


class RunCallbacks:
    """grpolab's run hooks as TRL's callbacks and log_history (every rank calls them; callbacks and logs on rank 0,
    as TRL's ``is_world_process_zero``)."""

    def __init__(self, trainer, plan, parts: list | None = None):
        from transformers import TrainerControl

        self.t, self.plan = trainer, plan
        self.parts = parts or []  # the eval datasets (grpolab.trl.evaluation.EvalPart), held out one after the other
        self.recipe = None  # the run's (begin)
        self.per_step = plan.optimizer_steps_per_step  # optimizer steps in one grpolab step
        self.per_epoch, self.steps = plan.steps_per_epoch, plan.options["steps"]
        self.window: list[dict] = []  # the steps since the last log_history entry
        self.evaluated_last = False  # an evaluation ran after the last step (TRL's summary then has no step metrics)
        self.control = TrainerControl()
        trainer.control = self.control

    def _epoch(self, step: int) -> float:
        return step / self.per_epoch if self.per_epoch else 0.0

    def _call(self, event: str, **kwargs) -> None:
        handler, t = self.t.callback_handler, self.t
        getattr(handler, event)(t.args, t.state, self.control, **kwargs)

    def begin(self, recipe) -> None:
        self.recipe = recipe
        t, args = self.t, self.t.args
        handler = t.callback_handler
        policy = recipe.trainer.policy
        handler.model, handler.processing_class = policy.model, policy.processor or policy.tokenizer
        learner = recipe.trainer.update_stage
        handler.optimizer, handler.lr_scheduler = learner.optimizer, learner.scheduler
        state = t.state
        state.max_steps = recipe.cfg.run.steps * self.per_step
        state.global_step = recipe.start * self.per_step
        state.epoch = self._epoch(recipe.start)
        state.num_train_epochs = math.ceil(recipe.cfg.run.steps / self.per_epoch) if self.per_epoch else 1
        state.logging_steps = self.plan.log_every * self.per_step
        state.save_steps = recipe.cfg.logging.save_every * self.per_step
        state.eval_steps = recipe.cfg.eval.eval_every * self.per_step
        state.train_batch_size = args.per_device_train_batch_size
        state.is_local_process_zero = state.is_world_process_zero = recipe.world.is_main
        state.num_input_tokens_seen = tokens_seen(Path(recipe.out) / "metrics.jsonl", recipe.start)
        self._call("on_train_begin")

    def evaluated(self, step: int, metrics: dict) -> None:
        """Where grpolab evaluated (``metrics`` holds its ``eval/*``; any step's: ``step_end`` passes its own on) at
        one of TRL's evaluations: TRL's evaluation of each eval dataset with the run's policy, service and reward
        (:func:`grpolab.training.evaluation.evaluate_groups`; every rank draws its share), each a log_history entry
        told to ``on_log`` and ``on_evaluate``, grpolab's own accuracy (``eval_accuracy_*``) beside the last one's."""
        strategy = getattr(self.t.args.eval_strategy, "value", self.t.args.eval_strategy)
        # TRL evaluates after a step (grpolab's step-0 baseline is in metrics.jsonl) and never under "no" (grpolab's
        # evaluation at the end is then in metrics.jsonl alone)
        if not (any(k.startswith("eval/") for k in metrics) and step > 0 and strategy != "no"):
            return
        from grpolab.algo.groups import offsets
        from grpolab.training.evaluation import evaluate_groups

        self.evaluated_last = step == self.steps
        t, trainer, world = self.t, self.recipe.trainer, self.recipe.world.size
        bounds = offsets([len(part.rows) for part in self.parts])
        records = [trainer.task_stage.held_out[a:b] for a, b in zip(bounds, bounds[1:])]
        evaluations = evaluate_groups(trainer, records, eval_group_size(t.args), eval_batch_prompts(t.args, world))
        for i, (part, evaluation) in enumerate(zip(self.parts, evaluations)):
            prefix = "eval" if part.name is None else f"eval_{part.name}"
            entry = evaluation_metrics(evaluation, part, prefix, t.args, world, t.state.num_input_tokens_seen,
                                       t.model_preparation_time)  # fmt: skip
            entry |= accuracy_keys(metrics) if i == len(self.parts) - 1 else {}
            entry["epoch"] = self._epoch(step)
            t.state.log_history.append({**entry, "step": step * self.per_step})
            self._call("on_log", logs=entry)
            self._call("on_evaluate", metrics=entry)

    def step_end(self, step: int, metrics: dict, saved: bool) -> bool:
        state = self.t.state
        state.global_step, state.epoch = step * self.per_step, self._epoch(step)
        state.num_input_tokens_seen += metrics.get("sampling/tokens") or 0
        self.window.append(metrics | {"num_tokens": state.num_input_tokens_seen})  # TRL's: the count so far
        self._call("on_step_begin")
        self._call("on_step_end")
        every = self.plan.log_every
        first = step == 1 and self.t.args.logging_first_step
        if (every and step % every == 0) or first:  # steps after the last such: the summary entry (train())
            entry = trl_entry(self.window, state.global_step, state.epoch, self.t.absent_log_names)
            self.window = []
            state.log_history.append(entry)
            self._call("on_log", logs=entry)
        self.evaluated(step, metrics)
        if saved:
            if self.t.is_world_process_zero():
                link_checkpoint(Path(self.t.args.output_dir), step, state.global_step)
            self._call("on_save")
        return bool(self.control.should_training_stop)

    def end(self, recipe) -> None:
        self._call("on_train_end")
