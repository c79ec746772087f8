"""Rewards for finished samples: built-in scorers (``builtins``), user functions with verl's signature
(``custom``), the worker-process pool that runs them under a timeout (``pool``) and the scorer the
training loop calls (``scorer``)."""

from moe_rl.reward.scorer import Rewarder, RewardError, Scores, build_rewarder

__all__ = ["RewardError", "Rewarder", "Scores", "build_rewarder"]
