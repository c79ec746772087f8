"""A minibatch where no token survives (rejection, veto, M2PO, OPSM) or none is in the loss
(``loss_mask``: train.mask_truncated, stale tokens) gives a graph-connected zero loss, for every
correction, loss and aggregation, in both correction modes — never an exception (issue 40: M2PO
received the empty post-rejection keep set and raised on its own mask check).

Each case checks: loss == 0 and finite, ``requires_grad`` (the graph reaches π_θ), ``backward``
gives an all-zero gradient, every metric finite. The log-ratio to μ is ±3 on every valid token,
so each rejection below removes every token by itself.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from moe_rl.algo import (
    AGGREGATIONS,
    LOSS_TYPES,
    RS_MODES,
    LossInputs,
    compute_policy_loss,
    m2po_mask,
    policy_loss,
    prepare_corrections,
    surrogate_loss,
)
from moe_rl.config import CorrectionConfig, LossConfig

MASK_CPU = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
GAP = 3.0  # |log π − log μ| on every valid token: outside every band below

# thresholds each reject every token (or sequence) at a log-ratio of ±3
_RS_BOUND = {"k1": (0.5, 2.0), "k2": (None, 0.01), "k3": (None, 0.01)}


def _rs(mode: str) -> dict:
    lower, upper = _RS_BOUND[mode[-2:]]
    return {"rs_mode": mode, "rs_lower": lower, "rs_upper": upper}


# every correction, each configured so that it alone removes every token (IcePop and IS weights
# remove nothing from the kept set: they run together with a rejecting token_k1 criterion)
REJECT_ALL = {"rejection": [{"mode": "token_k1", "lower": 0.5, "upper": 2.0}]}
CORRECTIONS = {
    **{f"rs_{m}": _rs(m) for m in RS_MODES},
    "rejection_list": {"rejection": [{"mode": "seq_mean_k2", "upper": 0.01}, {"mode": "token_k3", "upper": 0.01}]},
    "token_veto": {"token_veto_threshold": 0.5},
    "opsm": {"opsm_delta": 0.1},
    "m2po": {"m2po_tau": 0.04},
    "m2po+token_k2": {"m2po_tau": 0.04, "rejection": [{"mode": "token_k2", "upper": 0.01}]},
    "m2po+veto": {"m2po_tau": 0.04, "token_veto_threshold": 0.5},
    "is_token+reject": {"is_level": "token", "is_batch_normalize": True, **REJECT_ALL},
    "is_sequence+reject": {"is_level": "sequence", "is_batch_normalize": True, **REJECT_ALL},
    "icepop_token+reject": {"icepop": True, **REJECT_ALL},
    "icepop_sequence+reject": {"icepop": True, "icepop_level": "sequence", "icepop_weighted": False, **REJECT_ALL},
    "icepop_geometric+tis+reject": {"icepop": True, "icepop_level": "geometric", "is_level": "token", **REJECT_ALL},
}


def _inputs(mode: str, sign: float, device):
    """(logp, old_logp, rollout_logp, advantages) on ``device``: ratio to μ is e^{sign·3}; A < 0 so OPSM applies."""
    g = torch.Generator().manual_seed(7)
    mu = -torch.rand(MASK_CPU.shape, generator=g, dtype=torch.float64) - 0.5
    old = mu + sign * GAP
    logp = old + 0.01 * torch.randn(MASK_CPU.shape, generator=g, dtype=torch.float64)
    if mode == "bypass":
        logp, old = mu + sign * GAP, None
    adv = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64)
    old = None if old is None else old.to(device)
    return logp.to(device).requires_grad_(True), old, mu.to(device), adv.to(device)


def _assert_graph_connected_zero(loss: torch.Tensor, logp: torch.Tensor, metrics: dict):
    assert loss.requires_grad, "loss detached from π_θ"
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert logp.grad is not None and bool((logp.grad == 0).all())
    bad = {k: float(v) for k, v in metrics.items() if not math.isfinite(float(v))}
    assert not bad, f"non-finite metrics {bad}"


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_every_correction_that_removes_every_token_gives_a_graph_connected_zero(name, mode, device):
    MASK = MASK_CPU.to(device)
    correction = CorrectionConfig(mode=mode, **CORRECTIONS[name])
    for loss_type in ("reinforce", "kl_cov"):  # IS weights applied in both modes; the covariance selection
        logp, old, mu, adv = _inputs(mode, -1.0, device)
        ent = torch.rand(MASK.shape, dtype=torch.float64, device=device, requires_grad=True)
        cfg = LossConfig(type=loss_type, kl_coef=0.1, entropy_coef=0.01)
        loss, metrics = compute_policy_loss(cfg, correction, logp, old, mu, adv, MASK, logp.detach() - 0.2, ent)
        assert float(metrics["correction/kept_token_frac"]) == 0.0, (name, loss_type)
        _assert_graph_connected_zero(loss, logp, metrics)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_and_aggregation_on_an_all_rejected_or_all_masked_minibatch(loss_type, aggregation, device):
    MASK = MASK_CPU.to(device)
    if aggregation == "token_mean" and loss_type == "gmpo":
        pytest.skip("the schema refuses token_mean for gmpo")
    cfg = LossConfig(type=loss_type, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01, norm_len=4)
    for mode in ("decoupled", "bypass"):
        # all rejected: a token_k1 criterion (+ M2PO, which used to raise on the empty keep set)
        logp, old, mu, adv = _inputs(mode, 1.0, device)
        correction = CorrectionConfig(mode=mode, m2po_tau=0.04, **REJECT_ALL)
        loss, metrics = compute_policy_loss(
            cfg,
            correction,
            logp,
            old,
            mu,
            adv,
            MASK,
            logp.detach(),
            torch.ones(MASK.shape, dtype=torch.float64, device=device),
        )
        _assert_graph_connected_zero(loss, logp, metrics)
        # all masked: no rejection, the loss mask removes every token (the trainer's three phases)
        logp, old, mu, adv = _inputs(mode, 0.0, device)
        correction = CorrectionConfig(mode=mode, m2po_tau=0.04, is_level="token")
        source = old if old is not None else logp.detach()
        prep = prepare_corrections(
            cfg,
            correction,
            source,
            mu,
            MASK,
            policy_logp=logp.detach(),
            advantages=adv,
            loss_mask=torch.zeros_like(MASK),
        )
        for rows in ([0], [1, 2]):  # two microbatches, each with the global denominator
            lp = logp.detach()[rows].requires_grad_(True)
            loss, metrics = policy_loss(
                cfg,
                correction,
                lp,
                None if old is None else old[rows],
                mu[rows],
                adv[rows],
                MASK[rows],
                prep.keep[rows],
                None if prep.weights is None else prep.weights[rows],
                prep.denominator,
                ref_logp=lp.detach(),
                entropy=torch.ones(lp.shape, dtype=torch.float64, device=device),
                cov_selected=None if prep.cov_selected is None else prep.cov_selected[rows],
            )
            _assert_graph_connected_zero(loss, lp, prep.metrics | metrics)
        # the surrogate itself, handed an empty kept set
        logp, old, mu, adv = _inputs(mode, 0.0, device)
        x = LossInputs(
            logp,
            mu if old is None else old,
            adv[:, None].expand_as(MASK),
            torch.zeros_like(MASK),
            generator=torch.Generator().manual_seed(0),
        )
        loss, metrics = surrogate_loss(cfg, x)
        _assert_graph_connected_zero(loss, logp, metrics)


def test_m2po_on_an_empty_kept_set_keeps_nothing_and_reports_zero(device):
    zeros = torch.zeros(2, 3, device=device)
    keep, metrics = m2po_mask(zeros, zeros, zeros.bool(), 0.04)
    assert not bool(keep.any())
    assert {k: float(v) for k, v in metrics.items()} == {
        "m2po/masked_frac": 0.0,
        "m2po/m2_before": 0.0,
        "m2po/m2_after": 0.0,
    }


def test_issue_40_smallest_m2po_case(device):
    """The issue's reproduction: one token, k1 rejection removes it, M2PO on."""
    t = lambda x: torch.tensor(x, dtype=torch.float64, device=device)
    logp = t([[0.0]]).requires_grad_(True)
    correction = CorrectionConfig(m2po_tau=0.04, rejection=[{"mode": "token_k1", "lower": 0.5, "upper": 2.0}])
    loss, metrics = compute_policy_loss(
        LossConfig(), correction, logp, t([[0.0]]), t([[-3.0]]), t([1.0]), torch.tensor([[True]], device=device)
    )
    _assert_graph_connected_zero(loss, logp, metrics)


def test_compute_policy_loss_keeps_its_positional_signature():
    params = list(inspect.signature(compute_policy_loss).parameters)
    assert params == [
        "loss_cfg",
        "correction_cfg",
        "logp",
        "old_logp",
        "rollout_logp",
        "advantages",
        "mask",
        "ref_logp",
        "entropy",
        "loss_denominator",
        "norm_len",
        "generator",
    ]
