"""The training loop and what it consumes: the step plan, batching, the update passes, metrics sinks, warm start, closing summary."""
