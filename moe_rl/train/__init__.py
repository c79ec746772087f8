"""The RL training loop and its run directory."""
