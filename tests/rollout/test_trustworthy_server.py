"""Issue 16, items 1/2/8 against one real SGLang CPU server started with an API key and an admin key.

In order: the issue's attack (an unauthenticated weight update) is refused and the key is nowhere in the
run directory or the process list; a batch with foreign weight versions is rejected and the trainer's
policy re-syncs and regenerates once; a hung server is detected by the health watchdog in seconds; a
killed server is restarted, re-synced and the batch retried; stopping it removes its /dev/shm files.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file
from safetensors.torch import load_file as load_safetensors

from moe_rl.rollout.auth import ServerKeyError, ServerKeys
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.health import ServerHungError
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_pool import ServerPool
from moe_rl.rollout.server_spec import ServerSpec
from moe_rl.sync import transport
from moe_rl.sync.group import GROUP_PREFIX
from moe_rl.sync.integrity import WeightVersionError, check_weight_versions, generate_checked
from moe_rl.sync.transport import WeightSyncError, server_weight_version, update_weights_from_disk
from moe_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.sglang

API_KEY = "moe-rl-test-api-key-7f3a9c"
ADMIN_KEY = "moe-rl-test-admin-key-51d2e8"
PROMPTS = [[5, 6, 7], [9, 10]]


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    """(pool, keys, run_dir): one keyed server the test 'run' launched (restartable once)."""
    run_dir = tmp_path_factory.mktemp("keyed_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_RL_TEST_API_KEY", API_KEY)
        mp.setenv("MOE_RL_TEST_ADMIN_KEY", ADMIN_KEY)
        spec = ServerSpec(
            model_path=str(model_dir),
            dtype="float32",
            deterministic=True,
            max_total_tokens=4096,
            mem_fraction_static=0.3,
            startup_timeout_s=480,
            api_key_env="MOE_RL_TEST_API_KEY",
            admin_api_key_env="MOE_RL_TEST_ADMIN_KEY",
        )
        keys = ServerKeys.from_env_names("MOE_RL_TEST_API_KEY", "MOE_RL_TEST_ADMIN_KEY")
        pool = ServerPool(servers=[SGLangServer(spec, run_dir / "logs" / "sglang_0.log")], max_restarts=1)
        pool.servers[0].start()
        try:
            update_weights_from_disk(pool.addresses, model_dir, "step-0", keys=keys)
            yield pool, keys, run_dir
        finally:
            pool.servers[0].stop()


def _client(pool, route_spec, keys, **kw) -> RolloutClient:
    return RolloutClient(
        pool.addresses,
        route_spec,
        vocab_size=512,
        sampling=SamplingSettings(max_new_tokens=3),
        return_sampling_mask=False,
        headers=keys.headers(),
        max_retries=1,
        backoff_s=0.2,
        **kw,
    )


def _group_cmdlines(pgid: int) -> str:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append((d / "cmdline").read_bytes().decode(errors="replace"))
            except (OSError, ProcessLookupError):
                continue
    return "\n".join(out)


def test_unauthenticated_weight_update_and_generate_are_refused_and_the_key_stays_secret(
    keyed, model_dir_v2, route_spec
):
    pool, keys, run_dir = keyed
    url = pool.addresses[0]
    attack = {"model_path": str(model_dir_v2), "weight_version": "step-4", "flush_cache": True}
    assert httpx.post(f"{url}/update_weights_from_disk", json=attack, timeout=60).status_code == 401
    api_only = {"Authorization": f"Bearer {API_KEY}"}  # weight updates need the admin key
    assert httpx.post(f"{url}/update_weights_from_disk", json=attack, headers=api_only, timeout=60).status_code == 401
    assert (
        httpx.post(
            f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, timeout=60
        ).status_code
        == 401
    )
    samples = _client(pool, route_spec, keys).generate(PROMPTS, 2)
    assert [s.weight_version for s in samples] == ["step-0"] * 4  # the attack changed nothing

    server = pool.servers[0]
    log = server.log_path.read_text(errors="replace")
    assert "server_args=" in log and "<redacted>" in log
    for secret in (API_KEY, ADMIN_KEY):
        assert secret not in _group_cmdlines(server.process.pid), "a key is on a command line (ps)"
        for path in run_dir.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), f"a key leaked into {path}"
        assert secret not in repr(keys) and secret not in repr(server.spec)


# Every admin endpoint the trainer calls (sync/weight_sync.py: disk path, tensor path; sync/group.py: distributed path);
# the partial-rollout work adds pause_generation / continue_generation here when the trainer starts calling them.
TRAINER_ADMIN_ENDPOINTS = (
    "update_weights_from_disk",
    "begin_weight_update",
    "update_weights_from_tensor",
    "end_weight_update",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "update_weight_version",
)


def test_every_admin_endpoint_the_trainer_calls_refuses_a_call_without_the_admin_key(keyed, model_dir):
    pool, keys, _ = keyed
    url = pool.addresses[0]
    for endpoint in TRAINER_ADMIN_ENDPOINTS:
        for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}):
            assert httpx.post(f"{url}/{endpoint}", json={}, headers=headers, timeout=60).status_code == 401, endpoint
        # the cache flush after a sync (senders.publish posts it with the admin key, outside post_admin)
        assert httpx.post(f"{url}/flush_cache", headers=headers, timeout=60).status_code == 401
    # ... and moe_rl sends the admin key on each of them: record what the weight-sync functions post
    sent = []
    real_post = transport.post_admin

    def recording_post(address, endpoint, body, timeout_s, headers=None):
        sent.append((endpoint, (headers or {}).get("Authorization")))
        return real_post(address, endpoint, body, timeout_s, headers)

    served = {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transport, "post_admin", recording_post)
        WeightSync("tensor", None, keys=keys).push(served, [url], "step-0")  # the same weights again
        update_weights_from_disk([url], model_dir, "step-0", keys=keys)
        distributed = WeightSync("distributed", None, keys=keys, group_options={"backend": "gloo"})
        try:
            distributed.push(served, [url], "step-0")
        finally:
            distributed.close()
    assert {e for e, _ in sent} == set(TRAINER_ADMIN_ENDPOINTS)
    assert {auth for _, auth in sent} == {f"Bearer {ADMIN_KEY}"}


def test_distributed_sync_without_the_admin_key_is_refused_before_any_rendezvous(keyed, model_dir):
    pool, keys, _ = keyed
    url = pool.addresses[0]
    served = {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_safetensors(f).items()}
    for wrong in (ServerKeys(api_key=API_KEY), ServerKeys(api_key=API_KEY, admin_api_key="not-the-admin-key")):
        sync = WeightSync("distributed", None, keys=wrong, group_options={"backend": "gloo"}, timeout_s=60)
        with pytest.raises(WeightSyncError, match="keeps its previous weights.*HTTP 401.*admin key"):
            sync.push(served, [url], "step-9")
        sync.close()
    assert server_weight_version(url, keys=keys) == "step-0"
    assert not [t for t in threading.enumerate() if GROUP_PREFIX in t.name], "a refused rendezvous left a thread"


def test_missing_key_variable_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("MOE_RL_NOT_SET", raising=False)
    with pytest.raises(ServerKeyError, match="rollout.api_key_env='MOE_RL_NOT_SET' names an environment variable"):
        ServerKeys.from_env_names("MOE_RL_NOT_SET", None)


def test_batch_with_foreign_weight_versions_is_rejected_then_regenerated_once(
    keyed, model_dir, model_dir_v2, route_spec, caplog
):
    pool, keys, _ = keyed
    with pytest.raises(WeightVersionError, match=r"1 of 2 samples carry weight_version 'attacker' x1.*synced 'step-3'"):
        check_weight_versions(["attacker", "step-3"], "step-3")  # the mixed batch
    client = _client(pool, route_spec, keys)
    # someone holding the admin key swaps the weights behind the trainer's back
    update_weights_from_disk(pool.addresses, model_dir_v2, "attacker", keys=keys)
    with pytest.raises(WeightVersionError, match="4 of 4 samples carry weight_version 'attacker'"):
        check_weight_versions([s.weight_version for s in client.generate(PROMPTS, 2)], "step-0")
    resyncs = []

    def resync():
        resyncs.append(1)
        update_weights_from_disk(pool.addresses, model_dir, "step-0", keys=keys)

    with caplog.at_level(logging.WARNING):
        samples = generate_checked(lambda: client.generate(PROMPTS, 2), "step-0", resync)
    assert len(resyncs) == 1 and {s.weight_version for s in samples} == {"step-0"}
    assert "re-syncing the weights and regenerating (1/1)" in caplog.text
    # a re-sync that cannot fix it: fail after exactly one regeneration
    update_weights_from_disk(pool.addresses, model_dir_v2, "attacker", keys=keys)
    calls = []
    with pytest.raises(WeightVersionError, match="still after re-syncing and regenerating once"):
        generate_checked(lambda: calls.append(1) or client.generate(PROMPTS, 1), "step-0", lambda: None)
    assert len(calls) == 2
    update_weights_from_disk(pool.addresses, model_dir, "step-0", keys=keys)


def test_hung_server_is_detected_within_the_health_timeout(keyed, route_spec):
    pool, keys, _ = keyed
    client = _client(pool, route_spec, keys, health_timeout_s=3.0, request_timeout_s=120.0)
    pgid = pool.servers[0].process.pid
    os.killpg(pgid, signal.SIGSTOP)  # hung: alive, listening, never answering
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerHungError, match=r"has not answered /health for \d+ s \(rollout.health_timeout_s=3\)"):
            client.generate(PROMPTS, 1)
        elapsed = time.monotonic() - t0
    finally:
        os.killpg(pgid, signal.SIGCONT)
    assert elapsed < 10.0, f"took {elapsed:.1f} s (request_timeout_s=120 x 2 attempts without the watchdog)"


def test_dead_server_is_restarted_resynced_and_its_shm_files_removed(keyed, model_dir, route_spec, caplog):
    pool, keys, _ = keyed
    server = pool.servers[0]
    shm = set(server.shm_files)
    assert any("sglang_loads_" in p.name for p in shm), f"expected SGLang's load-snapshot file among {shm}"
    old_url = server.url
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    client = _client(pool, route_spec, keys)
    resynced = []

    def resync():
        resynced.append(1)
        update_weights_from_disk(pool.addresses, model_dir, "step-0", keys=keys)

    with caplog.at_level(logging.WARNING):
        samples = generate_checked(lambda: client.generate(PROMPTS, 1), "step-0", resync, restart=pool.restart)
    assert pool.restarts == 1 and resynced == [1] and server.url == old_url
    assert {s.weight_version for s in samples} == {"step-0"}
    assert "failed (exit code -9); restart 1/1" in caplog.text
    assert not [p for p in shm if p.exists()], "the killed server's /dev/shm files were not removed on restart"
    shm = set(server.shm_files)
    server.stop()
    assert shm and not [p for p in shm if p.exists()], "shared-memory files outlived the server"
