"""The reward door: an RL trainer's finished rollouts scored as runs."""

from ._api import RewardSource

__all__ = [
    "RewardSource",
]
