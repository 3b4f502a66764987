"""Builders the tests share: configs as a command builds them, a run's task as the probes see it."""

from __future__ import annotations

from grpolab.config import fields


def for_run(cls, spec: str, model_field: str, **options):
    """A ``cls`` config as ``grpolab`` builds one for the model or run ``spec``: the run's own options as the
    defaults (:func:`grpolab.eval.runs.run_defaults`), then ``options``."""
    from grpolab.eval.runs import run_defaults

    base = run_defaults(cls, spec) or cls()
    return fields.replace(base, **{model_field: spec}, **options)


def task_of(cfg):
    """The :class:`grpolab.eval.runs.RunTask` of a training config: what a probe of its run measures on."""
    from grpolab.eval.runs import RunTask, Target
    from grpolab.training.setup import checked_config

    checked = checked_config(cfg)
    return RunTask.of(Target(checked.policy.model, None, checked.to_dict()))
