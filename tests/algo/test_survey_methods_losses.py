"""Issue 54's MinPRO, CTPO, ASPO, TOPR, OAPL, VESPO losses, the TRM admission mask and A-3PO's proximal anchor: hand-derived goldens, gradients,
CTPO, ASPO, VESPO and A-3PO parity with their authors' code, and degenerate inputs (all masked, one token, constant rewards, ±30).

Each golden's derivation is in its test's docstring, from the equation in docs/algo.md (section
"Issue 54: prefix, trajectory and admission methods") and its source.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moe_rl.algo import (
    ASPOParams,
    CTPOParams,
    LossInputs,
    MinPROParams,
    OAPLParams,
    TOPRParams,
    VESPOParams,
    a3po_needs_prepass,
    a3po_proximal_logp,
    aspo_loss,
    compute_policy_loss,
    ctpo_loss,
    minpro_loss,
    oapl_loss,
    rejection_mask,
    topr_loss,
    trm_mask,
    vespo_loss,
)
from moe_rl.config import CorrectionConfig, LossConfig, OptimConfig
from moe_rl.config.loss_keys import INSTEAD

F64 = torch.float64
GOLDENS = {"ctpo": (ctpo_loss, CTPOParams), "vespo": (vespo_loss, VESPOParams), "aspo": (aspo_loss, ASPOParams)}
LOSSES = {
    "minpro": minpro_loss,
    "ctpo": ctpo_loss,
    "topr": topr_loss,
    "oapl": oapl_loss,
    "vespo": vespo_loss,
    "aspo": aspo_loss,
}


def _row(values, device):
    return torch.tensor([values], dtype=F64, device=device)


def _inputs(log_ratios, adv, device, mask=None, old=-1.5):
    """One or more rows: old_logp constant ``old``, logp = old + log_ratios (requires grad)."""
    lr = torch.tensor(log_ratios, dtype=F64, device=device)
    old_logp = torch.full_like(lr, old)
    logp = (old_logp + lr).requires_grad_(True)
    m = torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool, device=device)
    return logp, old_logp, torch.tensor(adv, dtype=F64, device=device), m


def test_minpro_hand_worked_prefix_min_is_a_stop_gradient_weight(device):
    """ρ = (2, ½, 4), A = 1: ρ̄ = (1, min{2} = 2, min{2, ½} = ½), w = ρ̄·ρ = (2, 1, 2).

    ℓ_t = −A·sg[ρ̄_t]·ρ_t, token mean: −(2 + 1 + 2)/3 = −5/3. ∂/∂log π_t = −A·w_t/3 = (−2/3, −1/3, −2/3):
    token 1's gradient is its own w only — were ρ̄ differentiated, tokens 2 and 3 would add to it.
    With token 2 masked out it is in no prefix: ρ̄_3 = min{2} = 2, w = (2, ·, 8), loss −(2 + 8)/2 = −5.
    """
    ln2 = math.log(2.0)
    logp, old, adv, mask = _inputs([[ln2, -ln2, 2 * ln2]], [[1.0, 1.0, 1.0]], device)
    loss, m = minpro_loss(LossInputs(logp, old, adv, mask, aggregation="token_mean"), MinPROParams())
    assert loss.item() == pytest.approx(-5 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _row([-2 / 3, -1 / 3, -2 / 3], device))
    assert m["loss/weight_max"].item() == pytest.approx(2.0)
    holed = torch.tensor([[True, False, True]], device=device)
    loss2, _ = minpro_loss(LossInputs(logp, old, adv, holed, aggregation="token_mean"), MinPROParams())
    assert loss2.item() == pytest.approx(-5.0)


def test_ctpo_hand_worked_cumulative_ratio_and_sqrt_t_bounds(device):
    """log ρ = (0.01, 0.02), A = 1, defaults (ε_low 0.025, ε_high 0.05, c 0.05, p ½): L = (0.01, 0.03).

    k = (1, √2): bounds ε_high·k = (0.05, 0.0707) hold both, so ℓ = −r with r = (e^0.01, e^0.03);
    token mean −(e^0.01 + e^0.03)/2; ∂/∂log π_t = −r_t/2 — token 1 gets nothing from token 2's
    cumulative ratio (sg on L). log ρ = (0.06, 0): L = (0.06, 0.06): token 1 is above 0.05 (clipped, ℓ =
    −e^0.05, no gradient) while token 2 is inside √2·0.05 = 0.0707 (ℓ = −e^0.06, gradient −e^0.06/2).
    """
    logp, old, adv, mask = _inputs([[0.01, 0.02]], [[1.0, 1.0]], device)
    loss, _ = ctpo_loss(LossInputs(logp, old, adv, mask), CTPOParams())
    assert loss.item() == pytest.approx(-(math.exp(0.01) + math.exp(0.03)) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _row([-math.exp(0.01) / 2, -math.exp(0.03) / 2], device))
    logp, old, adv, mask = _inputs([[0.06, 0.0]], [[1.0, 1.0]], device)
    loss, m = ctpo_loss(LossInputs(logp, old, adv, mask), CTPOParams())
    assert loss.item() == pytest.approx(-(math.exp(0.05) + math.exp(0.06)) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _row([0.0, -math.exp(0.06) / 2], device))
    assert m["loss/clip_frac"].item() == pytest.approx(0.5)


def test_ctpo_dual_clip_for_negative_advantages(device):
    """A = −1, log ρ = 0.2 at t = 1 (p = ½): r = e^0.2 > e^0.05, so max(r, clip(r)) = r, then the dual clip
    caps it at −A·exp(c·1) = e^0.05: loss e^0.05, zero gradient, dual_clip_frac 1."""
    logp, old, adv, mask = _inputs([[0.2]], [[-1.0]], device)
    loss, m = ctpo_loss(LossInputs(logp, old, adv, mask), CTPOParams())
    assert loss.item() == pytest.approx(math.exp(0.05))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.abs().max().item() == 0.0
    assert m["loss/dual_clip_frac"].item() == 1.0


@pytest.mark.parametrize("peer", sorted(GOLDENS))
def test_matches_the_authors_implementation(peer, device):
    """Loss and gradient equal the authors' code, token-mean, ≤ 1e-6 relative: horizon-llm/CTPO
    ``cum-token-cumprod-la``, FloyedShen/VESPO ``compute_policy_loss_vespo`` and zyh1999/ASPO (Archer2.0)
    ``compute_policy_loss_archer`` (one entropy class).

    The expected values were computed by that code (scripts/peer_loss_goldens.py; the commit is in each file).
    """
    fn, params = GOLDENS[peer]
    golden = json.loads(Path(__file__).with_name(f"{peer}_reference.json").read_text(encoding="utf-8"))
    mask = torch.tensor(golden["mask"], dtype=torch.bool, device=device)
    for case in golden["cases"]:
        logp = torch.tensor(case["logp"], dtype=F64, device=device).requires_grad_(True)
        old = torch.tensor(case["old_logp"], dtype=F64, device=device)
        adv = torch.tensor(case["advantages"], dtype=F64, device=device)
        loss, _ = fn(LossInputs(logp, old, adv, mask, aggregation="token_mean"), params(**case["params"]))
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(case["loss"], rel=1e-6, abs=1e-12)
        expected = torch.tensor(case["grad"], dtype=F64, device=device)
        torch.testing.assert_close(torch.where(mask, grad, 0.0), expected, rtol=1e-6, atol=1e-12)


def test_vespo_hand_worked_gamma_kernel_of_the_sequence_ratio(device):
    """log ρ = (0.1, 0.1), log π = (−1.4, −1.4), A = +1 (k 2, λ 3): W = e^0.2, φ = exp(3 + 2·0.2 − 3e^0.2).

    ℓ_t = −sg[φ]·A·log π_t, token mean: −φ·(−2.8)/2 = 1.4φ; ∂/∂log π_t = −φ/2. φ(1) = 1: log ρ = (0.1, −0.1)
    gives W = 1 and the plain REINFORCE term. IS weights (e^−0.2, 1) fold into W (= e^0 = 1 for the first row)
    and are not multiplied again: the loss is 1.4 exactly.
    """
    phi = math.exp(3 + 0.4 - 3 * math.exp(0.2))
    logp, old, adv, mask = _inputs([[0.1, 0.1]], [[1.0, 1.0]], device)
    loss, m = vespo_loss(LossInputs(logp, old, adv, mask), VESPOParams())
    assert loss.item() == pytest.approx(1.4 * phi)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _row([-phi / 2, -phi / 2], device))
    assert m["loss/phi_mean"].item() == pytest.approx(phi, rel=1e-6)
    logp, old, adv, mask = _inputs([[0.1, -0.1]], [[-1.0, -1.0]], device)
    loss, _ = vespo_loss(LossInputs(logp, old, adv, mask), VESPOParams())
    assert loss.item() == pytest.approx((-1.4 - 1.6) / 2)  # A = −1, φ = 1: ℓ_t = log π_t
    logp, old, adv, mask = _inputs([[0.1, 0.1]], [[1.0, 1.0]], device)
    w = _row([math.exp(-0.2), 1.0], device)
    loss, _ = vespo_loss(LossInputs(logp, old, adv, mask, is_weights=w), VESPOParams())
    assert loss.item() == pytest.approx(1.4)


def test_aspo_hand_worked_flipped_ratio_and_soft_dual_clip(device):
    """One row, log π = −1.5 + log r, ε_low = ε_high = 0.2, c_pos = c_neg = 3, token mean over 6:

    A = +1, r = ½: r̂ = ½, 1/r̂ = 2 ≤ 3: ℓ = −1/r̂ = −2, gradient −A/r = −2 (the flip: 1/r, not r).
    A = +1, r = 2: r̂ = 1.2 (clipped): ℓ = −1/1.2, gradient 0.
    A = +1, r = ¼: 1/r̂ = 4 > 3: soft dual clip ℓ = −3·log π = −3(−1.5 + ln ¼), gradient −3 (kept, not 0).
    A = −1, r = ½: r̂ = max(½, 0.8) = 0.8: ℓ = 0.8, gradient 0.
    A = −1, r = 4: r̂ = 4 > 3: ℓ = 3·log π = 3(−1.5 + ln 4), gradient 3.
    A = −1, r = 1.5: ℓ = r = 1.5, gradient −A·r = 1.5.
    """
    lr = [[math.log(0.5), math.log(2.0), math.log(0.25), math.log(0.5), math.log(4.0), math.log(1.5)]]
    logp, old, adv, mask = _inputs(lr, [[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], device)
    loss, m = aspo_loss(LossInputs(logp, old, adv, mask), ASPOParams())
    terms = [-2.0, -1 / 1.2, -3 * (-1.5 + math.log(0.25)), 0.8, 3 * (-1.5 + math.log(4.0)), 1.5]
    assert loss.item() == pytest.approx(sum(terms) / 6)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _row([-2 / 6, 0.0, -3 / 6, 0.0, 3 / 6, 1.5 / 6], device))
    assert m["loss/dual_clip_frac_pos"].item() == pytest.approx(1 / 6)
    assert m["loss/dual_clip_frac_neg"].item() == pytest.approx(1 / 6)


def test_topr_hand_worked_sft_on_positive_truncated_is_on_negative(device):
    """Rows (2 tokens, log π = −1.5 + log ρ): A = +1 with log ρ (0.5, 0.5) → w = 1 (no IS even at π/μ = e);
    A = −1 with log ρ (−0.5, −0.2) → w = [e^−0.7]_0^1 = e^−0.7; A = −1 with log ρ (0.3, 0.3) → w = [e^0.6]_0^1 = 1.

    ℓ_t = −sg[w_i]·A_i·log π_t; seq_mean_token_sum: (1/3) Σ_i Σ_t ℓ_t, so ∂/∂log π_t = −w_i A_i / 3.
    Value: (1/3)[−(−1 + −1) + e^−0.7·(−2.0 + −1.7) + (−1.2 + −1.2)].
    """
    logp, old, adv, mask = _inputs(
        [[0.5, 0.5], [-0.5, -0.2], [0.3, 0.3]], [[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]], device
    )
    loss, m = topr_loss(LossInputs(logp, old, adv, mask), TOPRParams())
    w1 = math.exp(-0.7)
    assert loss.item() == pytest.approx((2.0 + w1 * (-3.7) - 2.4) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-1 / 3, -1 / 3], [w1 / 3, w1 / 3], [1 / 3, 1 / 3]], dtype=F64, device=device)
    torch.testing.assert_close(grad, expected)
    assert m["loss/neg_frac"].item() == pytest.approx(2 / 3)
    assert m["loss/neg_weight_mean"].item() == pytest.approx((w1 + 1) / 2)


def test_oapl_hand_worked_regression_of_the_sequence_log_ratio(device):
    """log ρ = (0.1, 0.3): ln π(y)/π_inf(y) = 0.4; β = 2, A = 0.5: residual 2·0.4 − 0.5 = 0.3, loss 0.09.

    ∂/∂log π_t = 2·residual·β = 1.2 for each token (the squared error is per response, seq_mean_token_mean).
    """
    logp, old, adv, mask = _inputs([[0.1, 0.3]], [[0.5, 0.5]], device)
    loss, m = oapl_loss(LossInputs(logp, old, adv, mask), OAPLParams(oapl_beta=2.0))
    assert loss.item() == pytest.approx(0.09)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _row([1.2, 1.2], device))
    assert m["loss/residual_mean"].item() == pytest.approx(0.3)


def test_trm_hand_worked_max_token_kl_admission(device):
    """log ρ rows (0.1, −0.1) and (0.1, 0.5). k3(x) = eˣ − x − 1: k3(0.1) = 0.00517, k3(0.5) = 0.14872;
    k2(x) = x²/2: k2(0.5) = 0.125. δ = 0.1: row 2's max exceeds δ under both, so all its tokens go; row 1 stays.
    δ = 0.2 admits both. The keep mask equals verl's seq_max_k3 rejection at upper δ."""
    lr = torch.tensor([[0.1, -0.1], [0.1, 0.5]], dtype=F64, device=device)
    rollout = torch.full_like(lr, -2.0)
    mask = torch.ones_like(lr, dtype=torch.bool)
    for est in ("k3", "k2"):
        keep, m = trm_mask(rollout + lr, rollout, mask, 0.1, est)
        assert keep.tolist() == [[True, True], [False, False]]
        assert m["trm/seq_masked_frac"].item() == 0.5
    _, m = trm_mask(rollout + lr, rollout, mask, 0.1, "k3")
    assert m["trm/max_kl_max"].item() == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)
    keep, _ = trm_mask(rollout + lr, rollout, mask, 0.2, "k3")
    assert bool(keep.all())
    for delta in (0.004, 0.1, 0.2):
        same, _ = rejection_mask(rollout + lr, rollout, mask, "seq_max_k3", None, delta)
        assert torch.equal(trm_mask(rollout + lr, rollout, mask, delta)[0], same)


