"""Every stage's state through one checkpoint (grpolab.training.checkpoints): what the trainer, the update stage and
the sampling stage carry across a resume is written beside the weights and given back to a fresh trainer."""

from __future__ import annotations

import dataclasses
import json

from helpers.runs import quiet, small_cfg

from grpolab.algo.group_budget import RankControl
from grpolab.training import checkpoints
from grpolab.training.recipe import build_trainer


def test_each_stage_gets_back_what_it_saved(tmp_path):
    cfg = small_cfg(tmp_path, adaptive_entropy=True, entropy_coef=0.01, group_size_control="rank", probe_every=1)
    saved = build_trainer(cfg, log=quiet)
    saved.rollouts_total = 48
    entropy = saved.update_stage.updater.entropy
    saved.update_stage.updater.entropy = dataclasses.replace(entropy, coef=0.02)
    saved.sampling_stage.control.control = RankControl(group_size=8, reference=2.5, changed_at=1)
    saved.update_stage.scheduler.step()  # the schedule one optimizer step on (its own file)
    checkpoints.save(saved, tmp_path, 1)
    ckpt = tmp_path / "checkpoints" / "step_1"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert {"step", "seed", "world_size", "rollouts_total", "entropy_control", "rank_control"} <= set(state)

    resumed = build_trainer(cfg, log=quiet)
    assert resumed.update_stage.updater.entropy.coef == 0.01 and resumed.rollouts_total == 0
    assert checkpoints.restore(resumed, ckpt)["step"] == 1
    assert resumed.rollouts_total == 48
    assert resumed.update_stage.updater.entropy == saved.update_stage.updater.entropy
    assert resumed.sampling_stage.control.control == RankControl(group_size=8, reference=2.5, changed_at=1)
    assert resumed.update_stage.scheduler.last_epoch == 1
