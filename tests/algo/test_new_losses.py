"""SAPO, GMPO, DPPO-TV/KL, Clip-Cov, KL-Cov: hand-worked goldens, an independent per-token
formula on random tensors with edge cases (all-masked rows, length-1 rows, ±30 log-ratios),
gradchecks, and the IS-weight / mask contract shared with the existing losses."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import (
    ClipCovParams,
    DPPOParams,
    GMPOParams,
    KLCovParams,
    LossInputs,
    SAPOParams,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    gmpo_loss,
    kl_cov_loss,
    sapo_loss,
    surrogate_loss,
)
from moe_rl.config import LossConfig

F64 = torch.float64
DPPO = {"tv": dppo_tv_loss, "kl": dppo_kl_loss}
KL_COV = KLCovParams(kl_cov_ratio=0.2, kl_cov_coef=0.5)


def _edge_batch(device, seed=0):
    """Rows: full, length-1, all-masked, +30 and −30 log-ratio tokens mixed with ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 6
    mask = torch.tensor(
        [[1] * 6, [1, 0, 0, 0, 0, 0], [0] * 6, [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05
    lp = (old + 0.3 * torch.randn(b, t, generator=g, dtype=F64)).clamp(max=-1e-3)  # valid log-probs
    old[3, 1], lp[3, 1] = -31.0, -1.0  # log-ratio +30 between two valid log-probs
    lp[4, 2] = old[4, 2] - 30.0
    adv = torch.randn(b, t, generator=g, dtype=F64)
    w = torch.rand(b, t, generator=g, dtype=F64) + 0.25
    return [x.to(device) for x in (lp, old, adv, mask, w)]


def _token_mean(per_token, mask):
    return sum(per_token[i][j] for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]) / int(
        mask.sum()
    )


def _seq_mean_token_mean(per_token, mask):
    rows = [[per_token[i][j] for j in range(mask.shape[1]) if mask[i, j]] for i in range(mask.shape[0])]
    rows = [sum(r) / len(r) for r in rows if r]
    return sum(rows) / len(rows)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x > -700 else 0.0


def test_sapo_hand_worked(device):
    # r = 1: gate (4/τ)·σ(0) = 2/τ; A = +2 (τ_pos = 1) → ℓ = −4; A = −1 (τ_neg = 2) → ℓ = +1
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=F64, device=device))
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([[2.0, -1.0]], dtype=F64, device=device)
    mask = torch.ones_like(old, dtype=torch.bool)
    params = SAPOParams(sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    loss, m = sapo_loss(LossInputs(lp, old, adv, mask, aggregation="token_mean"), params)
    assert loss.item() == pytest.approx((-4 + 1) / 2)
    # d/dlogp of −A (4/τ) σ(τ(r−1)) at r = 1 is −A·4σ(1−σ) = −A: the on-policy gradient
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.tensor([[-2.0, 1.0]], dtype=F64, device=device) / 2)
    assert m["loss/gate_weight_mean"].item() == pytest.approx(1.0)


def test_sapo_matches_independent_formula_on_edge_cases(device):
    lp, old, adv, mask, w = _edge_batch(device)
    loss, _ = sapo_loss(LossInputs(lp, old, adv, mask, is_weights=w), SAPOParams(1.0, 1.05))
    per = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            a = adv[i, j].item()
            tau = 1.0 if a > 0 else 1.05
            r = math.exp(max(-20.0, min(20.0, lp[i, j].item() - old[i, j].item())))
            per[i][j] = -a * (4 / tau) * _sigmoid(tau * (r - 1)) * w[i, j].item()
    assert loss.item() == pytest.approx(_seq_mean_token_mean(per, mask), rel=1e-9)


