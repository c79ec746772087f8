"""The issue-17 pieces inside the minibatch phases: a minibatch split into microbatches (rows)
gives the same loss and gradient as one batch, for step-global M2PO, the rejection list, the
covariance losses' selection and the sequence-level losses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_rl.algo import compute_policy_loss, needs_policy_prepass, policy_loss, prepare_corrections
from moe_rl.config import CorrectionConfig, LossConfig

F64 = torch.float64


def _minibatch(device):
    g = torch.Generator().manual_seed(11)
    n, t = 8, 9
    mask = torch.ones(n, t, dtype=torch.bool)
    for i, length in enumerate([9, 3, 1, 7, 9, 5, 2, 8]):
        mask[i, length:] = False
    roll = -torch.rand(n, t, generator=g, dtype=F64) * 3 - 0.05
    old = roll + 0.15 * torch.randn(n, t, generator=g, dtype=F64)
    logp = old + 0.2 * torch.randn(n, t, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    return [x.to(device) for x in (logp, old, roll, adv, mask)]


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov", "gmpo", "sapo", "dppo_kl"])
def test_microbatch_split_equals_one_batch(device, loss_type):
    logp, old, roll, adv, mask = _minibatch(device)
    loss_cfg = LossConfig(type=loss_type, clip_cov_ratio=0.1, clip_cov_lb=-1.0, clip_cov_ub=1.0, kl_cov_ratio=0.1)
    corr = CorrectionConfig(
        m2po_tau=0.05,
        is_level="token",
        is_batch_normalize=True,
        rejection=[{"mode": "seq_mean_k3", "upper": 0.02}, {"mode": "token_k1", "lower": 0.6, "upper": 1.7}],
    )
    assert needs_policy_prepass(corr, loss_cfg) == (loss_type in ("clip_cov", "kl_cov"))  # M2PO reads π_old/μ here

    x = logp.clone().requires_grad_(True)
    whole, _ = compute_policy_loss(loss_cfg, corr, x, old, roll, adv, mask, generator=torch.Generator().manual_seed(3))
    (g_whole,) = torch.autograd.grad(whole, x)

    prep = prepare_corrections(
        loss_cfg, corr, old, roll, mask, policy_logp=logp, advantages=adv, generator=torch.Generator().manual_seed(3)
    )
    if loss_type in ("clip_cov", "kl_cov"):
        assert prep.cov_selected is not None and bool(prep.cov_selected.any())
    y = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        sel = None if prep.cov_selected is None else prep.cov_selected[rows]
        w = None if prep.weights is None else prep.weights[rows]
        part, _ = policy_loss(
            loss_cfg,
            corr,
            y[rows],
            old[rows],
            roll[rows],
            adv[rows],
            mask[rows],
            prep.keep[rows],
            w,
            prep.denominator,
            cov_selected=sel,
        )
        total = total + part
    (g_split,) = torch.autograd.grad(total, y)
    torch.testing.assert_close(total.detach(), whole.detach())
    torch.testing.assert_close(g_split, g_whole)


def test_prepass_runs_whenever_bypass_reads_the_policy():
    """Bypass mode measures M2PO and VCPO's ESS on sg[π_θ]/μ: both need the pre-pass; decoupled reads π_old/μ."""

    plain = CorrectionConfig(mode="bypass", icepop=False)
    assert not needs_policy_prepass(plain, LossConfig())
    assert needs_policy_prepass(plain, LossConfig(), SimpleNamespace(ess_lr_scaling=True))
    assert needs_policy_prepass(CorrectionConfig(mode="bypass", icepop=False, m2po_tau=0.04), LossConfig())
    assert not needs_policy_prepass(
        CorrectionConfig(mode="decoupled", m2po_tau=0.04), LossConfig(), SimpleNamespace(ess_lr_scaling=True)
    )
