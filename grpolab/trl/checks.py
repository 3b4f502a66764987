"""TRL 1.16's checks at ``GRPOTrainer(...)``: what TRL refuses there, refused there too, with TRL's exception type and a
message that says what TRL's says and how to fix it; and TRL's warnings on the objective, through :mod:`logging` as
TRL gives them (``logger.warning``).

TRL's ``GRPOTrainer.__init__`` (trl/trainer/grpo_trainer.py) checks, in this order (and so does :func:`check_arguments`,
so that a script with two mistakes hears of the same one first):

- ``args.reward_weights`` of another length than ``reward_funcs``;
- ``reward_processing_classes`` (one object: a list of it) of another length than ``reward_funcs``;
- an environment class without ``reset``;
- no reward source: no reward function, and no environment that pays one (TRL's ``get_reward``; grpolab's own shape,
  ``reset``/``step``, pays rewards turn by turn);
- no ``train_dataset``: without an environment; with a dict of environments (the rows' ``environment`` column
  routes them); with one environment that owns the data (its ``reset()`` returns the prompt) but no ``max_steps``
  above 0 to say how long to train.

One more, which TRL raises at the first batch that holds the row: a row whose ``environment`` names none of the dict's
environments (checked here where the rows are in memory; the episode runner checks the others).
"""

from __future__ import annotations

import inspect
import logging

from grpolab.env.trl_env import ROUTE  # the column that routes a row to one environment of a dict
from grpolab.trl.arguments import as_list

logger = logging.getLogger(__name__)

SUMMED_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")
"""TRL's loss types that sum per-token terms, so that a sequence-level ratio weighs a sequence by its length."""


def check_arguments(args, reward_funcs: list, reward_processing_classes, train_dataset, environment_factory) -> None:
    """TRL's construction checks (module docstring) on the trainer's arguments; ``reward_funcs`` as a list.

    Raises:
        ValueError: the first of TRL's conditions that holds, in TRL's order.
    """
    n = len(reward_funcs)
    if getattr(args, "reward_weights", None) is not None and len(args.reward_weights) != n:
        raise ValueError(
            f"GRPOConfig(reward_weights=...): the number of reward weights ({len(args.reward_weights)}) must match "
            f"the number of reward functions ({n}): give one weight per entry of reward_funcs"
        )
    classes = as_list(reward_processing_classes, n)
    if len(classes) != n:
        raise ValueError(
            f"GRPOTrainer(reward_processing_classes=...): the number of reward processing classes ({len(classes)}) "
            f"must match the number of reward functions ({n}): one per entry of reward_funcs (a reward model's "
            "tokenizer, None for a function)"
        )
    envs = environments(environment_factory)
    for cls in envs.values():
        if isinstance(cls, type) and "reset" not in _functions(cls):
            raise ValueError(
                f"GRPOTrainer(environment_factory=...): {cls.__qualname__} has no reset method; each environment "
                "instance returned by environment_factory must define a callable reset (reset(**row) -> str | None)"
            )
    if not reward_funcs and not any(_pays_rewards(cls) for cls in envs.values()):
        raise ValueError(
            "GRPOTrainer: no reward source provided: pass reward_funcs, or an environment_factory whose environment "
            "defines a get_reward method"
        )
    if train_dataset is None:
        _check_no_dataset(args, environment_factory)
    elif isinstance(environment_factory, dict):
        check_routes(train_dataset, list(envs))


def _check_no_dataset(args, environment_factory) -> None:
    """TRL's three conditions on training without a ``train_dataset``."""
    if environment_factory is None:
        raise ValueError(
            "GRPOTrainer: train_dataset is required unless an environment_factory is provided (an environment that "
            "owns the data returns the prompt from reset())"
        )
    if isinstance(environment_factory, dict):
        raise ValueError(
            "GRPOTrainer: a dict environment_factory (multiple environments) requires a train_dataset with an "
            f"{ROUTE!r} column to route each example to its environment; provide a dataset, or pass a single "
            "environment factory"
        )
    if args.max_steps <= 0:
        raise ValueError(
            "GRPOTrainer: when training without a train_dataset (the environment owns the data and returns the "
            f"prompt from reset()), max_steps must be set to a positive value to define the training length (it is "
            f"{args.max_steps}): set it via GRPOConfig(max_steps=...)"
        )


def check_routes(rows, names: list) -> None:
    """Every row of ``rows`` (a ``datasets.Dataset`` or a list of dicts; other data is checked as it is read) routed
    by its ``environment`` to one of ``names``; else TRL's ValueError naming the first value that is not one."""
    import datasets

    if isinstance(rows, datasets.Dataset):
        values = rows[ROUTE] if ROUTE in rows.column_names else [None] * len(rows)
    elif isinstance(rows, list | tuple) and all(isinstance(r, dict) for r in rows):
        values = [r.get(ROUTE) for r in rows]
    else:
        return
    for value in dict.fromkeys(values):
        if value not in names:
            raise ValueError(
                f"train_dataset: an example has {ROUTE}={value!r}, which is not among the environments passed to "
                f"environment_factory. Expected one of: {names}"
            )


def warn_as_trl(args) -> None:
    """TRL's warnings on ``loss_type`` with ``importance_sampling_level`` (TRL gives them as the trainer is built),
    through :data:`logger`."""
    loss, level = getattr(args, "loss_type", None), getattr(args, "importance_sampling_level", "token")  # GRPO's
    if loss == "luspo" and level != "sequence":
        logger.warning(
            "loss_type='luspo': importance_sampling_level should be set to 'sequence' to mirror the paper's setup "
            f"(it is {level!r})"
        )
    if loss == "vespo" and level != "token":
        logger.warning(
            "loss_type='vespo' computes sequence-level importance weights internally: importance_sampling_level "
            f"should be set to 'token' (the default; it is {level!r})"
        )
    if level == "sequence" and loss in SUMMED_LOSSES:
        logger.warning(
            f"importance_sampling_level='sequence' with loss_type={loss!r}: the {loss!r} loss sums per-token "
            "contributions, which weights each sequence by its completion length instead of optimizing the "
            "per-sequence objective; to reproduce the GSPO paper's setup, set loss_type='grpo'"
        )


def environments(environment_factory) -> dict:
    """``{name: class}`` of ``environment_factory``: a dict as it is, one class under the name None (TRL's)."""
    if environment_factory is None:
        return {}
    return dict(environment_factory) if isinstance(environment_factory, dict) else {None: environment_factory}


def _functions(cls: type) -> set[str]:
    """The functions defined on ``cls`` (listed on the class, as TRL lists them, so that no property runs)."""
    return {name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)}


def _pays_rewards(cls) -> bool:
    """Whether an environment is a reward source: TRL's shape with ``get_reward``, or grpolab's own (``step`` returns
    each turn's reward). A factory that is not a class is left to the episode runner's checks."""
    if not isinstance(cls, type):
        return True
    return bool({"get_reward", "step"} & _functions(cls))