def test_gmpo_hand_worked(device):
    # one sequence, A = +1, log-ratios 0.6 and −0.2, ε = 0.4: for A > 0 the ratio is capped above
    # only → x̃ = (0.4, −0.2), ℓ = −exp(0.1); for A = −1 capped below only → x̃ = (0.6, −0.2)
    old = torch.log(torch.tensor([[0.2, 0.3]], dtype=F64, device=device))
    lp = (old + torch.tensor([[0.6, -0.2]], dtype=F64, device=device)).requires_grad_(True)
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, m = gmpo_loss(LossInputs(lp, old, torch.tensor([1.0], dtype=F64, device=device), mask), GMPOParams(0.4, 0.4))
    assert loss.item() == pytest.approx(-math.exp(0.1))
    (grad,) = torch.autograd.grad(loss, lp)  # clamped token gets no gradient, the other −exp(0.1)/2
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(0.1) / 2]], dtype=F64, device=device))
    assert m["loss/clip_frac_high"].item() == pytest.approx(0.5)
    neg = torch.tensor([-1.0], dtype=F64, device=device)
    loss_neg, _ = gmpo_loss(LossInputs(lp, old, neg, mask), GMPOParams(0.4, 0.4))
    assert loss_neg.item() == pytest.approx(math.exp(0.2))


def test_gmpo_matches_independent_formula_on_edge_cases(device):
    lp, old, adv, mask, _ = _edge_batch(device, seed=1)
    adv_seq = adv[:, 0]
    loss, _ = gmpo_loss(LossInputs(lp, old, adv_seq, mask), GMPOParams(0.4, 0.3))
    per = []
    for i in range(mask.shape[0]):
        xs = [lp[i, j].item() - old[i, j].item() for j in range(mask.shape[1]) if mask[i, j]]
        if not xs:
            continue
        a = adv_seq[i].item()
        clipped = [min(x, 0.3) if a > 0 else (max(x, -0.4) if a < 0 else x) for x in xs]
        mean = max(-20.0, min(20.0, sum(clipped) / len(clipped)))
        per.append(-a * math.exp(mean))
    assert loss.item() == pytest.approx(sum(per) / len(per), rel=1e-9)


def test_dppo_tv_and_kl_hand_worked(device):
    # p_old = 0.5; p = 0.9 (r = 1.8) and 0.2 (r = 0.4); A = +1 on both; δ = 0.2.
    # TV: Δp = +0.4 > δ → masked; Δp = −0.3 (A > 0 only bounds increases) → kept, weight 0.4.
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=F64, device=device))
    lp = torch.log(torch.tensor([[0.9, 0.2]], dtype=F64, device=device)).requires_grad_(True)
    adv = torch.ones_like(old)
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, m = dppo_tv_loss(LossInputs(lp, old, adv, mask), DPPOParams(0.2, 0.2))
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.4]], dtype=F64, device=device) / 2)
    assert m["loss/clip_frac"].item() == pytest.approx(0.5)
    # KL: D(0.5→0.9) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) ≈ 0.5108 > 0.2 → masked; p < p_old kept
    d = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert d > 0.2
    loss_kl, _ = dppo_kl_loss(LossInputs(lp, old, adv, mask), DPPOParams(0.2, 0.2))
    (grad_kl,) = torch.autograd.grad(loss_kl, lp)
    torch.testing.assert_close(grad_kl, torch.tensor([[0.0, -0.4]], dtype=F64, device=device) / 2)
    # with δ_high = 0.6 > D the first token is kept too: weight r = 1.8
    loss_kl2, _ = dppo_kl_loss(LossInputs(lp, old, adv, mask), DPPOParams(0.2, 0.6))
    (grad_kl2,) = torch.autograd.grad(loss_kl2, lp)
    torch.testing.assert_close(grad_kl2, torch.tensor([[-1.8, -0.4]], dtype=F64, device=device) / 2)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_matches_independent_formula_on_edge_cases(device, divergence):
    lp, old, adv, mask, w = _edge_batch(device, seed=2)
    loss, _ = DPPO[divergence](LossInputs(lp, old, adv, mask, is_weights=w), DPPOParams(0.1, 0.15, 20.0))
    per = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            lpv, ov, a = lp[i, j].item(), old[i, j].item(), adv[i, j].item()
            p, q = math.exp(lpv), math.exp(ov)
            if divergence == "tv":
                ok = (p - q <= 0.15) if a > 0 else (p - q >= -0.1)
            else:
                d = q * (ov - lpv) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                ok = (d <= 0.15 or p <= q) if a > 0 else (d <= 0.1 or p >= q)
            r = math.exp(max(-20.0, min(20.0, lpv - ov)))
            per[i][j] = -a * min(r, 20.0) * lpv * ok * w[i, j].item()
    assert loss.item() == pytest.approx(_token_mean(per, mask), rel=1e-9)


