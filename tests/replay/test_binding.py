"""RoutingReplay on real Megatron-Core models (CPU, gloo world 1): routes given == routes dispatched."""

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from moe_rl.learner.model import attention_mask
from moe_rl.replay.binding import ReplayError, RoutingReplay
from moe_rl.replay.layout import pack_microbatch_routes
from tests.conftest import session_device
from tests.replay.conftest import forward
from tests.replay.routing_probe import RoutingMapProbe, expected_map, random_routes

E, K = 8, 2


def _ids(B, S, seed):
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(seed)).to(session_device())


def test_replayed_routes_reach_the_dispatcher_per_layer_per_token_across_padded_microbatches(build):
    model = build(moe_layer_freq=[1, 0, 1])  # decoder layer 1 is dense
    replay = RoutingReplay(model)
    assert replay.moe_layer_ids == [0, 1] and replay.num_moe_layers == 2
    S = 12
    lengths = [[12, 7], [5, 9], [3, 12]]
    mbs = []
    for m, lens in enumerate(lengths):
        samples = [
            random_routes(1, n, 2, K, E, seed=10 * m + i)[0].cpu().numpy().astype(np.uint8)  # as records hold them
            for i, n in enumerate(lens)
        ]
        mbs.append(pack_microbatch_routes(samples, seq_len=S, num_experts=E, first_sample=2 * m))
    probe = RoutingMapProbe(model)
    assert sorted(probe.maps) == [0, 2], "the dense layer must have no router"
    with replay.replay(mbs):
        for m in range(3):
            forward(model, _ids(2, S, m)).float().pow(2).mean().backward()
    for moe_l, dec_l in enumerate([0, 2]):
        got = probe.maps[dec_l]
        assert len(got) == 3
        for m in range(3):
            want = expected_map(mbs[m], moe_l, E)
            assert torch.equal(got[m].cpu(), want.cpu()), f"layer {dec_l} microbatch {m} dispatched other experts"


ROUTER_VARIANTS = {
    "softmax_after_topk": {},
    "pre_softmax": {"moe_router_pre_softmax": True},
    "sigmoid_expert_bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    "group_limited_topk": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
}


@pytest.mark.parametrize("variant", list(ROUTER_VARIANTS))
def test_replay_overrides_natural_routing(build, variant):
    model = build(**ROUTER_VARIANTS[variant])
    replay = RoutingReplay(model)
    ids = _ids(2, 10, 0)
    with replay.record() as rec, torch.no_grad():
        forward(model, ids)
    natural = rec.recorded(0)
    forced = random_routes(2, 10, 3, K, E, seed=1)
    probe = RoutingMapProbe(model)
    with replay.replay([forced]) as cap, torch.no_grad():
        forward(model, ids)
    for layer in range(3):
        assert torch.equal(probe.maps[layer][0], expected_map(forced, layer, E))
    # layer 0 sees the same input in both passes, so its observed natural top-k is the recorded one;
    # deeper layers' natural choice is conditioned on the replayed routes upstream
    assert torch.equal(cap.natural(0)[:, :, 0].sort(-1).values, natural[:, :, 0].sort(-1).values)
    assert torch.equal(cap.applied(0), forced)
    assert not torch.equal(natural.sort(-1).values, forced.sort(-1).values)


def test_record_equals_dispatched_routing_map(build):
    model = build()
    replay = RoutingReplay(model)
    probe = RoutingMapProbe(model)
    with replay.record() as rec, torch.no_grad():
        forward(model, _ids(3, 9, 0))
        forward(model, _ids(2, 5, 1))
    assert rec.num_forwards == 2 and rec.recorded(1).shape == (2, 5, 3, K)
    for layer in range(3):
        assert torch.equal(probe.maps[layer][0], expected_map(rec.recorded(0), layer, E))
        assert torch.equal(probe.maps[layer][1], expected_map(rec.recorded(1), layer, E))


