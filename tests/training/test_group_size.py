"""--group-size-control rank's controller in the sampling stage (grpolab.training.group_size)."""

from __future__ import annotations

from grpolab.algo.group_budget import RankControl
from grpolab.common.distributed import SINGLE
from grpolab.config.rollout import GenerationSection, GroupsSection
from grpolab.rollout.collect import CollectSettings
from grpolab.training.group_size import GroupSizeControl


def test_the_controller_keeps_the_rollout_budget_and_carries_its_state():
    groups = GroupsSection(prompts_per_step=8, group_size=4, group_size_control="rank")
    control = GroupSizeControl(groups, SINGLE)
    settings = control.settings(CollectSettings.of(groups, GenerationSection(), seed=0))
    assert (settings.group_size, settings.prompts_per_step) == (4, 8)
    control.control = RankControl(group_size=8, reference=3.5, changed_at=1)  # as the probe may leave it
    settings = control.settings(settings)
    assert (settings.group_size, settings.prompts_per_step) == (8, 4)  # B x G = 32 rollouts either way
    resumed = GroupSizeControl(groups, SINGLE)
    resumed.load_state_dict(control.state_dict())
    assert resumed.control == control.control
    metrics = {}
    control.after_step(1, metrics)
    assert metrics["control/group_size"] == 8  # this step's G, logged
