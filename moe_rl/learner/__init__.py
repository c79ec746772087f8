"""Megatron-Core MoE learner: model build, CPU support, log-probs, train step, HF conversion, checkpoints."""