def test_r3_replay_survives_full_recompute(build):
    model = build(train={"recompute": "full"})
    assert model.config.recompute_granularity == "full"
    model.train()
    replay = RoutingReplay(model)
    routes = [random_routes(2, 8, 3, K, E, seed=s) for s in range(2)]
    probe = RoutingMapProbe(model)
    with replay.replay(routes):
        for m in range(2):
            forward(model, _ids(2, 8, m)).float().pow(2).mean().backward()
    for layer in range(3):
        # forward + recompute-in-backward per microbatch, all dispatching the given routes
        assert len(probe.maps[layer]) == 4
        for call, m in zip(probe.maps[layer], [0, 0, 1, 1]):
            assert torch.equal(call, expected_map(routes[m], layer, E))
    assert all(not layer.replay_backward_list for layer in replay.layers), "backward FIFO must be drained"


@pytest.mark.parametrize(
    "recompute, recomputed_layers",
    [
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, [0]),
        ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, [0, 1, 2]),
    ],
    ids=["full_block_first_layer", "selective_moe"],
)
def test_partial_and_selective_recompute_replay_the_given_routes(compose, recompute, recomputed_layers):
    model = compose(**recompute)
    model.train()
    replay = RoutingReplay(model)
    routes = random_routes(2, 6, 3, K, E, seed=1)
    probe = RoutingMapProbe(model)
    with replay.replay([routes]):
        forward(model, _ids(2, 6, 0)).float().pow(2).mean().backward()
    for layer in range(3):
        calls = probe.maps[layer]
        assert len(calls) == (2 if layer in recomputed_layers else 1), f"layer {layer}: {len(calls)} router calls"
        for call in calls:
            assert torch.equal(call, expected_map(routes, layer, E))


def test_recompute_without_backward_in_context_raises(build):
    model = build(train={"recompute": "full"})
    model.train()
    replay = RoutingReplay(model)
    with pytest.raises(ReplayError, match="recompute route set"), replay.replay([random_routes(1, 4, 3, K, E, seed=0)]):
        forward(model, _ids(1, 4, 0))


def test_router_weights_receive_gradients_under_replay(build):
    model = build()
    replay = RoutingReplay(model)
    with replay.replay([random_routes(2, 6, 3, K, E, seed=0)]):
        forward(model, _ids(2, 6, 0)).float().pow(2).mean().backward()
    for router in replay._routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_two_models_in_one_process_keep_their_own_routes(build):
    a, b = build(seed=0), build(seed=1)
    ra, rb = RoutingReplay(a), RoutingReplay(b)
    c = build(seed=2)  # built after binding: must not shift a's or b's layers
    for layer in ra.layers + rb.layers:
        assert all(inst is not layer for inst in RouterReplay.global_router_replay_instances)
    routes_a, routes_b = random_routes(1, 5, 3, K, E, seed=3), random_routes(1, 5, 3, K, E, seed=4)
    pa, pb = RoutingMapProbe(a), RoutingMapProbe(b)
    with ra.replay([routes_a]), rb.replay([routes_b]), torch.no_grad():
        forward(a, _ids(1, 5, 0))
        forward(b, _ids(1, 5, 0))
        forward(c, _ids(1, 5, 0))  # an unbound model routes naturally
    for layer in range(3):
        assert torch.equal(pa.maps[layer][0], expected_map(routes_a, layer, E))
        assert torch.equal(pb.maps[layer][0], expected_map(routes_b, layer, E))


def test_unconsumed_route_raises(build):
    model = build()
    replay = RoutingReplay(model)
    with (
        pytest.raises(ReplayError, match="2 microbatch route set\\(s\\) given but 1 consumed"),
        replay.replay([random_routes(1, 4, 3, K, E, seed=s) for s in range(2)]),
        torch.no_grad(),
    ):
        forward(model, _ids(1, 4, 0))
    # state does not leak into the next context
    with replay.replay([random_routes(1, 4, 3, K, E, seed=5)]), torch.no_grad():
        forward(model, _ids(1, 4, 0))


