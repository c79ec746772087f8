"""The config-driven entry point: which ratio each mode corrects and where IS weights go.

Driven by the real pydantic sections from moe_rl.config so a renamed field fails here.
Expected losses are re-derived in each test from the formulas with plain torch ops.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_rl.algo import compute_policy_loss, metrics_to_floats
from moe_rl.config import CorrectionConfig, LossConfig

F64 = torch.float64


@pytest.fixture
def batch():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    roll = -torch.rand(3, 5, dtype=F64) * 2
    old = roll + 0.3 * torch.randn(3, 5, dtype=F64)
    logp = (old + 0.3 * torch.randn(3, 5, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    return logp, old, roll, adv, mask


def _mean(x, mask):
    return x[mask].sum() / mask.sum()


def _ppo_terms(logp, anchor, adv, lo=0.2, hi=0.28):
    r = torch.exp(logp - anchor)
    a = adv[:, None]
    return torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))


def test_bypass_ppo_clip_clips_against_rollout_and_never_applies_is_weights(batch):
    logp, _, roll, adv, mask = batch
    corr = CorrectionConfig(mode="bypass", is_level="token", is_threshold=1.5)
    loss, m = compute_policy_loss(LossConfig(type="ppo_clip"), corr, logp, None, roll, adv, mask)
    expected = _mean(_ppo_terms(logp, roll, adv), mask)
    torch.testing.assert_close(loss, expected)
    assert m["is/applied"].item() == 0.0 and "is/weight_mean" in m  # logged, not applied


def test_decoupled_ppo_clip_multiplies_token_tis_weights(batch):
    logp, old, roll, adv, mask = batch
    corr = CorrectionConfig(mode="decoupled", is_level="token", is_threshold=1.2)
    loss, m = compute_policy_loss(LossConfig(type="ppo_clip"), corr, logp, old, roll, adv, mask)
    w = torch.exp(old - roll).clamp(max=1.2)
    expected = _mean(w * _ppo_terms(logp, old, adv), mask)
    torch.testing.assert_close(loss, expected)
    assert m["is/applied"].item() == 1.0


def test_bypass_reinforce_applies_sequence_tis_of_current_policy(batch):
    logp, _, roll, adv, mask = batch
    corr = CorrectionConfig(mode="bypass", is_level="sequence", is_threshold=2.0)
    loss, _ = compute_policy_loss(LossConfig(type="reinforce"), corr, logp, roll, roll, adv, mask)
    seq = torch.where(mask, logp.detach() - roll, torch.zeros((), dtype=F64)).sum(dim=1)
    w = torch.exp(seq).clamp(max=2.0)[:, None]
    expected = _mean(-w * adv[:, None] * logp, mask)
    torch.testing.assert_close(loss, expected)


def test_bypass_icepop_keeps_only_the_band_mask_for_ratio_losses(batch):
    logp, _, roll, adv, mask = batch
    corr = CorrectionConfig(mode="bypass", icepop=True, icepop_low=0.8, icepop_high=1.25)
    loss, m = compute_policy_loss(LossConfig(type="ppo_clip"), corr, logp, None, roll, adv, mask)
    k = torch.exp(logp.detach() - roll)
    band = ((k >= 0.8) & (k <= 1.25)).to(F64)
    torch.testing.assert_close(loss, _mean(band * _ppo_terms(logp, roll, adv), mask))
    assert 0 < m["icepop/masked_frac"].item() < 1, "the fixture must exercise both sides of the band"


def test_decoupled_icepop_weighted_on_gspo_token(batch):
    logp, old, roll, adv, mask = batch
    corr = CorrectionConfig(mode="decoupled", icepop=True, icepop_low=0.8, icepop_high=1.25)
    cfg = LossConfig(type="gspo_token", clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean")
    loss, _ = compute_policy_loss(cfg, corr, logp, old, roll, adv, mask)
    k = torch.exp(old - roll)
    w = torch.where((k >= 0.8) & (k <= 1.25), k, torch.zeros((), dtype=F64))
    n = mask.sum(dim=1)
    s = torch.exp(torch.where(mask, logp.detach() - old, torch.zeros((), dtype=F64)).sum(dim=1) / n)
    seq_terms = torch.maximum(-adv * s, -adv * s.clamp(0.8, 1.2))  # value of GSPO-token = value of GSPO
    per_seq = (torch.where(mask, w, torch.zeros((), dtype=F64)).sum(dim=1) / n) * seq_terms
    torch.testing.assert_close(loss.detach(), per_seq.mean())


def test_icepop_with_token_tis_is_band_mask_times_truncated_weight(batch):
    logp, old, roll, adv, mask = batch
    corr = CorrectionConfig(
        mode="decoupled", is_level="token", is_threshold=1.1, icepop=True, icepop_low=0.8, icepop_high=1.25
    )
    loss, m = compute_policy_loss(LossConfig(type="ppo_clip"), corr, logp, old, roll, adv, mask)
    rho = torch.exp(old - roll)
    w = rho.clamp(max=1.1) * ((rho >= 0.8) & (rho <= 1.25)).to(F64)  # one ratio factor, not two
    torch.testing.assert_close(loss, _mean(w * _ppo_terms(logp, old, adv), mask))
    assert 0 < m["icepop/masked_frac"].item() < 1 and 0 < m["is/truncated_frac"].item() < 1


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml")))
def test_every_shipped_config_runs_through_the_entry_point(path, batch):
    from moe_rl.config import load_config  # noqa: PLC0415

    cfg = load_config(path)
    logp, old, roll, adv, mask = batch
    old_in = old if cfg.correction.mode == "decoupled" else None
    loss, m = compute_policy_loss(
        cfg.loss, cfg.correction, logp, old_in, roll, adv, mask, ref_logp=roll, entropy=torch.zeros_like(roll)
    )
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(logp.grad).all())
    assert all(math.isfinite(v) for v in metrics_to_floats(m).values())


def test_rejections_are_anded_and_reported(batch):
    logp, old, roll, adv, mask = batch
    old = old.clone()
    old[0, 1] = roll[0, 1] + math.log(1e-6)  # a catastrophic token in sequence 0
    corr = CorrectionConfig(mode="decoupled", token_veto_threshold=1e-4, opsm_delta=0.0)
    loss, m = compute_policy_loss(LossConfig(type="reinforce"), corr, logp, old, roll, adv, mask)
    kl_seq = torch.where(mask, roll - logp.detach(), torch.zeros((), dtype=F64)).sum(1) / mask.sum(1)
    keep_seq = torch.tensor([False, True, True]) & ~((adv < 0) & (kl_seq > 0.0))
    keep = mask & keep_seq[:, None]
    # OPSM's dropped sequences stay in the normaliser (DeepSeek-V3.2: 1/G over all sequences);
    # the veto's are removed from it (a step-global, π_θ-free rejection).
    not_vetoed = mask & torch.tensor([False, True, True])[:, None]
    torch.testing.assert_close(loss, (-adv[:, None] * logp)[keep].sum() / not_vetoed.sum())
    assert m["veto/seq_masked_frac"].item() == pytest.approx(1 / 3)
    assert m["correction/kept_seq_frac"].item() == pytest.approx(keep_seq.sum().item() / 3)


def test_everything_rejected_gives_zero_loss_and_zero_gradient(batch):
    logp, old, roll, adv, mask = batch
    corr = CorrectionConfig(mode="decoupled", rs_mode="token_k2", rs_upper=1e-12)
    loss, m = compute_policy_loss(LossConfig(type="gspo"), corr, logp, old, roll, adv, mask)
    loss.backward()
    assert loss.item() == 0.0 and bool((logp.grad == 0).all())
    assert m["correction/kept_token_frac"].item() == 0.0


def test_kl_and_entropy_terms_are_added(batch):
    logp, old, roll, adv, mask = batch
    ent = torch.rand(3, 5, dtype=F64)
    cfg = LossConfig(type="reinforce", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = compute_policy_loss(cfg, CorrectionConfig(), logp, old, roll, adv, mask, ref_logp=roll, entropy=ent)
    expected = _mean(-adv[:, None] * logp, mask) + 0.1 * _mean(logp - roll, mask) - 0.01 * _mean(ent, mask)
    torch.testing.assert_close(loss, expected)
    assert set(metrics_to_floats(m)) >= {"loss/kl_ref", "loss/entropy", "loss/total", "loss/pg_loss"}


@pytest.mark.parametrize("loss_type", ["ppo_clip", "gspo", "gspo_token", "cispo", "reinforce"])
@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
def test_every_loss_and_mode_gives_finite_loss_gradient_and_flat_metrics(batch, loss_type, mode):
    logp, old, roll, adv, mask = batch
    corr = CorrectionConfig(mode=mode, is_level="token", rs_mode="seq_mean_k1", rs_lower=0.5, rs_upper=2.0)
    old_in = old if mode == "decoupled" else None
    loss, m = compute_policy_loss(LossConfig(type=loss_type), corr, logp, old_in, roll, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(logp.grad).all())
    floats = metrics_to_floats(m)
    assert all("/" in k for k in floats) and all(math.isfinite(v) for v in floats.values())


def test_entry_point_errors(batch):
    logp, old, roll, adv, mask = batch
    with pytest.raises(ValueError, match="old_logp: decoupled"):
        compute_policy_loss(LossConfig(), CorrectionConfig(mode="decoupled"), logp, None, roll, adv, mask)
    with pytest.raises(ValueError, match="old_logp: bypass"):
        compute_policy_loss(LossConfig(), CorrectionConfig(mode="bypass"), logp, old, roll, adv, mask)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_policy_loss(LossConfig(kl_coef=0.1), CorrectionConfig(), logp, old, roll, adv, mask)
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(LossConfig(entropy_coef=0.1), CorrectionConfig(), logp, old, roll, adv, mask)
