"""Megatron's gradient finalisation in the custom train step: the expert-bias update (DeepSeek-V3's
aux-loss-free balancing) moves after a step, in the direction the token counts say, and pads are
not counted."""

from __future__ import annotations

import torch

from moe_rl.learner.train_step import Learner
from moe_rl.replay.dispatch_probe import DispatchProbe
from moe_rl.train.logprob import make_logprob_fn
from tests.learner.conftest import make_cfg


def _expected_update(counts: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """Megatron's rule, written out: bias += rate * sign(mean count - count) per expert."""
    return rate * torch.sign(counts.float().mean() - counts.float())


def test_expert_bias_moves_by_the_valid_token_counts_only(megatron_world, device):
    cfg = make_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    learner = Learner(cfg)
    routers = [m for m in learner.module.modules() if hasattr(m, "expert_bias") and m.expert_bias is not None]
    assert routers, "the model should have routers with an expert bias"
    before = [r.expert_bias.detach().clone() for r in routers]

    g = torch.Generator().manual_seed(0)
    B, T = 3, 12
    input_ids = torch.randint(0, 256, (B, T), generator=g).to(device)
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
    valid[0, 3:] = False  # a long padded tail: enough pad tokens to change the counts' signs
    valid[1, 5:] = False
    targets = torch.where(valid, torch.roll(input_ids, -1, 1), torch.full_like(input_ids, -1))
    mb = {"input_ids": input_ids, "targets": targets, "padding_mask": ~valid}
    probe = DispatchProbe(learner.module)
    with probe.capture() as cap:
        learner.train_step(
            [mb],
            lambda logp, ent, t: (-(logp * valid).sum() / valid.sum(), {}),
            1.0,
            make_logprob_fn(False, with_entropy=False),
        )
    maps = cap.maps(0)  # [B, T, L, E] experts dispatched
    probe.close()
    discriminating = 0
    for layer, (router, old) in enumerate(zip(routers, before)):
        valid_counts = maps[..., layer, :][valid.cpu()].sum(0)
        all_counts = maps[..., layer, :].reshape(-1, maps.shape[-1]).sum(0)
        moved = router.expert_bias.detach().cpu() - old.cpu()
        assert moved.abs().sum() > 0, f"layer {layer}: the expert bias did not move"
        torch.testing.assert_close(
            moved, _expected_update(valid_counts), msg=f"layer {layer}: not the valid-token rule"
        )
        if not torch.equal(_expected_update(valid_counts), _expected_update(all_counts)):
            discriminating += 1
            assert not torch.allclose(moved, _expected_update(all_counts)), f"layer {layer}: pads were counted"
        assert int(router.local_tokens_per_expert.sum()) == 0, "token counts must be reset after the update"
    assert discriminating, "the padding should change some expert's direction, or this test cannot see pads counted"
