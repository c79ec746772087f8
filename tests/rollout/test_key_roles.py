"""Issue 57 (3), keys with roles: a server this run launches never takes the API key on its admin endpoints.

With only ``rollout.api_key_env`` set, the run's own servers get a fresh admin key beside it (``ServerKeys.for_run``);
the preflight refuses the two variables holding the same key; external servers (``rollout.addresses``) are not ours
to key, and the preflight says so in a note. The real-server test pushes a weight-version change with each key.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from moe_rl.config import RolloutConfig, load_config
from moe_rl.preflight import config_problems, environment_problems
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV, ServerKeys
from moe_rl.rollout.server_pool import rollout_server_pool

API_KEY = "moe-rl-roles-api-key-5d0c"
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def test_only_an_api_key_configured_gives_the_runs_servers_an_admin_key_of_their_own():
    keys = ServerKeys.for_run(RolloutConfig(api_key_env="ROLES_API"), {"ROLES_API": API_KEY})
    assert keys.api_key == API_KEY and keys.generated
    assert keys.admin_api_key and keys.admin_api_key != API_KEY
    assert keys.server_env() == {RUN_ADMIN_KEY_ENV: keys.admin_api_key}
    assert keys.headers(admin=True) != keys.headers()


def test_a_configured_admin_key_or_external_servers_keep_the_configured_keys():
    env = {"ROLES_API": API_KEY, "ROLES_ADMIN": "admin-5d0c"}
    both = ServerKeys.for_run(RolloutConfig(api_key_env="ROLES_API", admin_api_key_env="ROLES_ADMIN"), env)
    assert (both.api_key, both.admin_api_key, both.generated) == (API_KEY, "admin-5d0c", False)
    external = RolloutConfig(api_key_env="ROLES_API", addresses=["http://infer:8000"])
    assert ServerKeys.for_run(external, env).admin_api_key is None  # not ours to key: the note below says so


def test_the_preflight_refuses_the_same_key_in_both_variables():
    cfg = load_config(TINY, ["rollout.api_key_env=ROLES_API", "rollout.admin_api_key_env=ROLES_ADMIN"])
    same = environment_problems(cfg, {"ROLES_API": API_KEY, "ROLES_ADMIN": API_KEY}).problems
    assert any("hold the same key" in p and "rollout.admin_api_key_env='ROLES_ADMIN'" in p for p in same), same
    apart = environment_problems(cfg, {"ROLES_API": API_KEY, "ROLES_ADMIN": "other"}).problems
    assert not any("same key" in p for p in apart), apart


def test_external_servers_keyed_by_the_api_key_only_get_a_note():
    cfg = load_config(TINY, ["rollout.api_key_env=ROLES_API", "rollout.addresses=['http://infer:8000']"])
    notes = config_problems(cfg).notes
    assert any("cannot change that" in n and "accept the API key on their admin endpoints" in n for n in notes), notes
    own = load_config(TINY, ["rollout.api_key_env=ROLES_API"])
    assert not any("admin endpoints" in n for n in config_problems(own).notes)


@pytest.mark.sglang
def test_the_api_key_is_refused_on_an_admin_endpoint_of_a_server_the_run_launched(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLES_API", API_KEY)
    rollout = RolloutConfig(api_key_env="ROLES_API", startup_timeout_s=300, mem_fraction_static=0.3)
    with rollout_server_pool(rollout, model_dir, tmp_path) as pool:
        (url,) = pool.addresses
        change = {"new_version": "outside-call"}
        with_api = httpx.post(f"{url}/update_weight_version", json=change, headers=pool.keys.headers(), timeout=30)
        assert with_api.status_code in (401, 403), (with_api.status_code, with_api.text[:300])
        with_admin = httpx.post(
            f"{url}/update_weight_version", json=change, headers=pool.keys.headers(admin=True), timeout=30
        )
        assert with_admin.status_code == 200, (with_admin.status_code, with_admin.text[:300])
        generate = httpx.post(
            f"{url}/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
            headers=pool.keys.headers(),
            timeout=60,
        )
        assert generate.status_code == 200, (generate.status_code, generate.text[:300])
