"""Secure by default: which keys a run's servers get (no server needed; the 401 is tests/train/test_operations_e2e.py)."""

from __future__ import annotations

import pytest

from moe_rl.config import RolloutConfig
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV, ServerKeyError, ServerKeys
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec, server_command


def test_servers_the_run_launches_get_a_fresh_admin_key_when_none_is_configured():
    a, b = ServerKeys.for_run(RolloutConfig()), ServerKeys.for_run(RolloutConfig())
    assert a.generated and a.api_key is None and len(a.admin_api_key) >= 40
    assert a.admin_api_key != b.admin_api_key  # fresh per run
    assert a.headers(admin=True) == {"Authorization": f"Bearer {a.admin_api_key}"}
    assert a.headers() == {}  # generate / model_info stay open; only admin endpoints need the key
    assert a.server_env() == {RUN_ADMIN_KEY_ENV: a.admin_api_key}
    assert a.admin_api_key not in repr(a)


def test_configured_variables_and_external_addresses_keep_todays_rules():
    env = {"MY_KEY": "k-123", "MY_ADMIN": "a-456"}
    keyed = ServerKeys.for_run(RolloutConfig(api_key_env="MY_KEY", admin_api_key_env="MY_ADMIN"), env)
    assert (keyed.api_key, keyed.admin_api_key, keyed.generated) == ("k-123", "a-456", False)
    assert keyed.server_env() == {}
    external = ServerKeys.for_run(RolloutConfig(addresses=["http://srv:30000"]), {})
    assert not external.enabled and not external.generated
    with pytest.raises(ServerKeyError, match="rollout.api_key_env='UNSET_VAR'"):
        ServerKeys.for_run(RolloutConfig(api_key_env="UNSET_VAR"), {})


def test_the_generated_key_reaches_the_server_by_environment_only(tmp_path):
    keys = ServerKeys.fresh()
    spec = ServerSpec(model_path="/m", admin_api_key_env=RUN_ADMIN_KEY_ENV)
    argv = server_command(spec, 30000)
    assert argv[argv.index("--admin-api-key-env") + 1] == RUN_ADMIN_KEY_ENV
    assert keys.admin_api_key not in " ".join(argv)
    server = SGLangServer(spec, tmp_path / "s.log", secret_env=keys.server_env())
    assert keys.admin_api_key not in repr(server) and keys.admin_api_key not in repr(spec)