def test_trm_through_the_config_masks_the_sequence_in_the_loss(device):
    """``correction.trm_delta`` in decoupled mode: the second sequence (k3 max 0.149 > 0.1) leaves the loss."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -0.5]], dtype=F64, device=device)
    roll = torch.tensor([[-1.1, -0.9], [-1.1, -1.0]], dtype=F64, device=device)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0], dtype=F64, device=device)
    mask = torch.ones_like(old, dtype=torch.bool)
    corr = CorrectionConfig(mode="decoupled", trm_delta=0.1, kl_alarm=None)
    loss, metrics = compute_policy_loss(LossConfig(type="ppo_clip"), corr, logp, old, roll, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[1].abs().max().item() == 0.0 and grad[0].abs().min().item() > 0
    assert float(metrics["trm/seq_masked_frac"]) == 0.5


def _degenerate_batches(device):
    """(name, logp, old, adv, mask): all masked, one token, constant rewards (A = 0), ±30 log-ratios."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g, dtype=F64) * 2 - 0.05
    lp = old + 0.2 * torch.randn(3, 4, generator=g, dtype=F64)
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    full = torch.ones(3, 4, dtype=torch.bool)
    one = torch.zeros(3, 4, dtype=torch.bool)
    one[1, 0] = True
    wild_old, wild_lp = old.clone(), lp.clone()
    wild_old[0, :2], wild_lp[0, :2] = -31.0, -1.0  # +30
    wild_lp[2, 1:] = wild_old[2, 1:] - 30.0  # −30
    cases = [
        ("all masked", lp, old, adv, torch.zeros(3, 4, dtype=torch.bool)),
        ("one token", lp, old, adv, one),
        ("constant rewards", lp, old, torch.zeros(3, 4, dtype=F64), full),
        ("±30 log-ratios", wild_lp, wild_old, adv, full),
    ]
    return [(n, *(t.to(device) for t in ts)) for n, *ts in cases]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_degenerate_inputs_give_finite_loss_and_gradients(name, device):
    for case, lp, old, adv, mask in _degenerate_batches(device):
        logp = lp.clone().requires_grad_(True)
        loss, metrics = LOSSES[name](LossInputs(logp, old, adv, mask))
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss), (name, case)
        assert bool(torch.isfinite(grad).all()), (name, case)
        assert all(bool(torch.isfinite(v)) for v in metrics.values()), (name, case, metrics)
        if case == "all masked":
            assert loss.item() == 0.0 and grad.abs().max().item() == 0.0
        if case == "constant rewards" and name != "oapl":  # OAPL regresses β·log-ratio on A = 0: not zero
            assert loss.item() == 0.0


