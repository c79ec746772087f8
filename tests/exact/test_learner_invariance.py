"""The true-on-policy learner: a sequence's logits and routes do not depend on its batch.

Padding, batch size and packing change what Megatron computes around a row; with
``rollout.true_on_policy`` (the ``moe_rl.exact`` spec) the row's logits, log-probs and top-k must stay
bit for bit the same. The same model without the mode differs (the check can fail).
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.learner.logprobs import logprobs_from_logits, uses_exact
from moe_rl.learner.model import build_model, forward_logits, moe_routers
from tests.learner.conftest import make_cfg


def _cfg(exact: bool):
    cfg = make_cfg(init_method_std=0.1)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"true_on_policy": exact})})


def _routes(model, ids):
    maps, hooks = [], []
    for router in moe_routers(model):
        hooks.append(router.register_forward_hook(lambda _m, _i, out: maps.append(out[1].clone())))
    with torch.no_grad():
        logits = forward_logits(model, ids)
    for h in hooks:
        h.remove()
    return logits, maps


@pytest.mark.parametrize("exact", [True, False])
def test_row_invariance(exact, megatron_world):
    cfg = _cfg(exact)
    model = build_model(cfg, seed=5).eval()
    assert uses_exact(model) is exact
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1, 23), generator=g)
    others = torch.randint(0, 256, (5, 40), generator=g)
    batch = torch.cat([torch.cat([a, others[:1, 23:]], 1), others[1:]])  # a, right-padded to 40, in a batch of 5

    alone, routes_alone = _routes(model, a)
    batched, routes_batched = _routes(model, batch)
    same_logits = torch.equal(alone[0], batched[0, :23])
    T = 23
    same_routes = all(
        torch.equal(ra.view(T, 1, -1)[:, 0], rb.view(40, 5, -1)[:T, 0]) for ra, rb in zip(routes_alone, routes_batched)
    )
    lp_alone, _ = logprobs_from_logits(alone[:, :-1], a[:, 1:], temperature=0.7, exact=exact)
    lp_batch, _ = logprobs_from_logits(batched[:1, :22], a[:, 1:], temperature=0.7, exact=exact)
    if exact:
        assert same_logits and same_routes and torch.equal(lp_alone, lp_batch)
        # packed: a followed by another sequence in one row; positions restart, a's rows unchanged
        packed = torch.cat([a, others[:1, :17]], 1)
        seg = torch.tensor([[0] * 23 + [1] * 17])
        with torch.no_grad():
            p = forward_logits(model, packed, segment_ids=seg)
            b_alone = forward_logits(model, others[:1, :17])
        assert torch.equal(p[0, :23], alone[0]) and torch.equal(p[0, 23:], b_alone[0])
    else:  # the stock kernels pick their reduction by shape: the same row rounds differently
        assert not same_logits
