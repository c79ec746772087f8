"""Differential tests against verl 0.9.1's own code: each row of docs/algo.md "Porting a verl config".

The expected values come from verl's functions, run from the pinned PyPI wheel: the session fixture
``verl091`` (tests/algo/conftest.py) downloads it, checks its sha256 and generates an importable
package of verl's functions, verbatim, in a cache folder (tests/algo/verl_wheel.py). Each test runs
the row's stated setting and asserts equality with verl, or — where the table says no setting
reproduces verl — shows the input on which the two differ.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from moe_rl.algo import (
    CISPOParams,
    DPPOParams,
    GMPOParams,
    GSPOParams,
    KLCovParams,
    LossInputs,
    PPOClipParams,
    SAPOParams,
    aggregate,
    chained_rejection_mask,
    cispo_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    gmpo_loss,
    gspo_token_loss,
    icepop_weights,
    kl_cov_loss,
    kl_penalty,
    ppo_clip_loss,
    prepare_corrections,
    reinforce_loss,
    rejection_mask,
    sapo_loss,
    sequence_icepop_weights,
    surrogate_loss,
    truncated_is_weights,
)
from moe_rl.config import CorrectionConfig, LossConfig

MASK_CPU = torch.tensor(
    [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool
)
AGG = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "token_sum": "token-sum",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}


def _data(device, seed=0, spread=0.3, dtype=torch.float64):
    """(logp with grad, old_logp, μ, sequence advantages broadcast to tokens [B, T]) on ``device``."""
    g = torch.Generator().manual_seed(seed)
    shape = MASK_CPU.shape
    mu = -torch.rand(shape, generator=g, dtype=dtype) * 2 - 0.05
    old = mu + spread * torch.randn(shape, generator=g, dtype=dtype)
    logp = (old + spread * torch.randn(shape, generator=g, dtype=dtype)).clamp(max=-1e-3)
    adv = torch.randn(shape[0], generator=g, dtype=dtype)[:, None].expand(shape).contiguous()
    return logp.to(device).requires_grad_(True), old.clamp(max=-1e-3).to(device), mu.to(device), adv.to(device)


def _pair(ours_fn, verl_fn, logp):
    """(our loss, verl's loss, our grad, verl's grad) on the same π_θ leaf."""
    a = ours_fn(logp)
    (ga,) = torch.autograd.grad(a, logp)
    b = verl_fn(logp)
    (gb,) = torch.autograd.grad(b, logp)
    return a.detach(), b.detach(), ga, gb


def _close(a, b, rtol=1e-7, atol=1e-9):  # verl adds 1e-8 to its divisors
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _actor(verl, **kw):
    """verl's ActorConfig (the wheel's field defaults) with ``kw`` and ``policy_loss`` overridden."""
    config = importlib.import_module(".config", verl.__package__)
    pl = kw.pop("policy_loss", {})
    return config.ActorConfig(policy_loss=config.PolicyLossConfig(**pl), **kw)


@pytest.fixture
def verl(verl091):
    """verl 0.9.1's verl/trainer/ppo/core_algos.py functions."""
    return verl091.core_algos


@pytest.fixture
def verl_rc(verl091):
    """verl 0.9.1's verl/trainer/ppo/rollout_corr_helper.py functions."""
    return verl091.rollout_corr_helper


@pytest.mark.parametrize("ours", sorted(AGG))
def test_aggregation_equals_verl_agg_loss(ours, verl, device):
    """Row "aggregation" and "fixed length normaliser" (loss.norm_len = loss_scale_factor). A fully
    rejected row: verl's trainer passes global_batch_size = the minibatch's sequences (ppo_mini_batch_size
    · n), so its sequence means count that row; ours count sequences with a kept token (row 9)."""
    MASK = MASK_CPU.to(device)
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(MASK.shape, generator=g, dtype=torch.float64).to(device)
    for info in ({}, {"global_batch_size": 4, "batch_num_tokens": int(MASK.sum())}):
        _close(
            aggregate(loss, MASK, ours, norm_len=7),
            verl.agg_loss(loss, MASK.double(), AGG[ours], loss_scale_factor=7, **info),
        )
    mask = MASK.clone()
    mask[2] = False
    theirs = verl.agg_loss(
        loss, mask.double(), AGG[ours], loss_scale_factor=7, global_batch_size=4, batch_num_tokens=int(mask.sum())
    )
    if ours in ("seq_mean_token_mean", "seq_mean_token_sum"):
        _close(aggregate(loss, mask, ours) * 3 / 4, theirs)  # 3 kept sequences here, 4 in verl's divisor
    else:
        _close(aggregate(loss, mask, ours, norm_len=7), theirs)


