"""One RL step's metrics row: the update results, rewards, responses and timings under their logged names.

Owns the names and the merge order of a trained step's row (later sources win on a shared key); it computes no
collective itself (the replay driver's, the records' and the staleness metrics are handed in) and writes nothing
(``moe_rl.train.metrics_log`` does).
"""

from __future__ import annotations

import torch

from moe_rl.learner.train_step import mean
from moe_rl.records import RolloutBatch
from moe_rl.train.update import MinibatchResult

__all__ = ["step_metrics"]


def step_metrics(
    cfg,
    batch: RolloutBatch,
    rewards: torch.Tensor,
    truncated: torch.Tensor,
    results: list[MinibatchResult],
    *,
    replay: dict,
    records: dict,
    stale: dict,
    alarm: dict,
    times: dict[str, float],
    ksm_outside: float = 0.0,
) -> dict[str, float]:
    """The row of a trained step: the mean of the minibatch update ``results``, then ``replay`` (the
    driver's step metrics), the reward function's own metrics, rewards and responses, ``records``, ``stale``,
    ``alarm`` (the KL alarm's row), ``times`` (``time/rollout_s``, ``time/old_logp_s``, ``time/train_s``),
    ``ksm_outside`` (``ksm/outside_mask_frac``, reduced over the data-parallel ranks' shares) and the rollout
    throughput."""
    metrics = mean(
        [r.metrics | {"train/loss": r.loss, "train/grad_norm": r.grad_norm, "train/lr": r.lr} for r in results]
    )
    metrics |= replay
    metrics |= batch.extra.get("reward_metrics", {})  # reward/errors, reward/<key> of a reward function
    metrics |= {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/max": float(rewards.max()),
        "response/len_mean": float(batch.response_lens.mean()),
        "response/len_max": float(batch.response_lens.max()),
        "response/truncated_frac": float(truncated.double().mean()),
        "response/masked_truncated": float(truncated.sum()) if cfg.train.mask_truncated else 0.0,
        "ksm/outside_mask_frac": ksm_outside,
        **records,
        **stale,
        **alarm,
        **times,
        "rollout/tokens_per_s": float(batch.response_lens.sum()) / max(times["time/rollout_s"], 1e-9),
    }
    return metrics
