"""Rewards: the built-in verifiable rewards, user reward functions in grpolab's or TRL's form, the code reward (its
programs run in :mod:`grpolab.sandbox`), reward models (:mod:`grpolab.rewards.model`, ``--reward-model``), and the
:class:`Rewarder` that scores a run's rollouts.

The names below are what ``--reward-fn grpolab.rewards:NAME`` takes.
"""

from grpolab.rewards.builtin import accuracy_reward, format_reward, overlong_penalty
from grpolab.rewards.code import code_reward
from grpolab.rewards.forms import from_trl, reward_form
from grpolab.rewards.model import RewardModel, load_reward_model
from grpolab.rewards.rewarder import Rewarder, Scores, score

__all__ = [
    "RewardModel",
    "Rewarder",
    "Scores",
    "accuracy_reward",
    "code_reward",
    "format_reward",
    "from_trl",
    "load_reward_model",
    "overlong_penalty",
    "reward_form",
    "score",
]
