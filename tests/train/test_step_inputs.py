"""The training step's inputs beyond the log-probs (issue 54): Σ_v π_v² per token for the optimal token baselines
and VCPO's exact gradient norm, per-token advantage rows in the microbatches. Hand-derived values; the
1-rank = 2-rank step and A-3PO's interpolation are in tests/distributed/test_methods_ranks.py, the tp all-reduce
in tests/distributed/test_tp_shards.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.records import RolloutBatch, RolloutSample
from moe_rl.replay.keep_mask import KeptSets, kept_sum_pi_squared
from moe_rl.train.batching import build_microbatch
from moe_rl.train.update import needs_sum_pi_squared, runs_old_logprob_pass, step_advantages
from tests.train.records_fixture import CONFIG

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_kept_set_sum_pi_squared_by_hand(device):
    """Row 0: z = (0, ln 2, ln 3, 5), kept {0, 1}, target 1: π over K = (1/3, 2/3), Σπ² = 1/9 + 4/9 = 5/9.
    Row 1: untruncated (empty kept row), z = 0: π = 1/4 each, Σπ² = 4/16 = 1/4.
    Row 2: kept {3} but target 2 (the sampled token is always kept): K = {2, 3}; at T = 2, z_K = (2 ln 3, 0) / 2:
    π ∝ (3, 1), Σπ² = (9 + 1)/16 = 5/8 (rows 0 and 1 doubled, so that T = 2 gives them back).
    Σπ instead of Σπ² would give 1 on every row; the full softmax instead of the kept set, row 0: 5/9 is not
    (1 + 4 + 9 + e^10)/(6 + e^5)²."""
    z = torch.tensor(
        [[0.0, LN2, LN3, 5.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2 * LN3, 0.0]], dtype=torch.float64, device=device
    )
    kept = KeptSets.from_lists([[0, 1], None, [3]])
    targets = torch.tensor([1, 0, 2], device=device)
    got = kept_sum_pi_squared(z[:2], targets[:2], KeptSets.from_lists([[0, 1], None]), temperature=1.0)
    torch.testing.assert_close(got, torch.tensor([5 / 9, 1 / 4], dtype=torch.float64, device=device))
    got = kept_sum_pi_squared(z * torch.tensor([[2.0], [1.0], [1.0]], dtype=z.dtype, device=device), targets, kept, 2.0)
    torch.testing.assert_close(got, torch.tensor([5 / 9, 1 / 4, 5 / 8], dtype=torch.float64, device=device))


def _batch(old: list[list[float]]) -> RolloutBatch:
    samples = [
        RolloutSample(
            np.array([1, 2], np.int32),
            np.array([3 + j for j in range(len(lp))], np.int32),
            rollout_logp=np.array(lp, np.float32),
            weight_version="step-0",
        )
        for lp in old
    ]
    return RolloutBatch.from_samples(samples)


# one group of 2: A (2 tokens, π = 1/2, 1/4; Σπ² = 1/2, 1/4), B (3 tokens, π = 1/2; Σπ² = 1/2), rewards 1, 0
OLD = [[math.log(0.5), math.log(0.25)], [math.log(0.5)] * 3]
SPP = torch.tensor([[0.5, 0.25, 0.0], [0.5, 0.5, 0.5]])


def _rows(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor([v + [0.0] * (3 - len(v)) for v in values])


def _cfg(*overrides: str):
    return load_config(CONFIG, ["replay.keep_sampling_mask=false", "rollout.samples_per_prompt=2", *overrides])


def test_optimal_token_baseline_step_advantages_by_hand():
    """w_t = 1 − 2π_t + Σπ²: A (1/2, 3/4), B (1/2, 1/2, 1/2); W = cumulative: A (1/2, 5/4), B (1/2, 1, 3/2).
    B_t = Σ_i r_i W_it / Σ_i W_it: B_0 = (1/2)/(1) = 1/2, B_1 = (5/4)/(9/4) = 5/9; t = 2 only B reaches, and
    handle_zero_tail zeroes the baseline past the second-longest length (2). A = r − B: A (1/2, 4/9), B (−1/2,
    −5/9, 0). Returned as [N, R] rows, which the microbatches spread to [B, T] at the response positions."""
    batch = _batch(OLD)
    cfg = _cfg("advantage.estimator=optimal_token_baseline")
    assert needs_sum_pi_squared(cfg) and runs_old_logprob_pass(cfg)
    adv = step_advantages(cfg, batch, torch.tensor([1.0, 0.0], dtype=torch.float64), _rows(OLD), 3, SPP)
    want = torch.tensor([[0.5, 4 / 9, 0.0], [-0.5, -5 / 9, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-7, rtol=0)
    mb = build_microbatch(batch, [1, 0], adv, num_experts=8, kept_logp=False, with_kept_sets=False)
    # sample B: tokens 1 2 3 4 5 -> response targets at positions 1..3; sample A: positions 1, 2
    torch.testing.assert_close(mb.tensors["advantages"], torch.tensor([[0, -0.5, -5 / 9, 0], [0, 0.5, 4 / 9, 0]]))
    with pytest.raises(ValueError, match="needs π_old and Σ_v π_v² rows"):
        step_advantages(cfg, batch, torch.tensor([1.0, 0.0], dtype=torch.float64), _rows(OLD), 3, None)


def test_vcpo_gradient_norm_is_exact_with_sum_pi_squared():
    """OPOB: b = Σ w² n_i r_i / Σ w² n_i, IS weights w = 1 (μ = π_old). Exact n_i = Σ_t (1 − 2π_t + Σπ²):
    A 1/2 + 3/4 = 5/4, B 3/2 -> b = (5/4)/(11/4) = 5/11, A = (6/11, −5/11). The lower bound Σ_t (1 − π_t)²:
    A 1/4 + 9/16 = 13/16, B 3/4 -> b = 13/25, A = (12/25, −13/25)."""
    batch, r = _batch(OLD), torch.tensor([1.0, 0.0], dtype=torch.float64)
    cfg = _cfg("advantage.estimator=vcpo_opob")
    assert needs_sum_pi_squared(cfg)
    exact = step_advantages(cfg, batch, r, _rows(OLD), 3, SPP)
    torch.testing.assert_close(exact, torch.tensor([6 / 11, -5 / 11]), atol=1e-6, rtol=0)
    bound = step_advantages(cfg, batch, r, _rows(OLD), 3)
    torch.testing.assert_close(bound, torch.tensor([12 / 25, -13 / 25]), atol=1e-6, rtol=0)
    bypass = _cfg("advantage.estimator=vcpo_opob", "correction.mode=bypass", "correction.icepop=false")
    assert not needs_sum_pi_squared(bypass)  # no old-log-prob pass: the lower bound on μ
