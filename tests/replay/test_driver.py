"""R2 / R3 / natural routing policies over a learner step on a real Megatron-Core model, and the
honest flip metric (rollout routes vs what Megatron's dispatcher received)."""

import pytest
import torch

from moe_rl.replay.binding import RoutingReplay
from moe_rl.replay.driver import MicrobatchRoutes, ReplayDriver
from tests.replay.conftest import forward
from tests.replay.routing_probe import RoutingMapProbe, expected_map, random_routes

E, K, L = 8, 2, 3


def _batch(n, S, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, S), generator=g).to(device)
    valid = torch.ones(n, S, dtype=torch.bool)
    valid[0, S - 3 :] = False  # one padded sample
    return ids, valid


def _natural_routes(model, ids):
    replay = RoutingReplay(model)
    with replay.record() as rec, torch.no_grad():
        forward(model, ids)
    replay.close()
    return rec.recorded(0).cpu()


def test_r2_record_then_replay_across_four_minibatches_while_weights_change(build, device):
    model = build(seed=3)
    ids, valid = _batch(8, 10, 0, device)
    recorded = _natural_routes(model, ids)  # what the old-log-prob pass will record
    driver = ReplayDriver(model, "r2", "decoupled")
    old_mbs = [MicrobatchRoutes(sample_ids=range(4 * m, 4 * m + 4), valid=valid[4 * m : 4 * m + 4]) for m in range(2)]
    with driver.old_logprob_pass(old_mbs), torch.no_grad():
        for m in range(2):
            forward(model, ids[4 * m : 4 * m + 4])
    opt = torch.optim.SGD(model.parameters(), lr=3.0)
    order = [[7, 2], [0, 5], [3, 6], [1, 4]]  # minibatches regroup the samples
    probe = RoutingMapProbe(model)
    flip_rates = []
    for step, sids in enumerate(order):
        mb = MicrobatchRoutes(sample_ids=sids, valid=valid[sids])
        with driver.update_pass([mb]):
            forward(model, ids[sids]).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for layer in range(L):
            got, want = probe.maps[layer][step], expected_map(recorded[sids], layer, E)
            rows = valid[sids].t().reshape(-1)  # padded rows of the record were re-padded; compare real ones
            assert torch.equal(got.cpu()[rows.cpu()], want.cpu()[rows.cpu()]), f"minibatch {step} layer {layer}"
        m = driver.step_metrics()
        assert m["replay/r2_vs_dispatched/response/flip_rate"] == 0.0
        flip_rates.append(m["replay/r2_vs_natural/response/flip_rate"])
    assert flip_rates[-1] > 0, "weights changed, so the current policy's natural routes must drift from R2's record"


def test_r3_dispatched_flip_rate_is_zero_and_natural_is_reported_per_position_class(build, device):
    model = build(seed=4)
    driver = ReplayDriver(model, "r3")
    ids, valid = _batch(4, 8, 1, device)
    rollout = random_routes(4, 8, L, K, E, seed=9)
    response = torch.zeros(4, 8, dtype=torch.bool)
    response[:, 3:] = True
    mbs = [
        MicrobatchRoutes([0, 1], valid[:2], rollout[:2], response[:2]),
        MicrobatchRoutes([2, 3], valid[2:], rollout[2:], response[2:]),
    ]
    probe = RoutingMapProbe(model)
    with driver.old_logprob_pass(mbs), torch.no_grad():
        forward(model, ids[:2])
        forward(model, ids[2:])
    with driver.update_pass(mbs):
        for m in range(2):
            forward(model, ids[2 * m : 2 * m + 2]).float().pow(2).mean().backward()
    for call in range(4):
        for layer in range(L):
            assert torch.equal(
                probe.maps[layer][call], expected_map(rollout[2 * (call % 2) : 2 * (call % 2) + 2], layer, E)
            )
    m = driver.step_metrics()
    for part in ("response", "prompt"):
        assert m[f"replay/rollout_vs_dispatched/{part}/flip_rate"] == 0.0
        assert m[f"replay/rollout_vs_dispatched/{part}/tokens_with_flip"] == 0.0
        # random rollout routes agree with a natural top-2 of 8 experts on ~1/28 of token-layers
        assert m[f"replay/rollout_vs_natural/{part}/flip_rate"] > 0.5
    assert {f"replay/rollout_vs_natural/response/flip_rate/layer{layer}" for layer in range(L)} <= set(m)


def test_a_router_left_out_of_the_binding_shows_in_the_dispatched_flip_rate(build, device):
    """Replay deliberately broken: layer 1's router is detached from the binding, so it routes
    naturally. A metric comparing the given routes with themselves would still say 0."""
    model = build(seed=6)
    driver = ReplayDriver(model, "r3")
    ids, valid = _batch(2, 8, 3, device)
    rollout = random_routes(2, 8, L, K, E, seed=2)
    replay = driver.replay  # leave layer 1's router out of the binding: it keeps routing naturally
    replay.layers.pop(1).reset()
    replay.moe_layer_ids.pop(1)
    replay._routers.pop(1)
    with driver.update_pass([MicrobatchRoutes([0, 1], valid, rollout)]):
        forward(model, ids).float().pow(2).mean().backward()
    m = driver.step_metrics()
    assert m["replay/rollout_vs_dispatched/response/flip_rate/layer1"] > 0.5
    assert m["replay/rollout_vs_dispatched/response/flip_rate/layer0"] == 0.0


def test_natural_mode_binds_no_replay_and_counts_exactly_the_perturbed_token_layers(build, device):
    model = build(seed=5)
    ids, valid = _batch(2, 6, 2, device)
    rollout = _natural_routes(model, ids).clone()
    rollout[1, 2, 1] = torch.tensor([e for e in range(E) if e not in rollout[1, 2, 1].tolist()][:K])
    rollout[0, 5, 0] = (rollout[0, 5, 0] + 1) % E  # a padded position: must not count
    driver = ReplayDriver(model, "none")
    assert driver.replay is None
    with driver.update_pass([MicrobatchRoutes(sample_ids=[0, 1], valid=valid, rollout=rollout)]), torch.no_grad():
        forward(model, ids)
    m = driver.step_metrics()
    n_valid = int(valid.sum())  # 9 tokens x 3 layers
    for name in ("rollout_vs_natural", "rollout_vs_dispatched"):
        assert m[f"replay/{name}/response/flip_rate"] == pytest.approx(1 / (n_valid * L))
        assert m[f"replay/{name}/response/tokens_with_flip"] == pytest.approx(1 / n_valid)
        assert m[f"replay/{name}/response/flip_rate/layer1"] == pytest.approx(1 / n_valid)
        assert m[f"replay/{name}/response/flip_rate/layer0"] == 0.0


def test_natural_mode_allows_router_options_replay_cannot_honour(build):
    model = build(seed=7, moe_expert_capacity_factor=2.0)
    with pytest.raises(ValueError, match="capacity"):
        ReplayDriver(model, "r3")
    ReplayDriver(build(seed=7, moe_expert_capacity_factor=2.0), "none").close()


def test_r2_in_bypass_mode_and_r3_without_routes_raise(build):
    model = build()
    with pytest.raises(ValueError, match="correction.mode='decoupled'"):
        ReplayDriver(model, "r2", "bypass")
    driver = ReplayDriver(model, "r3")
    with (
        pytest.raises(ValueError, match="--enable-return-routed-experts"),
        driver.old_logprob_pass([MicrobatchRoutes(sample_ids=[0], valid=torch.ones(1, 4, dtype=torch.bool))]),
    ):
        pass
