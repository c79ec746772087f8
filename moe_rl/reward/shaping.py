"""Reward shaping applied to every scored sample: DAPO's soft overlong punishment.

verl (``reward_manager/dapo.py``): with ``expected = max_resp_len - buffer``, a response of ``L``
tokens gets ``min(-(L - expected) / buffer * penalty_factor, 0)`` added to its reward: 0 up to
``expected`` tokens, falling linearly to ``-penalty_factor`` at ``max_resp_len`` (DAPO, Yu et al. 2025,
"Overlong Reward Shaping"). ``reward.overlong_buffer: {length, penalty}`` with ``max_resp_len`` =
``rollout.max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["overlong_penalties"]


def overlong_penalties(lengths: Sequence[int], max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """Per-sample penalty (<= 0) for response ``lengths`` (tokens) under a ``buffer`` before ``max_new_tokens``."""
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(
            f"reward.overlong_buffer.length={buffer} must be in [1, rollout.max_new_tokens={max_new_tokens}]"
        )
    expected = max_new_tokens - buffer
    exceed = np.asarray(lengths, dtype=np.float64) - expected
    return np.minimum(-exceed / buffer * penalty, 0.0)
