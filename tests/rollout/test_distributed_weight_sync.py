"""``rollout.weight_sync: distributed`` against the session's real SGLang CPU server over a real gloo group.

Oracle: the disk sync path (SGLang's own checkpoint loader) of the same weights serves the same tokens,
log-probs and routes. A bucket the server refuses midway leaves it half-updated: marked invalid until a
full sync. The group is torn down afterwards (no thread, the rendezvous port free). The admin key on the
group endpoints is tested against the keyed server in test_trustworthy_server.py.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.sync.checks import ServerInvalidError, reference_from_hf_dir
from moe_rl.sync.group import GROUP_PREFIX, WeightGroup, port_is_free
from moe_rl.sync.transport import WeightSyncError, server_weight_version, update_weights_from_disk
from moe_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.sglang

SAMPLING = SamplingSettings(temperature=0.8, top_p=0.9, top_k=16, max_new_tokens=8)
PROMPTS = [[5, 17, 99, 250, 7, 31], [400, 12, 3, 88, 91, 64, 23, 9]]


def _generate(url, spec):
    client = RolloutClient([url], spec, 512, SAMPLING, max_concurrency=1)  # one at a time: fp32 bit-exact
    return client.generate(PROMPTS, n=1, step=3)


def _assert_same_outputs(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.response_ids, w.response_ids)
        assert g.rollout_logp.tobytes() == w.rollout_logp.tobytes(), "log-probs differ"
        np.testing.assert_array_equal(g.routes, w.routes)


def _group_threads():
    return [t.name for t in threading.enumerate() if GROUP_PREFIX in t.name]


@pytest.fixture(scope="module")
def disk_v2(sglang_server, route_spec, model_dir, model_dir_v2):
    """What the server serves after a disk sync to v2 (and that it differs from v1); v1 restored after."""
    url = sglang_server.url
    update_weights_from_disk([url], model_dir, "v1")
    v1 = _generate(url, route_spec)
    update_weights_from_disk([url], model_dir_v2, "disk-v2")
    try:
        v2 = _generate(url, route_spec)
    finally:
        update_weights_from_disk([url], model_dir, "v1")
    assert any(a.rollout_logp.tobytes() != b.rollout_logp.tobytes() for a, b in zip(v1, v2)), "v1 == v2?"
    return v2


@pytest.fixture
def sync(rollout_model_cfg, model_dir):
    """Distributed sync in 64 KiB buckets (13 requests for the tiny model); its group closed after the test."""
    ws = WeightSync(
        "distributed",
        rollout_model_cfg,
        bucket_bytes=64 << 10,
        reference=reference_from_hf_dir(model_dir),
        timeout_s=120,
        group_options={"backend": "gloo"},
    )
    yield ws
    ws.close()


def test_distributed_sync_serves_what_disk_sync_serves_and_tears_down(
    sglang_server, route_spec, model_dir, model_dir_v2, disk_v2, sync
):
    url = sglang_server.url
    state = read_hf_state_dict(model_dir_v2)
    try:
        sync.push(state, [url], "dist-v2")
        assert server_weight_version(url) == "dist-v2"
        after = _generate(url, route_spec)
        port, name = sync.group.store.port, sync.group.group_name
        sync.push(state, [url], "dist-v2b")  # the same group again: no second rendezvous
        assert server_weight_version(url) == "dist-v2b"
    finally:
        sync.close()
        update_weights_from_disk([url], model_dir, "v1")
    assert all(s.weight_version == "dist-v2" for s in after)
    _assert_same_outputs(after, disk_v2)
    assert sync.group is None and not _group_threads(), "the group left a thread behind"
    assert port_is_free(port), f"the rendezvous port {port} is still bound after close()"
    gone = httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": name}, timeout=60)
    assert gone.status_code == 400 and "does not exist" in gone.text, "the server kept its side of the group"


def test_bucket_refused_midway_marks_the_server_invalid_until_a_full_resync(
    sglang_server, route_spec, model_dir, model_dir_v2, disk_v2, sync, monkeypatch
):
    """The 2nd bucket's first tensor loses a row after the checks: the server receives it and refuses to load
    it, having loaded bucket 1 (SGLang: 'partially updated')."""
    url = sglang_server.url
    real_bucket, seen = WeightGroup._bucket, []

    def short_second_bucket(self, group, body):
        seen.append(body["names"])
        if len(seen) == 2:
            (name, tensor), rest = group[0], group[1:]
            group = [(name, tensor[:-1])] + rest
            body = dict(body, shapes=[list(tensor[:-1].shape)] + body["shapes"][1:])
        return real_bucket(self, group, body)

    state = read_hf_state_dict(model_dir_v2)
    monkeypatch.setattr(WeightGroup, "_bucket", short_second_bucket)
    try:
        with pytest.raises(WeightSyncError, match="half-updated and marked invalid.*refused bucket 2 "):
            sync.push(state, [url], "v3")
        assert server_weight_version(url) == "v3.partial", "a half-updated server must not pass for any version"
        with pytest.raises(ServerInvalidError, match="refusing rollouts from"):
            sync.check_servable([url])
        assert sync.group.group is None, "a group that saw a failure must be closed"
        monkeypatch.setattr(WeightGroup, "_bucket", real_bucket)
        sync.push(state, [url], "v3")  # the full re-sync, through a new group
        sync.check_servable([url])
        after = _generate(url, route_spec)
    finally:
        sync.close()
        update_weights_from_disk([url], model_dir, "v1")
    assert all(s.weight_version == "v3" for s in after)
    _assert_same_outputs(after, disk_v2)
    assert not _group_threads()
