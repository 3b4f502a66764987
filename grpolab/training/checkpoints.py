"""A run's checkpoints: every stage's state saved into ``checkpoints/step_N`` and loaded back on --resume.

The files are :mod:`grpolab.models.checkpoint`'s (the weights, ``optimizer.pt``, ``scheduler.pt``, ``rng.pt``,
``trainer_state.json`` and its manifest); this module asks each stage what it carries across a resume
(``state_dict()``: the trainer's rollout count, the update stage's entropy control and loss scale, the sampling
stage's group-size controller and --max-staleness's weight versions) and gives it back (``load_state_dict``). Every
key of ``trainer_state.json`` a checkpoint written by an earlier version holds is read as it was: a key missing from
an older one leaves the stage as it starts.
"""

from __future__ import annotations

from pathlib import Path

from grpolab.common import distributed as dist_
from grpolab.models import checkpoint


def save(trainer, out: Path, step: int) -> None:
    """Rank 0 writes ``out/checkpoints/step_{step}`` for ``trainer`` (:class:`grpolab.training.trainer.GRPOTrainer`);
    under FSDP every rank first sends it its shards. A checkpoint holds whole tensors whatever the process count, so
    any number of processes (or one) can resume it."""
    learner = trainer.update_stage
    model_state = optim_state = None
    if learner.train_module.fsdp:
        model_state, optim_state = learner.train_module.full_state(learner.optimizer)
    # Nobody runs ahead of (or resumes from) a checkpoint still being written, and a save that fails on rank 0,
    # whatever the error, stops every rank at once.
    dist_.on_main(
        lambda: _write(trainer, out, step, model_state, optim_state),
        trainer.world,
        lambda: checkpoint.CheckpointError(
            f"could not write checkpoint step_{step} in {out / 'checkpoints'} (see rank 0)"
        ),
    )


def _write(trainer, out: Path, step: int, model_state, optim_state) -> None:
    """Rank 0's part of :func:`save`: each stage's state beside the weights, the optimizer and the schedule."""
    learner = trainer.update_stage
    state = {**trainer.state_dict(), **learner.state_dict(), **trainer.sampling_stage.state_dict()}
    tensors = state.pop("files", {})  # safetensors files beside the others, by name
    checkpoint.save(
        out,
        step,
        learner.policy.model,
        learner.policy.processor or learner.policy.tokenizer,  # a vision-language model's: images and text
        learner.optimizer,
        learner.scheduler,
        state,
        keep=trainer.cfg.logging.keep_checkpoints,
        model_state=model_state,
        optimizer_state=optim_state,
        tensors=tensors,
    )


def restore(trainer, ckpt: Path) -> dict:
    """Load ``ckpt`` into ``trainer``'s stages (its weights are loaded where the policy is built): the optimizer, the
    schedule and the random state, then each stage's own state. Returns the checkpoint's ``trainer_state.json``."""
    state = trainer.update_stage.load_training_state(ckpt)
    trainer.load_state_dict(state)
    trainer.update_stage.load_state_dict(state)
    trainer.sampling_stage.load_state_dict(state, lambda name: checkpoint.load_tensors(ckpt, name))
    return state
