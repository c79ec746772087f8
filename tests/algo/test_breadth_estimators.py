"""Advantage estimators over group ids (unequal and singleton groups), REINFORCE++, OPO, VCPO's
OPOB baseline and the abs / straight-through KL estimators, against per-group loops."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moe_rl.algo import (
    compute_advantages,
    grpo_advantages,
    kl_penalty,
    logit_grad_sq_norm,
    opo_advantages,
    opob_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from moe_rl.config import LossConfig

F64 = torch.float64
IDS = [7, 7, 7, 3, 3, 9, 1, 1, 1, 1]  # groups of 3, 2, 1 (singleton), 4 — not contiguous-sized


def _groups(ids):
    out = {}
    for k, g in enumerate(ids):
        out.setdefault(g, []).append(k)
    return out


def _rewards(device, seed=0):
    return torch.randn(len(IDS), generator=torch.Generator().manual_seed(seed), dtype=F64).to(device)


def test_grpo_and_rloo_over_unequal_groups(device):
    r = _rewards(device)
    ids = torch.tensor(IDS, device=device)
    grpo, rloo = grpo_advantages(r, group_ids=ids, eps=1e-6), rloo_advantages(r, group_ids=ids)
    drgrpo = grpo_advantages(r, group_ids=ids, normalize_std=False)
    for members in _groups(IDS).values():
        vals = [r[k].item() for k in members]
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        for k in members:
            if n == 1:  # singleton: defined as 0 for every group-baseline estimator
                assert grpo[k].item() == 0.0 and rloo[k].item() == 0.0 and drgrpo[k].item() == 0.0
                continue
            assert grpo[k].item() == pytest.approx((r[k].item() - mean) / (std + 1e-6))
            assert drgrpo[k].item() == pytest.approx(r[k].item() - mean)
            loo = sum(vals[i] for i in range(n) if members[i] != k) / (n - 1)
            assert rloo[k].item() == pytest.approx(r[k].item() - loo)


def test_group_ids_equal_group_size_when_contiguous(device):
    r = _rewards(device, 1)[:8]
    ids = torch.arange(8, device=device) // 4
    torch.testing.assert_close(grpo_advantages(r, 4), grpo_advantages(r, group_ids=ids))
    torch.testing.assert_close(rloo_advantages(r, 4), rloo_advantages(r, group_ids=ids))


def test_reinforce_pp_with_and_without_baseline(device):
    r = _rewards(device, 2)
    lengths = torch.tensor([3, 5, 1, 2, 2, 4, 6, 1, 2, 3], dtype=F64, device=device)
    ids = torch.tensor(IDS, device=device)

    def whiten(x, wts):
        n = sum(wts)
        mean = sum(a * b for a, b in zip(x, wts)) / n
        var = sum(b * (a - mean) ** 2 for a, b in zip(x, wts)) / (n - 1)
        return [(a - mean) / math.sqrt(var + 1e-8) for a in x]  # verl's masked_whiten

    plain = reinforce_pp_advantages(r)
    assert plain.tolist() == pytest.approx(whiten(r.tolist(), [1] * len(IDS)))
    # verl whitens the token tensor: the same as weighting each sequence by its length
    tok = reinforce_pp_advantages(r, lengths=lengths)
    assert tok.tolist() == pytest.approx(whiten(r.tolist(), lengths.tolist()))
    base = reinforce_pp_advantages(r, group_ids=ids, baseline=True)
    centred = list(r.tolist())
    for members in _groups(IDS).values():
        mean = sum(r[k].item() for k in members) / len(members)
        for k in members:
            centred[k] = r[k].item() - mean
    assert base.tolist() == pytest.approx(whiten(centred, [1] * len(IDS)))


def test_reinforce_pp_whitening_adds_eps_to_the_variance_as_verl(device):
    # Nearly equal rewards stay small: 5e-6 / sqrt(3.33e-11 + 1e-8) = 0.0499; 1/(std + 1e-6) gave 0.738.
    adv = reinforce_pp_advantages(torch.tensor([0.0, 1e-5, 0.0, 1e-5], dtype=F64, device=device))
    assert adv.tolist() == pytest.approx([-0.049917, 0.049917, -0.049917, 0.049917], abs=1e-6)


def test_opo_length_weighted_baseline(device):
    r = _rewards(device, 3)
    lengths = torch.tensor([3, 5, 1, 2, 2, 4, 6, 1, 2, 3], dtype=F64, device=device)
    adv = opo_advantages(r, lengths, group_ids=torch.tensor(IDS, device=device))
    for members in _groups(IDS).values():
        base = sum(lengths[k].item() * r[k].item() for k in members) / sum(lengths[k].item() for k in members)
        for k in members:
            assert adv[k].item() == pytest.approx(0.0 if len(members) == 1 else r[k].item() - base)


def test_opob_baseline_and_its_logit_gradient_proxy(device):
    r = _rewards(device, 4)
    w = torch.rand(len(IDS), generator=torch.Generator().manual_seed(5), dtype=F64).to(device) * 2
    gn = torch.rand(len(IDS), generator=torch.Generator().manual_seed(6), dtype=F64).to(device) + 0.1
    adv = opob_advantages(r, w, gn, group_ids=torch.tensor(IDS, device=device))
    for members in _groups(IDS).values():
        num = sum(w[k].item() ** 2 * gn[k].item() * r[k].item() for k in members)
        den = sum(w[k].item() ** 2 * gn[k].item() for k in members)
        for k in members:
            assert adv[k].item() == pytest.approx(0.0 if len(members) == 1 else r[k].item() - num / den)
    # ‖∂ log softmax(z)_y / ∂z‖² = 1 − 2p_y + Σp² per token, checked by autograd on random logits
    z = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(7), dtype=F64).to(device).requires_grad_(True)
    y = torch.tensor([[0, 3, 1], [4, 4, 2]], device=device)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool, device=device)
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, y[..., None]).squeeze(-1)
    expected = torch.zeros(2, dtype=F64, device=device)
    for i, t in mask.nonzero().tolist():
        (g,) = torch.autograd.grad(logp[i, t], z, retain_graph=True)
        expected[i] += (g[i, t] ** 2).sum()
    got = logit_grad_sq_norm(logp, mask, sum_p_sq=(logp_all.exp() ** 2).sum(-1))
    torch.testing.assert_close(got, expected)
    cfg = SimpleNamespace(estimator="vcpo_opob", eps=1e-6)
    torch.testing.assert_close(
        compute_advantages(cfg, r, group_ids=torch.tensor(IDS, device=device), is_weights=w, grad_sq_norms=gn), adv
    )
    with pytest.raises(ValueError, match="grad_sq_norms"):
        compute_advantages(cfg, r, group_ids=torch.tensor(IDS, device=device))


@pytest.mark.parametrize("est", ["abs", "k1_plus", "k2_plus", "k3_plus", "abs_plus"])
def test_kl_abs_and_straight_through_forms(device, est):
    # x = log π_θ − log π_ref over a row with ±30 and ordinary values
    x = torch.tensor([[0.3, -0.7, 30.0, -30.0, 0.0]], dtype=F64, device=device)
    ref = torch.full_like(x, -40.0)
    logp = (ref + x).requires_grad_(True)
    kl = kl_penalty(logp, ref, est)
    base = est.removesuffix("_plus")
    xs = x[0].tolist()
    fwd = {
        "abs": [abs(v) for v in xs],
        "k1": xs,
        "k2": [0.5 * v * v for v in xs],
        "k3": [math.expm1(max(-20, min(20, -v))) - max(-20, min(20, -v)) for v in xs],
    }[base]
    assert kl[0].tolist() == pytest.approx(fwd, rel=1e-12)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    expected_grad = [math.copysign(1.0, v) if v != 0 else 0.0 for v in xs] if est == "abs" else xs  # k2's gradient
    assert grad[0].tolist() == pytest.approx(expected_grad)


def test_defaults_follow_verl_unless_a_seed_gives_a_reason():
    loss = LossConfig()
    assert loss.kl_cov_coef == 0.1  # verl ppo_kl_coef; no paper value (docs/algo.md "Porting a verl config")
    assert loss.kl_estimator == "k2"  # seed 000: KL in the loss without IS weights -> k2 (verl: low_var_kl = k3)
    assert loss.dppo_ratio_cap == 20.0  # seed 000 / DPPO §5.4: a large cap (verl's effective clip_ratio_c is 3.0)