def test_ppo_clip_with_dual_clip_3_equals_verl_vanilla(verl, device):
    """Row "PPO-clip": verl's vanilla always applies the dual clip (clip_ratio_c 3.0) -> dual_clip_c: 3.0."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, spread=0.8)
    logp = logp.detach().index_put((torch.tensor([0]), torch.tensor([1])), old[0, 1] + 1.5).requires_grad_(True)
    cfg = _actor(verl, clip_ratio_low=0.2, clip_ratio_high=0.28)
    dual = PPOClipParams(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    a, b, ga, gb = _pair(
        lambda lp: ppo_clip_loss(LossInputs(lp, old, adv, MASK), dual)[0],
        lambda lp: verl.compute_policy_loss_vanilla(old, lp, adv, MASK.double(), "token-mean", cfg)[0],
        logp,
    )
    _close(a, b)
    _close(ga, gb)
    # without the dual clip a negative-advantage token with r > 3 differs
    assert bool(((torch.exp(logp - old) > 3.0) & (adv < 0) & MASK).any())
    plain = ppo_clip_loss(LossInputs(logp, old, adv, MASK), PPOClipParams(0.2, 0.28))[0]
    assert abs(float(plain) - float(b)) > 1e-3


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gspo_token_equals_verl_gspo_in_every_aggregation(aggregation, verl, device):
    """Row "GSPO": verl implements the token form and honours loss_agg_mode (0.9.1), token-mean included."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=3)
    cfg = LossConfig(type="gspo_token", aggregation=aggregation, clip_low=3e-4, clip_high=4e-4, norm_len=6)
    actor = _actor(verl, clip_ratio_low=3e-4, clip_ratio_high=4e-4, global_batch_info={"loss_scale_factor": 6})
    a, b, ga, gb = _pair(
        lambda lp: surrogate_loss(cfg, LossInputs(lp, old, adv, MASK))[0],
        lambda lp: verl.compute_policy_loss_gspo(old, lp, adv, MASK.double(), AGG[aggregation], actor)[0],
        logp,
    )
    _close(a, b)
    _close(ga, gb)
    # the sequence form gives the same loss and gradient for sequence advantages
    seq = LossConfig(type="gspo", aggregation=aggregation, clip_low=3e-4, clip_high=4e-4, norm_len=6)
    c, _, gc, _ = _pair(lambda lp: surrogate_loss(seq, LossInputs(lp, old, adv, MASK))[0], lambda lp: lp.sum(), logp)
    _close(c, b)
    _close(gc, gb)


def test_gspo_token_mean_and_sequence_mean_differ(verl, device):
    """Why token_mean matters: verl 0.9.1's default token-mean is not its seq-mean-token-mean."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=3)
    actor = _actor(verl, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    tok = verl.compute_policy_loss_gspo(old, logp, adv, MASK.double(), "token-mean", actor)[0]
    seq = verl.compute_policy_loss_gspo(old, logp, adv, MASK.double(), "seq-mean-token-mean", actor)[0]
    assert abs(float(tok) - float(seq)) > 0.05


@pytest.mark.parametrize(
    "mean_log_r, adv, same",
    [(-15.0, 1.0, True), (-15.0, -1.0, True), (5.0, -1.0, True), (15.0, 1.0, True), (15.0, -1.0, False)],
)
def test_gspo_clamp_differs_only_above_plus_10(mean_log_r, adv, same, verl, device):
    """Row "GSPO ratio clamp": verl clamps log s at +10 (no lower clamp), ours at ±20; visible only for
    mean log s > +10 where the unclipped branch is active (A < 0)."""
    mask = torch.ones(1, 4, dtype=torch.bool, device=device)
    old = torch.full((1, 4), -30.0, dtype=torch.float64, device=device)
    spread = torch.tensor([[0.5, -0.5, 0.25, -0.25]], dtype=torch.float64, device=device)
    logp = (old + mean_log_r + spread).requires_grad_(True)
    a_t = torch.full((1, 4), adv, dtype=torch.float64, device=device)
    ours = gspo_token_loss(LossInputs(logp, old, a_t, mask, aggregation="token_mean"), GSPOParams(0.2, 0.2))[0]
    theirs = verl.compute_policy_loss_gspo(old, logp, a_t, mask.double(), "token-mean", _actor(verl))[0]
    assert math.isclose(float(ours), float(theirs), rel_tol=1e-9) is same


def test_sapo_verl_ignores_loss_agg_mode(verl, device):
    """Row 1: verl's SAPO always aggregates seq-mean-token-mean -> leave loss.aggregation unset."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=4)
    assert LossConfig(type="sapo").aggregation == "seq_mean_token_mean"
    for mode in ("token-mean", "seq-mean-token-sum"):
        theirs = lambda lp, m=mode: verl.compute_policy_loss_sapo(old, lp, adv, MASK.double(), m, _actor(verl))[0]
        ours = lambda lp: sapo_loss(LossInputs(lp, old, adv, MASK), SAPOParams(1.0, 1.05))[0]
        a, b, ga, gb = _pair(ours, theirs, logp)
        _close(a, b)
        _close(ga, gb)


