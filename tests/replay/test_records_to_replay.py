"""End to end through the records contract: routes and kept sets written to a real records file,
loaded, packed and replayed (R3) into a real Megatron-Core model."""

import numpy as np
import torch

from moe_rl.records.batch import RolloutBatch, RolloutSample
from moe_rl.replay import (
    KeptSets,
    MicrobatchRoutes,
    ReplayDriver,
    RoutingReplay,
    keep_mask_logprobs,
    pack_microbatch_routes,
)
from tests.replay.conftest import forward
from tests.replay.routing_probe import RoutingMapProbe, expected_map

E, K, L = 8, 2, 3


def _rollout(model, replay, prompt_lens, response_lens, seed):
    """Stand-in engine = the same model: per sample, routes of tokens[:-1] and top-3 kept sets."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for P, R in zip(prompt_lens, response_lens):
        tokens = torch.randint(0, 128, (P + R,), generator=g)
        with replay.record() as rec, torch.no_grad():
            logits = forward(model, tokens[None, :-1])[0]  # [P+R-1, V]: position t predicts token t+1
        resp_logits = logits[P - 1 :]  # [R, V], predicts the response tokens
        kept = [np.sort(resp_logits[t].topk(3).indices.cpu().numpy()).astype(np.int32) for t in range(R)]
        kept = [np.union1d(k, [int(tokens[P + t])]).astype(np.int32) for t, k in enumerate(kept)]
        samples.append(
            RolloutSample(
                prompt_ids=tokens[:P].numpy().astype(np.int32),
                response_ids=tokens[P:].numpy().astype(np.int32),
                rollout_logp=np.zeros(R, np.float32),
                routes=rec.recorded(0)[0].cpu().numpy(),
                sampling_mask=kept,
            )
        )
    return RolloutBatch.from_samples(samples, num_experts=E)


def test_records_file_routes_replay_exactly_and_kept_sets_renormalise(build, tmp_path):
    model = build(seed=11)
    replay = RoutingReplay(model)
    P, R = [4, 6, 3], [5, 2, 7]
    batch = _rollout(model, replay, P, R, seed=0)
    assert batch.routes.dtype == np.uint8 and batch.routes.shape == (sum(P) + sum(R) - 3, L, K)
    loaded = RolloutBatch.load(batch.save(tmp_path / "step0.safetensors"))

    samples = loaded.samples()
    S = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    routes = pack_microbatch_routes([s.routes for s in samples], seq_len=S, num_experts=E)
    ids = torch.zeros(3, S, dtype=torch.long)
    valid = torch.zeros(3, S, dtype=torch.bool)
    for b, s in enumerate(samples):
        tokens = np.concatenate([s.prompt_ids, s.response_ids])[:-1]  # the learner's input: tokens[:-1]
        ids[b, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
        valid[b, : len(tokens)] = True
    probe = RoutingMapProbe(model)
    replay.close()  # the driver binds its own
    driver = ReplayDriver(model, "r3")
    with driver.update_pass([MicrobatchRoutes(sample_ids=[0, 1, 2], valid=valid, rollout=routes)]):
        logits = forward(model, ids)
        logits.float().pow(2).mean().backward()
    for layer in range(L):  # host-packed routes and host ids went in; the probe saw them on the model's device
        assert torch.equal(probe.maps[layer][0].cpu(), expected_map(routes, layer, E))
    m = driver.step_metrics()
    assert m["replay/rollout_vs_dispatched/response/flip_rate"] == 0.0
    # same weights and tokens as the "engine": natural routes agree except for float near-ties
    assert m["replay/rollout_vs_natural/response/flip_rate"] < 0.05

    # Keep Sampling Mask on the response positions, kept sets straight from the loaded file
    roffs = np.concatenate([[0], np.cumsum(loaded.response_lens)])
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        resp_logits = logits[b, p - 1 : p - 1 + r].detach()
        y = torch.from_numpy(s.response_ids.astype(np.int64)).to(resp_logits.device)
        sets = KeptSets.from_numpy(loaded.mask_ids, loaded.mask_offsets[roffs[b] : roffs[b + 1] + 1])
        out = keep_mask_logprobs(resp_logits, y, sets)
        full = torch.log_softmax(resp_logits.float(), -1).gather(1, y[:, None])[:, 0]
        assert out.num_outside == 0
        assert (out.logp >= full - 1e-6).all() and (out.logp <= 0).all()
        # renormalising over a set: p_kept(y) = p(y) / sum_{k in set} p(k)
        mass = torch.stack(
            [
                torch.softmax(resp_logits[t].float(), -1)[torch.from_numpy(m.astype(np.int64))].sum()
                for t, m in enumerate(s.sampling_mask)
            ]
        )
        torch.testing.assert_close(out.logp, full - mass.log(), rtol=0, atol=1e-5)
