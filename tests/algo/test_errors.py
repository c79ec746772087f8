"""Bad input gets one clear error naming the field and what was expected."""

from __future__ import annotations

import pytest
import torch

from moe_rl.algo import (
    LossInputs,
    PPOClipParams,
    gspo_loss,
    gspo_token_loss,
    icepop_weights,
    offpolicy_metrics,
    opsm_mask,
    ppo_clip_loss,
    rejection_mask,
    token_veto,
    truncated_is_weights,
)

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
LP = torch.full((2, 3), -1.0)


def test_shape_mismatch_names_the_field_and_shapes():
    with pytest.raises(ValueError, match=r"rollout_logp: expected shape \(2, 3\).*got \(2, 4\)"):
        icepop_weights(LP, torch.zeros(2, 4), MASK)


def test_integer_mask_is_rejected():
    with pytest.raises(TypeError, match="mask: expected dtype bool"):
        truncated_is_weights(LP, LP, MASK.long())


def test_mask_of_wrong_rank_is_rejected():
    with pytest.raises(ValueError, match=r"mask: expected 2 dims \[B, T\]"):
        offpolicy_metrics(LP, LP, MASK[0])


def test_float_mask_must_be_zero_one():
    with pytest.raises(ValueError, match="0.0 and 1.0"):
        offpolicy_metrics(LP, LP, MASK.float() * 0.5)
    offpolicy_metrics(LP, LP, MASK.float())  # a 0/1 float mask is fine


def test_empty_mask_is_rejected():
    with pytest.raises(ValueError, match="at least one valid"):
        rejection_mask(LP, LP, torch.zeros_like(MASK), "token_k1", upper=2.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_valid_values_are_rejected_with_position(bad):
    x = LP.clone()
    x[1, 0] = bad
    with pytest.raises(ValueError, match=r"old_logp: expected finite.*\(1, 0\)"):
        token_veto(x, LP, MASK, threshold=1e-4)


def test_non_finite_padding_is_allowed():
    x = LP.clone()
    x[1, 2] = float("nan")
    x[0, 2] = float("-inf")
    m = offpolicy_metrics(x, LP, MASK)
    assert all(torch.isfinite(v) for v in m.values())


def test_advantages_shape_is_checked():
    with pytest.raises(ValueError, match="advantages: expected shape"):
        ppo_clip_loss(LossInputs(LP, LP, torch.zeros(3), MASK))
    with pytest.raises(ValueError, match="advantages: expected shape"):
        opsm_mask(LP, LP, MASK, torch.zeros(2, 2), delta=0.1)


def test_non_tensor_and_integer_logp():
    with pytest.raises(TypeError, match="logp"):
        gspo_loss(LossInputs([[0.0]], LP, torch.zeros(2), MASK))
    with pytest.raises(TypeError, match="old_logp: expected a floating tensor"):
        icepop_weights(LP.long(), LP, MASK)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "seq_mean_k4", "upper": 1.0}, "rs_mode: expected one of"),
        ({"mode": "token_k1", "upper": None}, "rs_upper"),
        ({"mode": "seq_sum_k2", "lower": 0.1, "upper": 1.0}, "rs_lower"),
        ({"mode": "seq_mean_k1", "lower": 3.0, "upper": 2.0}, "lower ≤ upper"),
        ({"mode": "token_k3", "upper": -1.0}, "rs_upper: expected a finite number > 0"),
    ],
)
def test_rejection_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rejection_mask(LP, LP, MASK, **kwargs)


def test_loss_hyperparameters_are_checked():
    adv = torch.zeros(2)  # on the session device (conftest); LP and MASK were built on the host at import
    lp, mask = LP.to(adv.device), MASK.to(adv.device)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(LossInputs(lp, lp, adv, mask), PPOClipParams(dual_clip_c=1.0))
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_loss(LossInputs(lp, lp, adv, mask), PPOClipParams(clip_low=1.0))
    with pytest.raises(ValueError, match="aggregation"):
        ppo_clip_loss(LossInputs(lp, lp, adv, mask, aggregation="mean"))
    with pytest.raises(ValueError, match="is_weights: expected non-negative"):
        ppo_clip_loss(LossInputs(lp, lp, adv, mask, is_weights=-torch.ones(2, 3)))
    with pytest.raises(ValueError, match="icepop band"):
        icepop_weights(lp, lp, mask, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="is level"):
        truncated_is_weights(lp, lp, mask, level="geometric")


@pytest.mark.parametrize("fill", [1e30, -1e30, 0.0])
def test_finite_garbage_in_padding_changes_nothing(fill):
    """Finite padding is not copied away (fast path); every reduction must still ignore it."""
    from moe_rl.algo import cispo_loss, kl_penalty, reinforce_loss  # noqa: PLC0415

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    base = [-torch.rand(2, 4, dtype=torch.float64) for _ in range(3)]
    adv = torch.randn(2, 4, dtype=torch.float64)

    def run(pad):
        logp0, old, roll = (torch.where(mask, x, torch.full_like(x, pad)) for x in base)
        a = torch.where(mask, adv, torch.full_like(adv, pad))
        logp = logp0.clone().requires_grad_(True)
        losses = [
            ppo_clip_loss(LossInputs(logp, old, a, mask), PPOClipParams(dual_clip_c=3.0))[0],
            gspo_loss(LossInputs(logp, old, a, mask))[0],
            gspo_token_loss(LossInputs(logp, old, a[:, 0], mask))[0],
            cispo_loss(LossInputs(logp, old, a, mask))[0],
            reinforce_loss(LossInputs(logp, None, a, mask))[0],
            (kl_penalty(logp, roll, "k2") * mask).sum(),
        ]
        grads = [torch.autograd.grad(x, logp)[0] for x in losses]
        m = offpolicy_metrics(old, roll, mask)
        return torch.stack(losses), torch.stack(grads), torch.stack(list(m.values()))

    clean, dirty = run(0.0), run(fill)
    for c, d in zip(clean, dirty):
        torch.testing.assert_close(d, c)