def test_gmpo_equals_verl_geo_mean_until_a_row_is_empty(verl, device):
    """Row 2: equal with every row kept and no IS weights; verl's torch.mean also counts empty rows."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=5)
    cfg = _actor(verl, clip_ratio_low=0.4, clip_ratio_high=0.4)
    a, b, ga, gb = _pair(
        lambda lp: gmpo_loss(LossInputs(lp, old, adv, MASK), GMPOParams(0.4, 0.4))[0],
        lambda lp: verl.compute_policy_loss_geo_mean(old, lp, adv, MASK.double(), "token-mean", cfg)[0],
        logp,
    )
    _close(a, b, rtol=1e-7)  # verl divides by (|y| + 1e-8)
    _close(ga, gb, rtol=1e-7, atol=1e-10)
    mask = MASK.clone()
    mask[2] = False
    ours = gmpo_loss(LossInputs(logp, old, adv, mask), GMPOParams(0.4, 0.4))[0]
    theirs = verl.compute_policy_loss_geo_mean(old, logp, adv, mask.double(), "token-mean", cfg)[0]
    _close(ours * 3 / 4, theirs.detach(), rtol=1e-7)  # 3 kept rows over verl's 4


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_cap_3_equals_verl_default(kind, verl, device):
    """Row 3: verl's effective clip_ratio_c is ActorConfig's 3.0 -> loss.dppo_ratio_cap: 3.0."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=6, spread=0.9)
    fn = verl.compute_policy_loss_dppo_tv if kind == "tv" else verl.compute_policy_loss_dppo_kl
    ours = dppo_tv_loss if kind == "tv" else dppo_kl_loss
    a, b, ga, gb = _pair(
        lambda lp: ours(LossInputs(lp, old, adv, MASK), DPPOParams(0.2, 0.2, 3.0))[0],
        lambda lp: fn(old, lp, adv, MASK.double(), "token-mean", _actor(verl))[0],
        logp,
    )
    _close(a, b)
    _close(ga, gb)
    assert bool(((torch.exp(logp - old) > 3.0) & MASK).any())  # the cap is active on this input
    assert abs(float(ours(LossInputs(logp, old, adv, MASK), DPPOParams(0.2, 0.2, 20.0))[0]) - float(b)) > 1e-6


def test_cispo_verl_defaults_bound_both_sides(verl, device):
    """Row "CISPO": verl clips [1 - clip_ratio_low, 1 + clip_ratio_high] (0.2 / 0.2 by default);
    ours has no lower bound unless loss.cispo_clip_low is set."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=7, spread=0.8)
    a, b, ga, gb = _pair(
        lambda lp: cispo_loss(LossInputs(lp, old, adv, MASK), CISPOParams(0.2, None, 0.2))[0],
        lambda lp: verl.compute_policy_loss_cispo(old, lp, adv, MASK.double(), "token-mean", _actor(verl))[0],
        logp,
    )
    _close(a, b)
    _close(ga, gb)
    assert abs(float(cispo_loss(LossInputs(logp, old, adv, MASK), CISPOParams(None, None, 0.2))[0]) - float(b)) > 1e-6


def test_reinforce_equals_verl_gpg_and_bypass_reinforce(verl, device):
    """Row "REINFORCE / GPG": −w·A·log π with detached IS weights, any aggregation."""
    MASK = MASK_CPU.to(device)
    logp, _, _, adv = _data(device, seed=8)
    w = torch.rand(MASK.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(device) * 2
    for agg in ("token_mean", "seq_mean_token_sum"):
        ours = lambda lp, a=agg: reinforce_loss(LossInputs(lp, None, adv, MASK, w, a))[0]
        theirs = lambda lp, a=agg: verl.compute_policy_loss_gpg(lp, lp, adv, MASK.double(), AGG[a], _actor(verl), w)[0]
        a, b, ga, gb = _pair(ours, theirs, logp)
        _close(a, b)
        _close(ga, gb)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ("k1", "k1"),
        ("k2", "k2"),
        ("k3", "low_var_kl"),
        ("abs", "abs"),
        ("k1_plus", "k1+"),
        ("k3_plus", "k3+"),
        ("abs_plus", "abs+"),
        ("k2_plus", "k2+"),
    ],
)
def test_kl_estimators_equal_verl_kl_penalty(ours, theirs, verl, device):
    """Row "KL estimators": values and gradients, where verl's k3 clamp at 10 is inactive."""
    MASK = MASK_CPU.to(device)
    logp, old, _, _ = _data(device, seed=9, spread=1.0)
    a, b, ga, gb = _pair(
        lambda lp: (kl_penalty(lp, old, ours) * MASK).sum(),
        lambda lp: (verl.kl_penalty(lp, old, theirs) * MASK).sum(),
        logp,
    )
    _close(a, b, rtol=1e-9, atol=1e-9)
    _close(ga, gb, rtol=1e-9, atol=1e-9)


