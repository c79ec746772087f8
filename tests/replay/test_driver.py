"""R2 / R3 / natural routing policies over a learner step on a real Megatron-Core model."""

import pytest
import torch

from moe_rl.replay.binding import RoutingReplay
from moe_rl.replay.driver import MicrobatchRoutes, ReplayDriver
from tests.conftest import session_device
from tests.replay.conftest import forward
from tests.replay.routing_probe import RoutingMapProbe, expected_map, random_routes

E, K, L = 8, 2, 3


def _batch(n, S, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, S), generator=g).to(session_device())
    valid = torch.ones(n, S, dtype=torch.bool, device=session_device())
    valid[0, S - 3 :] = False  # one padded sample
    return ids, valid


def test_r2_record_then_replay_across_four_minibatches_while_weights_change(build):
    model = build(seed=3)
    driver = ReplayDriver(RoutingReplay(model), "r2", "decoupled")
    ids, valid = _batch(8, 10, 0)
    old_mbs = [MicrobatchRoutes(sample_ids=range(4 * m, 4 * m + 4), valid=valid[4 * m : 4 * m + 4]) for m in range(2)]
    with driver.old_logprob_pass(old_mbs) as rec, torch.no_grad():
        for m in range(2):
            forward(model, ids[4 * m : 4 * m + 4])
    recorded = torch.cat([rec.recorded(0), rec.recorded(1)])  # [8, S, L, K]
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
        for l in range(L):
            assert torch.equal(probe.maps[l][step], expected_map(recorded[sids], l, E)), f"minibatch {step} layer {l}"
        m = driver.step_metrics()
        assert m["replay/r2_vs_applied/flip_rate"] == 0.0
        flip_rates.append(m["replay/r2_vs_natural/flip_rate"])
    assert flip_rates[-1] > 0, "weights changed, so the current policy's natural routes must drift from R2's record"


def test_r3_replayed_flip_rate_is_exactly_zero_and_natural_is_reported(build):
    model = build(seed=4)
    driver = ReplayDriver(RoutingReplay(model), "r3")
    ids, valid = _batch(4, 8, 1)
    rollout = random_routes(4, 8, L, K, E, seed=9)
    mbs = [MicrobatchRoutes(sample_ids=[0, 1], valid=valid[:2], rollout=rollout[:2]),
           MicrobatchRoutes(sample_ids=[2, 3], valid=valid[2:], rollout=rollout[2:])]
    probe = RoutingMapProbe(model)
    with driver.old_logprob_pass(mbs), torch.no_grad():
        forward(model, ids[:2])
        forward(model, ids[2:])
    with driver.update_pass(mbs):
        for m in range(2):
            forward(model, ids[2 * m : 2 * m + 2]).float().pow(2).mean().backward()
    for call in range(4):
        for l in range(L):
            assert torch.equal(probe.maps[l][call], expected_map(rollout[2 * (call % 2) : 2 * (call % 2) + 2], l, E))
    m = driver.step_metrics()
    assert m["replay/rollout_vs_applied/flip_rate"] == 0.0
    assert m["replay/rollout_vs_applied/tokens_with_flip"] == 0.0
    # random rollout routes agree with a natural top-2 of 8 experts on ~1/28 of token-layers
    assert m["replay/rollout_vs_natural/flip_rate"] > 0.5
    assert set(k for k in m if "layer" in k) >= {f"replay/rollout_vs_natural/flip_rate/layer{l}" for l in range(L)}


def test_natural_mode_flip_rate_counts_exactly_the_perturbed_token_layers(build):
    model = build(seed=5)
    replay = RoutingReplay(model)
    ids, valid = _batch(2, 6, 2)
    with replay.record() as rec, torch.no_grad():
        forward(model, ids)
    rollout = rec.recorded(0).clone()
    rollout[1, 2, 1] = torch.tensor([e for e in range(E) if e not in rollout[1, 2, 1].tolist()][:K],
                                    device=rollout.device)
    rollout[0, 5, 0] = (rollout[0, 5, 0] + 1) % E  # a padded position: must not count
    driver = ReplayDriver(replay, "none")
    with driver.update_pass([MicrobatchRoutes(sample_ids=[0, 1], valid=valid, rollout=rollout)]), torch.no_grad():
        forward(model, ids)
    m = driver.step_metrics()
    n_valid = int(valid.sum())  # 9 tokens x 3 layers
    assert m["replay/rollout_vs_natural/flip_rate"] == pytest.approx(1 / (n_valid * L))
    assert m["replay/rollout_vs_natural/tokens_with_flip"] == pytest.approx(1 / n_valid)
    assert m["replay/rollout_vs_natural/flip_rate/layer1"] == pytest.approx(1 / n_valid)
    assert m["replay/rollout_vs_natural/flip_rate/layer0"] == 0.0


def test_r2_in_bypass_mode_and_r3_without_routes_raise(build):
    replay = RoutingReplay(build())
    with pytest.raises(ValueError, match="correction.mode='decoupled'"):
        ReplayDriver(replay, "r2", "bypass")
    driver = ReplayDriver(replay, "r3")
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        with driver.old_logprob_pass([MicrobatchRoutes(sample_ids=[0], valid=torch.ones(1, 4, dtype=torch.bool))]):
            pass
