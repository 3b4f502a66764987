"""--data-order: which training records of --data a step takes (replacement, shuffle or sequential epochs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.runs import quiet, small_cfg

from grpolab.common import streams
from grpolab.common.errors import ConfigError
from grpolab.config.task import DataSection
from grpolab.data import DataError, ListSampler

RECORDS = [{"question": f"q{i}"} for i in range(10)]


def _ids(records: list[dict]) -> list[int]:
    return [int(r["question"][1:]) for r in records]


def _epoch(sampler: ListSampler, first_step: int, n: int) -> list[int]:
    """The record ids of the epoch that starts at ``first_step``."""
    return [i for s in range(first_step, first_step + sampler.steps_per_epoch(n)) for i in _ids(sampler.draw(s, n))]


def test_replacement_is_the_default_and_draws_as_before():
    sampler = ListSampler(RECORDS, seed=3)
    assert sampler.order == DataSection().data_order == "replacement"
    for step in (1, 2, 7):
        rng = np.random.default_rng([streams.DATA_DRAW, 3, step])
        assert _ids(sampler.draw(step, 4)) == rng.integers(10, size=4).tolist()
    again = np.random.default_rng([streams.DATA_DRAW, 3, 5, 2]).integers(10, size=20).tolist()
    assert _ids(sampler.draw(5, 20, round=2)) == again  # more than the records: replacement allows it
    few = np.random.default_rng([streams.FEW_SHOT, 3, 0]).integers(10, size=3).tolist()
    assert _ids(sampler.few_shot(3)) == few


def test_sequential_takes_the_records_in_order_and_drops_the_incomplete_chunk():
    sampler = ListSampler(RECORDS, seed=3, order="sequential")
    assert sampler.steps_per_epoch(4) == 2
    assert [_ids(sampler.draw(s, 4)) for s in range(1, 6)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],  # 8 and 9 (an incomplete chunk) are dropped
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]
    assert [_ids(sampler.draw(s, 5)) for s in (1, 2, 3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]


def test_shuffle_epochs_are_seeded_permutations():
    sampler = ListSampler(RECORDS, seed=3, order="shuffle")
    n, per_epoch = 3, 3  # 9 of the 10 records an epoch
    epochs = [_epoch(sampler, 1 + e * per_epoch, n) for e in range(4)]
    for e, ids in enumerate(epochs):
        assert len(ids) == len(set(ids)) == 9  # no repeat within an epoch; one record dropped
        perm = np.random.default_rng([streams.DATA_DRAW, 3, e]).permutation(10)
        assert ids == perm[:9].tolist()
    assert len({tuple(ids) for ids in epochs}) == 4  # each epoch its own order
    assert {len(set(range(10)) - set(ids)) for ids in epochs} == {1}
    # the same seed gives the same order; another seed another
    assert _epoch(ListSampler(RECORDS, seed=3, order="shuffle"), 1, n) == epochs[0]
    assert _epoch(ListSampler(RECORDS, seed=4, order="shuffle"), 1, n) != epochs[0]


def test_shuffle_draw_depends_only_on_seed_and_step():
    """A resumed run (a new sampler, steps from the middle) takes what the uninterrupted one took."""
    whole = ListSampler(RECORDS, seed=5, order="shuffle")
    straight = [_ids(whole.draw(s, 4)) for s in range(1, 9)]
    resumed = ListSampler(RECORDS, seed=5, order="shuffle")
    assert [_ids(resumed.draw(s, 4)) for s in range(8, 4, -1)] == straight[4:][::-1]


def test_later_filter_rounds_still_draw_with_replacement():
    sampler = ListSampler(RECORDS, seed=3, order="sequential")
    rng = np.random.default_rng([streams.DATA_DRAW, 3, 2, 1])
    assert _ids(sampler.draw(2, 4, round=1)) == rng.integers(10, size=4).tolist()


@pytest.mark.parametrize("order", ["shuffle", "sequential"])
def test_more_prompts_than_records_is_one_line(order):
    with pytest.raises(DataError, match=f"--data-order {order}: 11 prompts per step but --data has only 10"):
        ListSampler(RECORDS, seed=0, order=order).draw(1, 11)


def test_data_order_is_validated():
    with pytest.raises(ConfigError, match="--data-order: must be one of"):
        DataSection(data="x.jsonl", data_order="random").validate()
    with pytest.raises(ConfigError, match="--data-order: shuffle needs --data"):
        DataSection(data_order="shuffle").validate()
    DataSection(data="x.jsonl", data_order="sequential").validate()


def test_data_order_flag_reaches_the_trainer(tmp_path):
    """``--data-order sequential`` on the command line: step 1 trains on the first B records of the file."""
    from grpolab.commands.parsing import parse_config
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import build_trainer

    data = tmp_path / "train.jsonl"
    rows = [{"question": f"{i}+1", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(10, 20)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(TrainConfig, ["--data", str(data), "--data-order", "sequential"], "grpolab train", "")
    assert cfg.dataset.data_order == "sequential"
    cfg = small_cfg(tmp_path / "run", data=str(data), data_order="sequential", eval_fraction=0.0, steps=1)
    trainer = build_trainer(cfg, log=quiet)
    result = trainer.step(1)
    assert [r["question"] for r in result.collected.groups.records] == [r["question"] for r in rows[:4]]