def test_k3_differs_where_verl_clamps_at_10(verl, device):
    lp = torch.tensor([[-20.0]], dtype=torch.float64, device=device)
    ref = torch.tensor([[-5.0]], dtype=torch.float64, device=device)
    assert float(verl.kl_penalty(lp, ref, "low_var_kl")) == 10.0
    assert float(kl_penalty(lp, ref, "k3")) > 3e6


def test_kl_cov_equals_verl_on_one_microbatch(verl, device):
    """Rows 4 and 8: coefficient 0.1, top-k of the minibatch's (here: the one microbatch's) covariances."""
    MASK = MASK_CPU.to(device)
    logp, old, _, adv = _data(device, seed=10, spread=0.5)
    cfg = _actor(verl, policy_loss={"kl_cov_ratio": 0.2})
    a, b, ga, gb = _pair(
        lambda lp: kl_cov_loss(LossInputs(lp, old, adv, MASK), KLCovParams(0.2, 0.1))[0],
        lambda lp: verl.compute_policy_loss_kl_cov(old, lp, adv, MASK.double(), "token-mean", cfg)[0],
        logp,
    )
    _close(a, b)
    _close(ga, gb)


@pytest.mark.parametrize("length", [3, 5, 7, 16, 100])
def test_kl_cov_breaks_ties_as_verl_when_all_covariances_are_zero(length, verl, device):
    """One sequence with tokens in the minibatch: A is constant, every covariance is 0, and which tokens
    get the penalty is the tie-break — verl's: torch.topk on the CPU over the valid tokens in order."""
    mask = torch.zeros(3, length + 2, dtype=torch.bool)
    mask[1, :length] = True
    g = torch.Generator().manual_seed(length)
    old = -torch.rand(mask.shape, generator=g) - 0.1
    logp = (old + torch.randn(mask.shape, generator=g)).to(device).requires_grad_(True)  # float32, as the trainer's
    mask, old, adv = mask.to(device), old.to(device), torch.full(mask.shape, 0.5, device=device)
    cfg = _actor(verl, policy_loss={"kl_cov_ratio": 0.3})
    a, b, ga, gb = _pair(
        lambda lp: kl_cov_loss(LossInputs(lp, old, adv, mask), KLCovParams(0.3, 0.1))[0],
        lambda lp: verl.compute_policy_loss_kl_cov(old, lp, adv, mask.float(), "token-mean", cfg)[0],
        logp,
    )
    _close(a, b, rtol=1e-6, atol=1e-7)
    _close(ga, gb, rtol=1e-6, atol=1e-7)


RS_CASES = [
    ("token_k1", "0.8_1.5"),
    ("seq_sum_k1", "0.5_1.5"),
    ("seq_mean_k1", "0.9_1.2"),
    ("token_k2", "0.05"),
    ("token_k3", "0.05"),
    ("seq_sum_k2", "0.2"),
    ("seq_sum_k3", "0.2"),
    ("seq_mean_k2", "0.05"),
    ("seq_mean_k3", "0.05"),
    ("seq_max_k2", "0.1"),
    ("seq_max_k3", "0.1"),
]


def _ours_bounds(mode, spec):
    """verl's threshold string -> (rs_lower, rs_upper): k1 bounds μ/π_old in verl, ρ = π_old/μ here."""
    if mode.endswith("k1"):
        lo, hi = (float(x) for x in spec.split("_"))
        return 1 / hi, 1 / lo
    return None, float(spec)


