"""A run's options resolved once (grpolab.training.setup): what --precision, --rollout-dtype and --engine-correction
``auto`` become, and a trainer that refuses a config still holding them."""

from __future__ import annotations

import pytest
from helpers.runs import quiet, small_cfg

from grpolab.config.train import RESOLVED_AT_START
from grpolab.training.setup import is_resolved, resolve_config, resolve_options, run_precision, weights_dtype


def _resolved(tmp_path, **over):
    return resolve_config(small_cfg(tmp_path, **over))


def test_auto_resolves_for_the_device_and_model(tmp_path):
    cfg = _resolved(tmp_path)
    # the built-in model trains in fp32 on a CPU and samples with its own fp32 weights: an exact engine
    assert (cfg.machine.precision, cfg.engine.rollout_dtype, cfg.objective.engine_correction) == (
        "32-true", "float32", "none")  # fmt: skip
    assert is_resolved(cfg) and not is_resolved(small_cfg(tmp_path))
    assert resolve_options(cfg) == cfg  # resolving twice changes nothing


@pytest.mark.parametrize(
    ("over", "correction"),
    [
        (dict(max_staleness=1), "sequence-truncate"),  # stale weights draw: a mismatch to weigh
        (dict(rollout_dtype="bfloat16"), "sequence-truncate"),  # another dtype's kernels
        (dict(rollout_dtype="float64"), "sequence-truncate"),  # another wide dtype: still not the trainer's
        (dict(loss_type="vespo"), "none"),  # vespo takes no correction
        (dict(engine_correction="sequence-mask"), "sequence-mask"),  # a choice is itself
    ],
)
def test_the_engine_correction_is_none_only_for_an_exact_engine(tmp_path, over, correction):
    assert _resolved(tmp_path, **over).objective.engine_correction == correction


def test_an_engine_object_given_is_taken_as_exact(tmp_path):
    cfg = resolve_config(small_cfg(tmp_path, rollout_dtype="bfloat16"), engine_given=True)
    assert cfg.objective.engine_correction == "none"


def test_precision_is_read_from_the_resolved_config(tmp_path):
    cfg = _resolved(tmp_path, dtype="float64")  # the --dtype alias of 64-true
    assert run_precision(cfg).name == "64-true" and str(weights_dtype(cfg, run_precision(cfg))) == "torch.float64"
    with pytest.raises(ValueError, match="resolved config"):
        run_precision(small_cfg(tmp_path))


def test_a_trainer_refuses_a_config_that_is_not_resolved(tmp_path):
    from grpolab.training.trainer import GRPOTrainer

    with pytest.raises(ValueError, match="resolved config"):
        GRPOTrainer(small_cfg(tmp_path), log=quiet)
    assert {"precision", "rollout_dtype", "engine_correction"} == set(RESOLVED_AT_START)
