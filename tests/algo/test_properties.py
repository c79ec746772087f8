"""Hypothesis properties that must hold for any batch: weights ≥ 0, masks only remove,
metrics finite, ESS ∈ (0, 1], χ² ≥ 0, k3 ≥ 0, length invariance of geometric RS."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.algo import (
    RS_MODES,
    LossInputs,
    PPOClipParams,
    gspo_loss,
    icepop_weights,
    kl_penalty,
    offpolicy_metrics,
    opsm_mask,
    ppo_clip_loss,
    rejection_mask,
    token_divergence,
    token_veto,
    truncated_is_weights,
)

SETTINGS = settings(max_examples=60, deadline=None)
# log-probs from near-certain to very unlikely tokens; drift up to e^±12 between policies
LOGP = st.floats(min_value=-25.0, max_value=0.0, allow_nan=False)


@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 8))
    n = b * t
    roll = torch.tensor(draw(st.lists(LOGP, min_size=n, max_size=n)), dtype=torch.float64).reshape(b, t)
    drift = torch.tensor(draw(st.lists(st.floats(-12.0, 12.0), min_size=n, max_size=n)), dtype=torch.float64).reshape(
        b, t
    )
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(b, t)
    mask[draw(st.integers(0, b - 1)), draw(st.integers(0, t - 1))] = True
    adv = torch.tensor(draw(st.lists(st.floats(-3.0, 3.0), min_size=b, max_size=b)), dtype=torch.float64)
    return roll + drift, roll, mask, adv


@SETTINGS
@given(batches(), st.booleans())
def test_importance_weights_are_non_negative_and_zero_on_padding(batch, weighted):
    old, roll, mask, _ = batch
    for w, _ in (
        icepop_weights(old, roll, mask, weighted=weighted),
        truncated_is_weights(old, roll, mask, "token", 2.0),
        truncated_is_weights(old, roll, mask, "sequence", 2.0),
        truncated_is_weights(old, roll, mask, "token", 2.0, batch_normalize=True),
    ):
        assert bool((w >= 0).all()) and bool((w[~mask] == 0).all())
        assert bool(torch.isfinite(w).all())
    w, m = truncated_is_weights(old, roll, mask, "token", 2.0)
    assert bool((w <= 2.0).all())
    assert 0 < m["is/ess"].item() <= 1 + 1e-6


@SETTINGS
@given(batches(), st.sampled_from(RS_MODES), st.floats(1.01, 50.0))
def test_rejection_only_removes(batch, mode, upper):
    old, roll, mask, adv = batch
    upper = upper if mode.endswith("k1") else upper - 1.0  # k1: ratio bound > 1; k2/k3: divergence > 0
    for keep, _ in (
        rejection_mask(old, roll, mask, mode, None, upper),
        token_veto(old, roll, mask, 1e-4),
        opsm_mask(old, roll, mask, adv, 0.05),
    ):
        assert keep.dtype == torch.bool and not bool((keep & ~mask).any())


@SETTINGS
@given(batches())
def test_offpolicy_metrics_are_finite_and_in_range(batch):
    old, roll, mask, _ = batch
    m = offpolicy_metrics(old, roll, mask)
    assert all(bool(torch.isfinite(v)) for v in m.values()), {k: v.item() for k, v in m.items()}
    assert 0 < m["offpolicy/ess"].item() <= 1 + 1e-6
    assert 0 < m["offpolicy/ess_seq"].item() <= 1 + 1e-6
    assert m["offpolicy/chi2_token"].item() >= 0
    assert m["offpolicy/chi2_seq"].item() >= 0
    assert m["offpolicy/kl_k3"].item() >= 0
    assert -1 - 1e-6 <= m["offpolicy/prob_pearson"].item() <= 1 + 1e-6


@SETTINGS
@given(st.lists(st.floats(-30.0, 30.0), min_size=1, max_size=64))
def test_k3_is_non_negative_up_to_rounding(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    assert bool((token_divergence(x, "k3") >= -1e-7).all())
    assert bool((kl_penalty(x, torch.zeros_like(x), "k3") >= -1e-7).all())
    assert bool((kl_penalty(x, torch.zeros_like(x), "k3_plus") >= -1e-7).all())


@SETTINGS
@given(batches(), st.integers(2, 5))
def test_geometric_rs_is_length_invariant(batch, repeat):
    """Repeating every sequence's tokens `repeat` times leaves seq_mean decisions unchanged."""
    old, roll, mask, _ = batch
    keep, _ = rejection_mask(old, roll, mask, "seq_mean_k1", 0.7, 1.4)
    old_r, roll_r, mask_r = (x.repeat_interleave(repeat, dim=1) for x in (old, roll, mask))
    keep_r, _ = rejection_mask(old_r, roll_r, mask_r, "seq_mean_k1", 0.7, 1.4)
    assert keep.any(dim=1).tolist() == keep_r.any(dim=1).tolist()