def test_clip_cov_zeroes_exactly_the_seeded_selection(device):
    # 4 tokens of one row, r = 1 (no PPO clipping); A and log π chosen so cov_t of tokens 0 and 3
    # lies in (lb, ub) = (1, 5): cov = (A − Ā)(logp − mean logp).
    old = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=F64, device=device)
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([[3.0, 0.0, 0.0, -3.0]], dtype=F64, device=device)
    mask = torch.ones_like(old, dtype=torch.bool)
    # Ā = 0, mean logp = −2.5 → cov = (4.5, 0, 0, 4.5)
    params = ClipCovParams(0.2, 0.2, clip_cov_ratio=0.25)
    loss, m = clip_cov_loss(LossInputs(lp, old, adv, mask, generator=torch.Generator().manual_seed(0)), params)
    (grad,) = torch.autograd.grad(loss, lp)
    zeroed = (grad == 0) & (adv != 0)
    assert int(zeroed.sum()) == 1 and m["loss/cov_clip_frac"].item() == pytest.approx(0.25)
    full = torch.tensor([[-3.0, 0.0, 0.0, 3.0]], dtype=F64, device=device) / 4
    torch.testing.assert_close(grad, torch.where(zeroed, torch.zeros_like(full), full))
    # the same seed selects the same token (resume is exact)
    lp2 = old.clone().requires_grad_(True)
    loss2, _ = clip_cov_loss(LossInputs(lp2, old, adv, mask, generator=torch.Generator().manual_seed(0)), params)
    torch.testing.assert_close(torch.autograd.grad(loss2, lp2)[0], grad)


def test_kl_cov_penalises_the_top_covariance_tokens(device):
    g = torch.Generator().manual_seed(3)
    lp, old, adv, mask, _ = _edge_batch(device, seed=3)
    loss, m = kl_cov_loss(LossInputs(lp, old, adv, mask), KLCovParams(kl_cov_ratio=0.2, kl_cov_coef=0.5))
    n = int(mask.sum())
    k = max(int(0.2 * n), 1)
    idx = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    a_mean = sum(adv[i, j].item() for i, j in idx) / n
    l_mean = sum(lp[i, j].item() for i, j in idx) / n
    cov = {ij: (adv[ij].item() - a_mean) * (lp[ij].item() - l_mean) for ij in idx}
    top = set(sorted(idx, key=lambda ij: -cov[ij])[:k])
    total = 0.0
    for ij in idx:
        x = max(-20.0, min(20.0, lp[ij].item() - old[ij].item()))
        total += -adv[ij].item() * math.exp(x) + (0.5 * abs(x) if ij in top else 0.0)
    assert loss.item() == pytest.approx(total / n, rel=1e-9)
    assert m["loss/cov_kl_frac"].item() == pytest.approx(k / n)
    del g


LOSS_CASES = {
    "sapo": lambda lp, old, adv, mask, w: sapo_loss(LossInputs(lp, old, adv, mask, is_weights=w), SAPOParams())[0],
    "gmpo": lambda lp, old, adv, mask, w: gmpo_loss(LossInputs(lp, old, adv[:, 0], mask), GMPOParams(0.4, 0.4))[0],
    "kl_cov": lambda lp, old, adv, mask, w: kl_cov_loss(LossInputs(lp, old, adv, mask, is_weights=w), KL_COV)[0],
}


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_gradcheck_float64(name, device):
    g = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool, device=device)
    old = (-torch.rand(3, 4, generator=g, dtype=F64) * 2).to(device)
    adv = torch.randn(3, 4, generator=g, dtype=F64).to(device)
    w = (torch.rand(3, 4, generator=g, dtype=F64) + 0.5).to(device)
    lp = (old + 0.1 * torch.randn(3, 4, generator=g, dtype=F64).to(device)).requires_grad_(True)
    fn = LOSS_CASES[name]
    assert torch.autograd.gradcheck(lambda x: fn(x, old, adv, mask, w), (lp,))