def test_forward_beyond_given_routes_raises(build):
    model = build()
    replay = RoutingReplay(model)
    with (
        pytest.raises(ReplayError, match="forward #2 needs routes but only 1"),
        replay.replay([random_routes(1, 4, 3, K, E, seed=0)]),
        torch.no_grad(),
    ):
        forward(model, _ids(1, 4, 0))
        forward(model, _ids(1, 4, 1))


def test_routes_for_other_sequence_length_raise_with_shapes(build):
    model = build()
    replay = RoutingReplay(model)
    with (
        pytest.raises(ReplayError, match=r"routes have shape \(10, 2\), the router sees \[S\*B=8"),
        replay.replay([random_routes(2, 5, 3, K, E, seed=0)]),
        torch.no_grad(),
    ):
        forward(model, _ids(2, 4, 0))


def test_routes_with_wrong_layer_count_raise(build):
    replay = RoutingReplay(build())
    with (
        pytest.raises(ValueError, match=r"L_moe=3, K=2\]; got shape \(1, 4, 2, 2\)"),
        replay.replay([random_routes(1, 4, 2, K, E, seed=0)]),
    ):
        pass


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"moe_router_fusion": True}, "moe_router_fusion=True"),
        ({"moe_router_load_balancing_type": "sinkhorn", "moe_router_topk": 1}, "sinkhorn"),
        ({"moe_expert_capacity_factor": 1.0}, "capacity dropping"),
    ],
)
def test_router_paths_that_bypass_replay_raise(build, overrides, needle):
    model = build(**overrides)
    with pytest.raises(ValueError, match=needle):
        RoutingReplay(model)


def test_mtp_router_gets_no_routes_and_routes_naturally(compose):
    model = compose(mtp=True)
    replay = RoutingReplay(model)
    assert len(replay.layers) == 3, "only the decoder's MoE layers take routes"
    mtp_router = model.mtp.layers[0].transformer_layer.mlp.router
    assert all(inst is not mtp_router.router_replay for inst in RouterReplay.global_router_replay_instances)
    seen = {}
    hook = mtp_router.register_forward_hook(lambda mod, args, out: seen.update(h=args[0].detach(), map=out[1]))
    routes = random_routes(2, 6, 3, K, E, seed=0)
    probe = RoutingMapProbe(model)
    ids = _ids(2, 6, 0)
    with replay.replay([routes]):
        pos = torch.arange(6, device=ids.device).expand(2, 6)
        loss = model(input_ids=ids, position_ids=pos, attention_mask=attention_mask(ids), labels=ids)
        loss.float().mean().backward()
    hook.remove()
    for layer in range(3):
        assert torch.equal(probe.maps[layer][0], expected_map(routes, layer, E))
    # the MTP router's choice is its own natural top-k of hidden @ W^T (softmax after top-k)
    logits = seen["h"].reshape(-1, seen["h"].shape[-1]).float() @ mtp_router.weight.float().T
    natural = torch.zeros_like(seen["map"]).scatter(1, logits.topk(K, dim=-1).indices, True)
    assert torch.equal(seen["map"], natural)


def test_binding_a_bound_model_twice_raises_until_closed(build):
    model = build()
    first = RoutingReplay(model)
    with pytest.raises(RuntimeError, match="already bound"):
        RoutingReplay(model)
    first.close()
    with pytest.raises(RuntimeError, match="closed"), first.record():
        pass
    second = RoutingReplay(model)
    routes = random_routes(1, 4, 3, K, E, seed=0)
    probe = RoutingMapProbe(model)
    with second.replay([routes]), torch.no_grad():
        forward(model, _ids(1, 4, 0))
    assert torch.equal(probe.maps[0][0], expected_map(routes, 0, E))


def test_float_routes_are_refused(build):
    replay = RoutingReplay(build())
    with (
        pytest.raises(ValueError, match="must hold integer expert ids; got dtype torch.float32"),
        replay.replay([random_routes(1, 4, 3, K, E, seed=0).float()]),
    ):
        pass