def test_trm_degenerate_inputs(device):
    for case, lp, old, _, mask in _degenerate_batches(device):
        keep, metrics = trm_mask(lp, old, mask, 0.05)
        assert not bool((keep & ~mask).any()), case
        assert all(bool(torch.isfinite(v)) for v in metrics.values()), case


def test_config_selects_each_method_and_names_its_keys():
    for name in LOSSES:
        assert LossConfig(type=name).type == name
    assert ("ctpo", "clip_low") in INSTEAD
    with pytest.raises(ValueError, match="trm_delta"):
        CorrectionConfig(trm_delta=0.0)
    with pytest.raises(ValueError, match="vespo_lambda_pos"):
        vespo_loss(LossInputs(*_inputs([[0.1]], [[1.0]], "cpu")), VESPOParams(vespo_lambda_pos=0.0))
    with pytest.raises(ValueError, match="oapl_beta"):
        oapl_loss(LossInputs(*_inputs([[0.1]], [[1.0]], "cpu")), OAPLParams(oapl_beta=0.0))


def test_a3po_hand_worked_staleness_interpolation(device):
    """v_θ = 8, v_prox = 7: α = (7 − v_μ)/(8 − v_μ). v_μ = 7 → 0 (log μ); 6 → ½; 4 → ¾; 8 → 0 (v_θ ≤ v_μ);
    −1 → 0 (no generation version). log μ = −2, log π_θ = −1: log π_prox = −2 + α = (−2, −1.5, −1.25, −2, −2)."""
    roll = torch.full((1, 5), -2.0, dtype=F64, device=device)
    cur = torch.full((1, 5), -1.0, dtype=F64, device=device)
    versions = torch.tensor([[7, 6, 4, 8, -1]], device=device)
    mask = torch.ones(1, 5, dtype=torch.bool, device=device)
    prox, m = a3po_proximal_logp(roll, cur, mask, versions, 8)
    torch.testing.assert_close(prox, _row([-2.0, -1.5, -1.25, -2.0, -2.0], device))
    assert m["a3po/alpha_mean"].item() == pytest.approx(0.25)
    empty, _ = a3po_proximal_logp(roll, cur, torch.zeros_like(mask), versions, 8)  # all masked: log μ, no error
    torch.testing.assert_close(empty, roll)


