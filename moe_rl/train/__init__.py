"""The RL training loop and what runs around it (warm start, closing summary)."""
