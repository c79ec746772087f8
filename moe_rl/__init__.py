"""moe_rl: RL post-training for Mixture-of-Experts LLMs with rollout/learner alignment.

Record (SGLang rollout: log-probs, routes, sampling masks), replay (R2/R3 routing,
Keep Sampling Mask in the Megatron-Core learner), correct (IS/RS/IcePop, PPO/GSPO).
"""

__version__ = "0.1.0"