def test_a3po_matches_areal(device):
    """Equal to AReaL's ``compute_prox_logp_approximations(method='loglinear')`` (golden from scripts/peer_loss_goldens.py)."""
    golden = json.loads(Path(__file__).with_name("a3po_reference.json").read_text(encoding="utf-8"))
    t = {k: torch.tensor(golden[k], dtype=F64, device=device) for k in ("rollout_logp", "logp", "prox_logp")}
    versions = torch.tensor(golden["token_versions"], device=device)
    mask = torch.ones_like(versions, dtype=torch.bool)
    prox, _ = a3po_proximal_logp(t["rollout_logp"], t["logp"], mask, versions, golden["current_version"])
    # ≤ 1e-6 relative: AReaL forms α in float32 (versions.float()), we in the log-probs' dtype
    torch.testing.assert_close(prox, t["prox_logp"], rtol=1e-6, atol=1e-7)


def test_a3po_runs_in_decoupled_mode_and_is_refused_where_it_has_no_anchor_or_pass():
    """The step runs A-3PO (tests/distributed/test_methods_ranks.py); bypass mode has no π_old to approximate, and
    R2 records its routes in the old-log-prob pass that A-3PO skips."""
    from moe_rl.config import load_config  # noqa: PLC0415 -- only this test loads a config file
    from moe_rl.config.correction_keys import correction_settings  # noqa: PLC0415 -- as above

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    assert list(correction_settings(load_config(tiny, ["correction.prox_logp_method=loglinear"]))) == []
    (problem,) = correction_settings(
        load_config(tiny, ["correction.prox_logp_method=loglinear", "correction.mode=bypass"])
    )
    assert problem.startswith("correction.prox_logp_method='loglinear' (A-3PO) approximates decoupled mode's")
    assert "expected correction.mode=decoupled" in problem
    (problem,) = correction_settings(load_config(tiny, ["correction.prox_logp_method=loglinear", "replay.routing=r2"]))
    assert "replay.routing='r2' records the routes it replays" in problem


