"""The shared kernels of the DeepSeek-V3-style layout (``rollout.true_on_policy`` on a ``Glm4MoeForCausalLM``).

``router_route`` routes as Megatron-Core's ``topk_routing_with_score_function`` (sigmoid scores + expert bias +
group-limited top-k + normalised, scaled weights; softmax before top-k) and is row-invariant; its weights do not
depend on the slot order a routing replay gives the experts in; ``linear_bias`` adds the bias in fp32 before the
one rounding. The learner's exact routers call it (and stock Megatron routes the same experts), and the
exact learner stays row-invariant on the tiny GLM-4.5 model.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe import router as megatron_router
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from moe_rl.exact import kernels as K
from moe_rl.learner.model import build_model, forward_logits, moe_routers
from tests.learner.conftest import make_cfg

SIGMOID = {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "scaling_factor": 2.5}
GLM4 = {
    "hf_architecture": "Glm4MoeForCausalLM",
    "num_layers": 3,
    "first_k_dense_layers": 1,
    "num_moe_experts": 16,
    "moe_router_topk": 4,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_num_groups": 4,
    "moe_router_group_topk": 2,
    "moe_router_topk_scaling_factor": 2.5,
    "moe_shared_expert_intermediate_size": 32,
    "add_qkv_bias": True,
    "rotary_percent": 0.5,
    "qk_layernorm": False,
    "init_method_std": 0.1,
}


def _logits(device, m=45, e=16, seed=0):
    return torch.randn(m, e, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize(
    "kind", [dict(SIGMOID), {"score_function": "softmax", "pre_softmax": True}, {"score_function": "softmax"}]
)
def test_router_route_is_megatron_routing_and_row_invariant(kind, device):
    logits = _logits(device)
    bias = torch.linspace(-0.2, 0.2, 16).to(device) if kind["score_function"] == "sigmoid" else None
    w, ids = K.router_route(logits, 4, expert_bias=bias, **kind)
    one = [K.router_route(logits[i : i + 1], 4, expert_bias=bias, **kind) for i in range(45)]
    assert torch.equal(w, torch.cat([a for a, _ in one])) and torch.equal(ids, torch.cat([b for _, b in one]))
    probs, routing_map = topk_routing_with_score_function(
        logits.double(),
        4,
        use_pre_softmax=kind.get("pre_softmax", False),
        num_groups=kind.get("num_groups"),
        group_topk=kind.get("group_topk"),
        scaling_factor=kind.get("scaling_factor"),
        score_function=kind["score_function"],
        expert_bias=None if bias is None else bias.double(),
    )
    mine = torch.zeros_like(probs).scatter(1, ids, w.double())
    assert torch.equal(routing_map, mine != 0)  # the same experts as Megatron's own routing (float64 reference)
    torch.testing.assert_close(mine, probs, rtol=1e-6, atol=1e-7)


def test_grouped_topk_only_picks_from_the_best_groups(device):
    scores = torch.zeros(1, 16, device=device)
    scores[0, [0, 1, 4, 8, 9]] = torch.tensor([5.0, 4.0, 9.0, 3.0, 3.0], device=device)
    # group sums of the top 2: g0 = 9, g1 = 9 (9 + 0), g2 = 6, g3 = 0 -> groups 0 and 1
    _, ids = K.grouped_topk(scores, 4, num_groups=4, group_topk=2)
    assert set(ids[0].tolist()) <= set(range(8)) and {0, 1, 4} <= set(ids[0].tolist())


def test_sigmoid_weights_do_not_depend_on_the_replayed_slot_order(device):
    logits = _logits(device, m=20)
    w, ids = K.router_route(logits, 4, **SIGMOID)
    perm = torch.tensor([2, 0, 3, 1], device=device)
    w2, ids2 = K.router_route(logits, 4, select=lambda _choice: (None, ids[:, perm]), **SIGMOID)
    assert torch.equal(ids2, ids[:, perm]) and torch.equal(w2, w[:, perm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bias_adds_in_fp32_and_rounds_once(dtype, device):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(33, 64, generator=g).to(dtype), torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    y = K.linear_bias(x.to(device), w.to(device), b.to(device))
    assert y.dtype == dtype
    assert torch.equal(y, (K.linear(x, w, torch.float32) + b.float()).to(dtype).to(device))
    assert torch.equal(y, torch.cat([K.linear_bias(x[i : i + 1], w, b) for i in range(33)]).to(device))
    assert torch.equal(K.linear_bias(x, w, None), K.linear(x, w))


def test_exact_glm4_learner_routes_through_the_kernel_and_is_row_invariant(megatron_world, monkeypatch):
    """The tiny GLM-4.5 model (sigmoid + bias + groups + scaling, shared expert, q/k/v bias, partial RoPE) built
    exact: every router's ``routing`` calls ``kernels.router_route`` (Megatron's function is the stock one outside
    it), and a sequence's logits and routes alone equal those of its row in a padded batch."""
    cfg = make_cfg(**GLM4)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"true_on_policy": True})})
    model = build_model(cfg, seed=5).eval()
    routers = moe_routers(model)
    for r in routers:
        r.expert_bias.copy_(torch.linspace(-0.05, 0.05, 16))
    calls = []
    real = K.router_route

    def spy(*args, **kwargs):
        calls.append(kwargs.get("score_function", args[2] if len(args) > 2 else None))
        return real(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1, 19), generator=g)
    others = torch.randint(0, 256, (3, 30), generator=g)
    batch = torch.cat([torch.cat([a, others[:1, 19:]], 1), others[1:]])
    maps = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: maps.append(out[1].clone())) for r in routers]
    monkeypatch.setattr(K, "router_route", spy)  # exact_spec calls it as K.router_route
    try:
        with torch.no_grad():
            alone = forward_logits(model, a)
            batched = forward_logits(model, batch)
    finally:
        for h in hooks:
            h.remove()
    assert calls and set(calls) == {"sigmoid"}
    assert megatron_router.topk_routing_with_score_function is not topk_routing_with_score_function
    assert torch.equal(alone[0], batched[0, :19])
    for ra, rb in zip(maps[:2], maps[2:]):
        assert torch.equal(ra.view(19, 1, -1)[:, 0], rb.view(30, 3, -1)[:19, 0])
