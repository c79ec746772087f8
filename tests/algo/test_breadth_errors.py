"""Bad input to the issue-17 pieces gets one clear error naming the field and what was expected."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from moe_rl.algo import (
    LossInputs,
    SAPOParams,
    chained_rejection_mask,
    compute_advantages,
    dppo_trust_mask,
    ess_lr_scale,
    kl_penalty,
    m2po_mask,
    opo_advantages,
    sapo_loss,
)
from moe_rl.config import LossConfig, OptimConfig

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
LP = torch.full((2, 3), -1.0)


@pytest.mark.parametrize(
    ("call", "exc", "pattern"),
    [
        (lambda: kl_penalty(LP, LP, "k4"), ValueError, r"kl_estimator: expected one of .*'k3_plus'"),
        (
            lambda: dppo_trust_mask(LP, LP, torch.ones(2, 3), "js", 0.2, 0.2),
            ValueError,
            r"dppo divergence: expected one of \('tv', 'kl'\)",
        ),
        (
            lambda: sapo_loss(LossInputs(LP, LP, torch.ones(2), MASK), SAPOParams(sapo_tau_pos=0.0)),
            ValueError,
            r"sapo_tau_pos: expected a finite number > 0",
        ),
        (lambda: m2po_mask(LP, LP, MASK, -1.0), ValueError, r"correction.m2po_tau: expected a finite number > 0"),
        (lambda: ess_lr_scale(torch.zeros(2, 2)), ValueError, r"seq_log_weights: expected a 1-D tensor"),
        (
            lambda: ess_lr_scale(torch.zeros(2), min_scale=2.0),
            ValueError,
            r"optim.ess_lr_min_scale: expected a number in \(0, 1\]",
        ),
        (
            lambda: chained_rejection_mask(LP, LP, MASK, []),
            ValueError,
            r"correction.rejection: expected a non-empty list",
        ),
        (lambda: chained_rejection_mask(LP, LP, MASK, [{"upper": 1.0}]), ValueError, r"each criterion needs a 'mode'"),
        (
            lambda: chained_rejection_mask(LP, LP, MASK, [{"mode": "tok"}]),
            ValueError,
            r"correction.rejection\[0\].mode",
        ),
        (
            lambda: opo_advantages(torch.ones(4), torch.ones(3), group_size=2),
            ValueError,
            r"lengths: expected non-negative",
        ),
        (
            lambda: compute_advantages(type("C", (), {"estimator": "opo", "eps": 1e-6})(), torch.ones(4), 2),
            ValueError,
            r"advantage.estimator='opo' needs the response lengths",
        ),
        (
            lambda: compute_advantages(
                type("C", (), {"estimator": "grpo", "eps": 1e-6})(),
                torch.ones(4),
                2,
                group_ids=torch.zeros(4, dtype=torch.long),
            ),
            ValueError,
            r"exactly one of group_size .* or group_ids",
        ),
    ],
)
def test_bad_arguments(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize(
    ("section", "kwargs", "pattern"),
    [
        (LossConfig, {"norm_len": 0}, "norm_len"),
        (LossConfig, {"scale_factor": 0.0}, "scale_factor"),
        (LossConfig, {"cispo_clip_low": 1.0}, "cispo_clip_low"),
        (LossConfig, {"type": "gmpo", "aggregation": "token_mean"}, "seq_mean_token_mean"),
        (OptimConfig, {"ess_lr_min_scale": 0.0}, "ess_lr_min_scale"),
    ],
)
def test_bad_config_names_the_field(section, kwargs, pattern):
    with pytest.raises(ValidationError, match=pattern):
        section(**kwargs)