A3PO_PREPASS = [  # (correction / loss / optim settings, whether a minibatch-wide statistic reads π_prox)
    ({}, False),
    ({"icepop": True}, False),  # per token: its band weights come from each microbatch's forward
    ({"icepop": True, "icepop_level": "sequence"}, False),  # per sequence: a microbatch holds whole sequences
    ({"is_level": "sequence", "is_threshold": 2.0}, False),  # TIS per sequence
    ({"opsm_delta": 0.01}, False),  # OPSM reads π_θ per microbatch in every mode
    ({"is_level": "token", "is_threshold": 2.0, "is_batch_normalize": True}, True),  # the minibatch's mean weight
    ({"rs_mode": "token_k1", "rs_lower": 0.5, "rs_upper": 2.0}, True),  # changes the loss denominator
    ({"rejection": [{"mode": "seq_max_k2", "upper": 0.02}]}, True),
    ({"token_veto_threshold": 0.9}, True),
    ({"trm_delta": 0.02}, True),
    ({"m2po_tau": 0.04}, True),  # a sort of the minibatch's (log ρ)²
    ({"loss.type": "clip_cov"}, True),  # a top-k of π_θ over the minibatch
    ({"optim.ess_lr_scaling": True}, True),  # the minibatch's ESS sets the step's lr
]


