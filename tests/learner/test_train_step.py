"""Train step on real Megatron MoE models: learning, aux-loss scaling, recompute, LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import OptimConfig
from moe_rl.learner.logprobs import logprobs_from_logits
from moe_rl.learner.model import forward_logits, moe_routers
from moe_rl.learner.optimizer import grad_norm_and_clip, lr_at
from moe_rl.learner.train_step import Learner
from tests.conftest import session_device
from tests.learner.conftest import make_cfg


def nll_loss(logp, entropy, mb):
    """Masked token-mean negative log-likelihood (a simple stand-in for the policy loss)."""
    mask = (mb["targets"] >= 0).float()
    return -(logp * mask).sum() / mask.sum(), {"entropy": (entropy * mask).sum() / mask.sum()}


def zero_loss(logp, entropy, mb):
    """Zero main loss that still runs backward through the model (only aux losses give grads)."""
    return logp.sum() * 0.0, {}


def fixed_batch(vocab: int, b: int = 4, t: int = 24, seed: int = 0, device=None):
    """``input_ids`` / ``targets`` ``[b, t]`` on ``device`` (default: the session device)."""
    g = torch.Generator().manual_seed(seed)  # CPU generator: the same tokens on every device
    tokens = torch.randint(0, vocab, (b, t + 1), generator=g).to(device or session_device())
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_train_step_reduces_loss_on_fixed_batch(megatron_world, device):
    cfg = make_cfg(optim={"lr": 3e-3, "clip_grad": 1.0}, moe_aux_loss_coeff=1e-2)
    learner = Learner(cfg, total_steps=12)
    mb = fixed_batch(cfg.model.vocab_size, device=device)
    stats = [learner.train_step([mb], nll_loss) for _ in range(12)]
    first, last = stats[0].loss, stats[-1].loss
    print(f"loss {first:.4f} -> {last:.4f} over 12 steps; grad norms {[round(s.grad_norm, 3) for s in stats[:3]]}")
    assert last < first - 0.5, f"loss did not drop on a fixed batch: {first:.4f} -> {last:.4f}"
    assert stats[-1].step == 12 and "entropy" in stats[-1].metrics
    assert all(math.isfinite(s.grad_norm) and s.grad_norm > 0 for s in stats)


def _router_grads(cfg, microbatches, loss_fn):
    """Router ``main_grad`` after one ``train_step`` with clipping off (grads are kept after the step)."""

    learner = Learner(cfg, total_steps=1)
    learner.train_step(microbatches, loss_fn)
    return [r.weight.main_grad.clone() for r in moe_routers(learner.module)]


def test_aux_loss_gradient_is_averaged_over_microbatches(megatron_world, device):
    """Two identical microbatches must give the router the same aux-loss gradient as one.

    Without ``set_loss_scale(1/num_microbatches)`` Megatron's aux-loss gradient is
    summed over microbatches (2x here) while the main loss is averaged.
    """
    cfg = make_cfg(optim={"clip_grad": 0.0}, moe_aux_loss_coeff=0.1)
    mb = fixed_batch(cfg.model.vocab_size, device=device)
    one = _router_grads(cfg, [mb], zero_loss)
    two = _router_grads(cfg, [mb, mb], zero_loss)
    assert all(g.abs().max() > 0 for g in one), "aux loss produced no router gradient"
    for a, b in zip(one, two):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-9), (
            f"aux grad ratio {(b.norm() / a.norm()).item():.3f}, expected 1"
        )


def test_full_recompute_gives_same_gradients(megatron_world, device):
    mb = fixed_batch(256, seed=3, device=device)
    grads = {}
    for mode in ("none", "full"):
        cfg = make_cfg(train={"recompute": mode}, optim={"lr": 1e-3, "clip_grad": 0.0}, moe_aux_loss_coeff=1e-2)
        learner = Learner(cfg, total_steps=1)
        assert (learner.config.recompute_granularity == "full") == (mode == "full")
        learner.train_step([mb], nll_loss)
        grads[mode] = {n: p.main_grad.clone() for n, p in learner.module.named_parameters()}
    for name, g in grads["none"].items():
        assert torch.allclose(g, grads["full"][name], atol=1e-6), f"{name}: recompute changed the gradient"


def test_grad_clipping_bounds_the_update_norm(megatron_world, device):
    cfg = make_cfg(optim={"lr": 1e-3, "clip_grad": 0.0})
    learner = Learner(cfg, total_steps=1)
    learner.train_step([fixed_batch(256, device=device)], nll_loss)
    raw = math.sqrt(sum(float(p.main_grad.double().pow(2).sum()) for p in learner.module.parameters()))
    measured = grad_norm_and_clip(learner.model, max_norm=raw / 4)
    assert measured == pytest.approx(raw, rel=1e-9)
    after = math.sqrt(sum(float(p.main_grad.double().pow(2).sum()) for p in learner.module.parameters()))
    assert after == pytest.approx(raw / 4, rel=1e-5), f"clipped norm {after}, expected {raw / 4}"


@pytest.mark.parametrize(
    "style,step,expected",
    [
        ("constant", 0, 0.25),
        ("constant", 3, 1.0),
        ("constant", 50, 1.0),
        ("linear", 4, 1.0),
        ("linear", 8, 0.55),
        ("linear", 12, 0.1),
        ("linear", 99, 0.1),
        ("cosine", 8, 0.55),
        ("cosine", 6, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),
    ],
)
def test_lr_schedule_hand_values(style, step, expected):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_style=style)
    assert lr_at(step, cfg, total_steps=12) == pytest.approx(expected)


def test_loss_fn_must_return_scalar(megatron_world, device):
    learner = Learner(make_cfg(), total_steps=1)
    with pytest.raises(ValueError, match="scalar loss; got shape"):
        learner.train_step([fixed_batch(256, device=device)], lambda lp, e, mb: (lp, {}))


def test_custom_logprob_fn_replaces_full_vocab_scoring(megatron_world, device):
    """A logprob_fn (e.g. Keep Sampling Mask) is what the loss sees and what gradients flow through."""

    seen = {}

    def half_temperature(model, mb, temperature):
        logits = forward_logits(model, mb["input_ids"])
        return logprobs_from_logits(logits, mb["targets"], temperature=temperature / 2)

    def loss(logp, entropy, mb):
        seen["logp"] = logp.detach()
        return nll_loss(logp, entropy, mb)

    mb = fixed_batch(256, device=device)
    a = Learner(make_cfg(), total_steps=1)
    a.train_step([mb], loss, temperature=1.0, logprob_fn=half_temperature)
    b = Learner(make_cfg(), total_steps=1)  # same seed, same weights before the step
    with torch.no_grad():
        want = logprobs_from_logits(forward_logits(b.model, mb["input_ids"]), mb["targets"], temperature=0.5)[0]
    assert torch.allclose(seen["logp"], want, atol=1e-6)
