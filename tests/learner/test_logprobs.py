"""Token log-probs / entropy: against torch's log_softmax, and padded vs packed forward agreement."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.learner.logprobs import logprobs_from_logits, response_logprobs, sum_pi_squared_from_logits
from moe_rl.learner.model import build_model
from tests.learner.conftest import make_cfg


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    v=st.integers(2, 40),
    temperature=st.floats(0.25, 4.0),
    scale=st.floats(0.1, 30.0),
    seed=st.integers(0, 2**16),
)
def test_logprobs_and_entropy_match_reference_softmax(device, b, t, v, temperature, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * scale).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (b, t), generator=g).to(device)
    logp, ent = logprobs_from_logits(logits, targets, temperature=temperature, tp_group=None)

    # Reference in float64 by a second formula: explicit probabilities.
    p = torch.softmax(logits.double() / temperature, dim=-1)
    ref_logp = p.gather(-1, targets.unsqueeze(-1)).squeeze(-1).log()
    ref_ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    finite = ref_logp > -60  # float64 underflow of p itself makes the reference useless there
    assert torch.allclose(logp.double()[finite], ref_logp[finite], atol=2e-5, rtol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
    assert (ent >= -1e-6).all() and (ent <= math.log(v) + 1e-5).all(), "entropy outside [0, log V]"


def test_padding_targets_give_zero_logp_and_no_gradient(device):
    logits = torch.randn(2, 4, 10, device=device, requires_grad=True)
    targets = torch.tensor([[1, 2, -1, -1], [3, 4, 5, -1]], device=device)
    logp, _ = logprobs_from_logits(logits, targets, with_entropy=False, tp_group=None)
    assert (logp[targets < 0] == 0).all()
    logp.sum().backward()
    assert (logits.grad[targets < 0] == 0).all(), "padding positions received gradient"
    # Gradient of log p(y) w.r.t. logits is onehot(y) - softmax: check one row by hand.
    expected = -torch.softmax(logits[0, 0].detach(), -1)
    expected[1] += 1
    assert torch.allclose(logits.grad[0, 0], expected, atol=1e-6)


def test_bad_shapes_and_temperature_raise_one_clear_error():
    with pytest.raises(ValueError, match=r"expected logits\[B, T, V\] and targets\[B, T\]"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), tp_group=None)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(torch.zeros(1, 1, 5), torch.zeros(1, 1, dtype=torch.long), temperature=0.0, tp_group=None)


def test_packed_forward_matches_padded_forward(megatron_world, device):
    """Two samples packed in one row with segment ids score exactly like the padded batch."""

    cfg = make_cfg(init_method_std=0.1)
    model = build_model(cfg, seed=11).eval()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (9,), generator=g).to(device), torch.randint(0, 256, (6,), generator=g).to(device)

    pad_in = torch.zeros(2, 8, dtype=torch.long, device=device)
    pad_tg = torch.full((2, 8), -1, device=device)
    pad_in[0, :8], pad_tg[0, :8] = a[:-1], a[1:]
    pad_in[1, :5], pad_tg[1, :5] = b[:-1], b[1:]
    packed_in = torch.cat([a[:-1], b[:-1]]).unsqueeze(0)
    packed_tg = torch.cat([a[1:], b[1:]]).unsqueeze(0)
    seg = torch.tensor([[0] * 8 + [1] * 5], device=device)

    with torch.no_grad():
        lp_pad, ent_pad = response_logprobs(model, pad_in, pad_tg)
        lp_pack, ent_pack = response_logprobs(model, packed_in, packed_tg, segment_ids=seg)
    got = torch.cat([lp_pack[0, :8], lp_pack[0, 8:]])
    want = torch.cat([lp_pad[0, :8], lp_pad[1, :5]])
    assert torch.allclose(got, want, atol=1e-5), f"packed vs padded logp differ by {(got - want).abs().max():.2e}"
    assert torch.allclose(
        torch.cat([ent_pack[0, :8], ent_pack[0, 8:]]), torch.cat([ent_pad[0, :8], ent_pad[1, :5]]), atol=1e-5
    )
    # Without segment ids the second sample would attend to the first: the check above can fail.
    with torch.no_grad():
        lp_leak, _ = response_logprobs(model, packed_in, packed_tg)
    assert not torch.allclose(lp_leak[0, 8:], lp_pad[1, :5], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sum_pi_squared_matches_the_softmax(device, temperature):
    """Σ_v π_v² of softmax(z/τ) (the optimal token baselines' input), on logits up to ±60: finite, in (0, 1]."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 4, 50, generator=g, dtype=torch.float64) * 20).to(device)
    logits[0, 0] = 0.0  # uniform: Σπ² = 1/V
    got = sum_pi_squared_from_logits(logits, temperature=temperature, tp_group=None)
    ref = torch.softmax(logits / temperature, dim=-1).pow(2).sum(-1)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    assert abs(float(got[0, 0]) - 1 / 50) < 1e-15 and bool(((got > 0) & (got <= 1)).all())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sum_pi_squared_from_logits(logits, temperature=0.0, tp_group=None)