@SETTINGS
@given(batches())
def test_losses_finite_and_identity_ratio_never_clipped(batch):
    old, _roll, mask, adv = batch
    logp = old.clone().requires_grad_(True)
    x = LossInputs(logp, old, adv, mask)
    for loss, m in (ppo_clip_loss(x, PPOClipParams(dual_clip_c=3.0)), gspo_loss(x)):
        (g,) = torch.autograd.grad(loss, logp)
        assert math.isfinite(loss.item()) and bool(torch.isfinite(g).all())
        assert m["loss/clip_frac"].item() == 0.0


@st.composite
def configs(draw):
    from moe_rl.config import CorrectionConfig, LossConfig  # noqa: PLC0415

    rs_mode = draw(st.sampled_from((None, *RS_MODES)))
    k1 = rs_mode is not None and rs_mode.endswith("k1")
    icepop = draw(st.booleans())
    corr = CorrectionConfig(
        mode=draw(st.sampled_from(["bypass", "decoupled"])),
        is_level=draw(st.sampled_from(["none", "token", "sequence"])),
        is_batch_normalize=draw(st.booleans()),
        rs_mode=rs_mode,
        rs_lower=0.5 if k1 else None,
        rs_upper=None if rs_mode is None else (2.0 if k1 else draw(st.floats(0.01, 5.0))),
        icepop=icepop,
        icepop_weighted=draw(st.booleans()),
        token_veto_threshold=draw(st.sampled_from([None, 1e-4])),
        opsm_delta=draw(st.sampled_from([None, 0.0, 0.1])),
        m2po_tau=draw(st.sampled_from([None, 0.04])),  # issue 40: raised when rejection left no token
    )
    loss_type = draw(st.sampled_from(["ppo_clip", "gspo", "gspo_token", "cispo", "reinforce"]))
    aggregations = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]  # GSPO too, as verl 0.9.1
    loss = LossConfig(
        type=loss_type,
        dual_clip_c=draw(st.sampled_from([None, 3.0])),
        aggregation=draw(st.sampled_from(aggregations)),
        kl_coef=draw(st.sampled_from([0.0, 0.1])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3", "k3_plus"])),
    )
    return corr, loss


@SETTINGS
@given(batches(), configs())
def test_entry_point_is_finite_and_only_removes_for_any_config(batch, cfgs):
    from moe_rl.algo import compute_policy_loss  # noqa: PLC0415

    old, roll, mask, adv = batch
    corr, loss_cfg = cfgs
    logp = (old + 0.1).requires_grad_(True)
    old_in = old if corr.mode == "decoupled" else None
    loss, m = compute_policy_loss(loss_cfg, corr, logp, old_in, roll, adv, mask, ref_logp=roll)
    (g,) = torch.autograd.grad(loss, logp)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(g).all())
    assert bool((g[~mask] == 0).all()), "padding must never receive gradient"
    assert all(bool(torch.isfinite(v)) for v in m.values()), {k: v.item() for k, v in m.items()}
    assert 0 <= m["correction/kept_token_frac"].item() <= 1
