"""Streaming datasets (``datasets.IterableDataset``) under the drop-in.

grpolab's samplers index their rows (a seeded order, a checkpointed position), so a stream is read once, when
``train()`` starts, for the rows the run takes: ``max_steps`` generations of ``prompts`` each, in the stream's order
(TRL's dataloader does not shuffle a stream either). A resumed run reads the same rows again and continues from the
position its checkpoint holds, so it equals the run that was not stopped. A held-out stream is read whole.
"""

from __future__ import annotations

import itertools


def is_stream(dataset) -> bool:
    """Whether ``dataset`` is a stream: a ``datasets.IterableDataset`` (or any iterable of rows without a length)."""
    if dataset is None or isinstance(dataset, list | tuple | dict):
        return False
    try:
        from datasets import IterableDataset

        if isinstance(dataset, IterableDataset):
            return True
    except ImportError:  # datasets is a dependency; a stream of another kind is still an iterable without len
        pass
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__len__")


def read_stream(dataset, rows: int | None = None, what: str = "train_dataset"):
    """The first ``rows`` rows of the stream ``dataset`` (None: all of them) as a ``datasets.Dataset``. A stream with
    no row is a ValueError naming ``what``."""
    from datasets import Dataset

    taken = list(itertools.islice(iter(dataset), rows))
    if not taken:
        raise ValueError(f"{what}: the stream gave no row")
    return Dataset.from_list([dict(r) for r in taken])


def check_stream_steps(max_steps: int) -> None:
    """A stream has no length to count epochs by: ``max_steps`` must say how long to train (transformers' Trainer
    checks it when built)."""
    if max_steps <= 0:
        raise ValueError(
            "The train_dataset does not implement __len__, so the number of training steps cannot be inferred; "
            "max_steps has to be specified (a streaming train_dataset trains for max_steps)"
        )