@pytest.mark.parametrize("mode, spec", RS_CASES)
def test_rejection_equals_verl_rollout_rs(mode, spec, verl_rc, device):
    """Rows "rejection, one criterion" (k1: invert the bounds) and the k1/k2/k3 tables."""
    MASK = MASK_CPU.to(device)
    _, old, mu, _ = _data(device, seed=11, spread=0.3)
    lower, upper = _ours_bounds(mode, spec)
    keep, _ = rejection_mask(old, mu, MASK, mode, lower, upper)
    theirs, _ = verl_rc.compute_rollout_rejection_mask(old - mu, MASK.double(), mode, spec)
    assert 0 < int(keep.sum()) < int(MASK.sum()), "the case must keep some tokens and reject others"
    assert torch.equal(keep, theirs.bool())


def test_several_rejection_criteria_equal_verl_comma_list(verl_rc, device):
    """Row "rejection, several": AND of the criteria, each on the input mask."""
    MASK = MASK_CPU.to(device)
    _, old, mu, _ = _data(device, seed=12, spread=0.3)
    criteria = [
        {"mode": m, "lower": _ours_bounds(m, s)[0], "upper": _ours_bounds(m, s)[1]}
        for m, s in (("token_k1", "0.6_1.4"), ("seq_mean_k3", "0.03"))
    ]
    keep, _ = chained_rejection_mask(old, mu, MASK, criteria)
    theirs, _ = verl_rc.compute_rollout_rejection_mask(old - mu, MASK.double(), "token_k1,seq_mean_k3", "0.6_1.4,0.03")
    assert torch.equal(keep, theirs.bool())


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_truncated_is_equals_verl_rollout_is(level, normalize, verl_rc, device):
    """Rows "truncated IS" and "IS batch normalisation" (nothing rejected)."""
    MASK = MASK_CPU.to(device)
    _, old, mu, _ = _data(device, seed=13, spread=0.3)
    ours, _ = truncated_is_weights(old, mu, MASK, level, 1.5, normalize)
    theirs, _ = verl_rc.compute_rollout_correction_weights(old - mu, MASK.double(), level, 1.5, normalize)
    _close(ours * MASK, theirs * MASK)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_equals_verl_lower_upper_threshold(level, verl_rc, device):
    """Rows "IcePop, token" (icepop_weighted: true) and "IcePop, sequence": verl's "lower_upper" threshold."""
    MASK = MASK_CPU.to(device)
    _, old, mu, _ = _data(device, seed=14, spread=0.6)
    if level == "token":
        ours, _ = icepop_weights(old, mu, MASK, 0.7, 1.5, weighted=True)
    else:
        ours, _ = sequence_icepop_weights(old, mu, MASK, 0.7, 1.5, weighted=True)
    theirs, _ = verl_rc.compute_rollout_correction_weights(old - mu, MASK.double(), level, "0.7_1.5")
    assert bool(((theirs == 0) & MASK).any()) and bool(((theirs != 0) & MASK).any())
    _close(ours * MASK, theirs * MASK)


def test_is_batch_normalisation_with_rejection_differs_from_verl(verl_rc, device):
    """verl normalises the IS weights over every response token, rejected ones included; ours over the
    tokens that enter the loss. No setting reproduces verl when rejection and normalisation combine."""
    MASK = MASK_CPU.to(device)
    _, old, mu, _ = _data(device, seed=15, spread=0.3)
    corr = CorrectionConfig(
        is_level="token",
        is_threshold=1.5,
        is_batch_normalize=True,
        rejection=[{"mode": "token_k1", "lower": 1 / 1.4, "upper": 1 / 0.6}],
    )
    prep = prepare_corrections(LossConfig(), corr, old, mu, MASK)
    theirs, _ = verl_rc.compute_rollout_correction_weights(old - mu, MASK.double(), "token", 1.5, True)
    kept, _ = verl_rc.compute_rollout_rejection_mask(old - mu, MASK.double(), "token_k1", "0.6_1.4")
    assert torch.equal(prep.keep, kept.bool()) and not bool(prep.keep[MASK].all())  # some tokens rejected
    k = prep.keep
    _close(float((prep.weights * k).sum() / k.sum()), 1.0)  # ours: mean 1 over what enters the loss
    assert abs(float((theirs * k).sum() / k.sum()) - 1.0) > 1e-3  # verl's: mean 1 over all tokens
