"""Rollout side: SGLang launcher and client, synthetic tasks, rewards, task tokenizer."""
