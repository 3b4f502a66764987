"""--group-size-control rank: the group size G each step draws, moved by the spectrum probe's effective rank under a
fixed rollout budget per step (:func:`grpolab.algo.group_budget.rank_control`)."""

from __future__ import annotations

import dataclasses

from grpolab.algo.group_budget import RankControl, rank_control
from grpolab.common.distributed import World
from grpolab.config.rollout import GroupsSection
from grpolab.rollout.collect import CollectSettings


class GroupSizeControl:
    """The controller of a run's group size and its state across a resume (``rank_control`` in a checkpoint)."""

    def __init__(self, groups: GroupsSection, world: World):
        self.groups, self.world = groups, world
        self.control = RankControl(groups.group_size)

    def settings(self, settings: CollectSettings) -> CollectSettings:
        """``settings`` with the controller's G and the prompts that keep the step's rollout budget."""
        G = self.control.group_size
        return dataclasses.replace(settings, group_size=G, prompts_per_step=self.groups.rollouts_per_step // G)

    def after_step(self, step: int, metrics: dict) -> None:
        """What this step's probe (``probe/eff_rank`` in ``metrics``) says about the next step's G; logs this step's as
        ``control/group_size``. Every rank decides the same: the probe's metrics are gathered."""
        metrics["control/group_size"] = self.control.group_size
        groups, size = self.groups, self.world.size
        self.control = rank_control(
            self.control, step, metrics.get("probe/eff_rank"), groups.rollouts_per_step, max(2, size),
            groups.control_patience, divisor=size, share=groups.control_share,
        )  # fmt: skip

    def state_dict(self) -> dict:
        return {"rank_control": dataclasses.asdict(self.control)}

    def load_state_dict(self, state: dict) -> None:
        if "rank_control" in state:
            self.control = RankControl(**state["rank_control"])