def test_dppo_and_clip_cov_gradient_is_the_stop_gradient_weight(device):
    # DPPO's weight sg[min(r, C)]·1[trust] and Clip-Cov's PPO branch: hold r fixed by shifting old
    # with logp (as the CISPO gradcheck does), so the numerical derivative is w·(−A) exactly.
    g = torch.Generator().manual_seed(6)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool, device=device)
    old = (-torch.rand(2, 3, generator=g, dtype=F64) * 2 - 0.5).to(device)
    adv = torch.randn(2, 3, generator=g, dtype=F64).to(device)
    base = old + 0.01 * torch.randn(2, 3, generator=g, dtype=F64).to(device)
    for div in ("tv", "kl"):
        fn = lambda x, d=div: DPPO[d](LossInputs(x, old + (x - base), adv, mask), DPPOParams(0.5, 0.5))[0]
        assert torch.autograd.gradcheck(fn, (base.clone().requires_grad_(True),))
    # Clip-Cov outside its selection is PPO-clip, whose gradient is the true derivative
    params = ClipCovParams(0.2, 0.2, clip_cov_ratio=0.5, clip_cov_lb=10.0, clip_cov_ub=11.0)
    fn = lambda x: clip_cov_loss(LossInputs(x, old, adv, mask), params)[0]
    assert torch.autograd.gradcheck(fn, (base.clone().requires_grad_(True),))


def test_all_rejected_rows_and_weights_follow_the_shared_contract(device):
    lp, old, adv, mask, w = _edge_batch(device, seed=5)
    for t in ("sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"):
        cfg = LossConfig(type=t)
        x = lp.clone().requires_grad_(True)
        loss, _ = surrogate_loss(cfg, LossInputs(x, old, adv, mask, generator=torch.Generator().manual_seed(0)))
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(loss) and bool(torch.isfinite(grad).all()), t
        assert torch.count_nonzero(grad[~mask]) == 0, t  # padding and all-masked rows get no gradient
        # zero IS weights remove every token's contribution
        x = lp.clone().requires_grad_(True)
        zero_w = LossInputs(x, old, adv, mask, torch.zeros_like(w), generator=torch.Generator().manual_seed(0))
        loss0, _ = surrogate_loss(cfg, zero_w)
        assert loss0.item() == 0.0, t


def test_clip_cov_draws_only_from_unclipped_tokens_inside_the_covariance_band(device):
    g = torch.Generator().manual_seed(1)  # a draw with tokens above ub and clipped tokens inside the band
    n = 40
    old = (-torch.rand(1, n, generator=g, dtype=F64) * 4 - 0.1).to(device)
    lp = old + (0.5 * torch.randn(1, n, generator=g, dtype=F64)).to(device)
    adv = (2 * torch.randn(1, n, generator=g, dtype=F64)).to(device)
    mask = torch.ones_like(old, dtype=torch.bool)
    # independent candidate set: lb < cov < ub, and PPO's clipped branch not active
    a, l_ = adv[0].tolist(), lp[0].tolist()
    am, lm = sum(a) / n, sum(l_) / n
    cov = [(a[k] - am) * (l_[k] - lm) for k in range(n)]
    r = [math.exp(l_[k] - old[0, k].item()) for k in range(n)]
    clipped = [-a[k] * min(max(r[k], 0.8), 1.2) > -a[k] * r[k] for k in range(n)]
    cand = {k for k in range(n) if 0.5 < cov[k] < 2.0 and not clipped[k]}
    assert any(cov[k] >= 2.0 for k in range(n)) and any(clipped[k] and 0.5 < cov[k] < 2.0 for k in range(n))
    seen = set()
    for seed in range(25):
        x = lp.clone().requires_grad_(True)
        params = ClipCovParams(0.2, 0.2, clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=2.0)
        loss, _ = clip_cov_loss(LossInputs(x, old, adv, mask, generator=torch.Generator().manual_seed(seed)), params)
        (grad,) = torch.autograd.grad(loss, x)
        no_band = ClipCovParams(0.2, 0.2, clip_cov_ratio=0.05, clip_cov_lb=99.0, clip_cov_ub=100.0)
        ref = torch.autograd.grad(clip_cov_loss(LossInputs(x, old, adv, mask), no_band)[0], x)[0]
        zeroed = {k for k in range(n) if grad[0, k] == 0 and ref[0, k] != 0}
        assert len(zeroed) == min(2, len(cand)) and zeroed <= cand
        seen |= zeroed
    assert seen == cand  # every candidate is reachable