@pytest.mark.parametrize(("settings", "needed"), A3PO_PREPASS, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_a3po_needs_a_prepass_only_where_a_minibatch_wide_statistic_reads_pi_prox(settings, needed):
    """Under A-3PO the step interpolates π_prox from the update's own forward (no extra forward, as AReaL) unless a
    statistic over the whole minibatch reads π_prox before the first backward (tests/distributed/
    test_methods_ranks.py counts the forwards and checks both paths give the same step)."""
    corr = {k: v for k, v in settings.items() if "." not in k} | {"prox_logp_method": "loglinear"}
    loss = LossConfig(type=settings.get("loss.type", "ppo_clip"))
    optim = OptimConfig(ess_lr_scaling=settings.get("optim.ess_lr_scaling", False))
    assert a3po_needs_prepass(CorrectionConfig(**corr), loss, optim) is needed


def test_oapl_is_refused_outside_bypass_mode():
    """OAPL's ratio is to the rollout policy pi_inf (seed 000): in decoupled mode the loss's ratio is to pi_old."""
    from moe_rl.config import load_config  # noqa: PLC0415 -- only these tests load a config file
    from moe_rl.preflight import config_problems  # noqa: PLC0415 -- as above

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    base = ["loss.clip_low=0.2", "loss.clip_high=0.28", "loss.type=oapl"]  # tiny_cpu's GSPO clips: unread by OAPL
    problems = config_problems(load_config(tiny, [*base, "correction.mode=decoupled"])).problems
    assert [p for p in problems if p.startswith("loss.type='oapl'") and "expected correction.mode=bypass" in p]
    problems = config_problems(load_config(tiny, [*base, "correction.mode=bypass"])).problems
    assert not [p for p in problems if "oapl" in p], problems
