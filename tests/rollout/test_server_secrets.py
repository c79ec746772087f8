"""Issue 38 against one real SGLang CPU server keyed as a run keys it by default (an admin key only).

1. No secret in any reply (patch 0009): every GET route SGLang registers (enumerated from its FastAPI app in a
   process with the server's environment, not a hard-coded list) read without a key shows no key; the
   server-arguments endpoints refuse a call without the admin key and, with it, show ``<redacted>``.
2. The served-weights digests (patch 0014): after a disk and a tensor push they equal the digests of what was
   pushed, every tensor; another model pushed under the same label is caught (``foreign weights``, both digests).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from safetensors.torch import load_file

from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec, server_env
from moe_rl.sync.integrity import ForeignWeightsError
from moe_rl.sync.served_weights import PushedWeights
from moe_rl.sync.transport import update_weights_from_disk
from moe_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.sglang

ADMIN_KEY = "moe-rl-leak-test-admin-key-90c1b7"
ROUTES = """
import json
from sglang.srt.entrypoints.http_server import app
print("ROUTES=" + json.dumps(sorted(r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ()))))
"""


@pytest.fixture(scope="module")
def admin_keyed(model_dir, tmp_path_factory):
    """(url, keys, GET routes): a server with only an admin key, as ``ServerKeys.for_run`` keys a run's servers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_RL_TEST_LEAK_ADMIN", ADMIN_KEY)
        spec = ServerSpec(
            model_path=str(model_dir),
            dtype="float32",
            deterministic=True,
            max_total_tokens=4096,
            mem_fraction_static=0.3,
            startup_timeout_s=480,
            admin_api_key_env="MOE_RL_TEST_LEAK_ADMIN",
        )
        # the app's routes, from the app itself, while the server starts (same interpreter and environment)
        lister = subprocess.Popen(
            [sys.executable, "-c", ROUTES],
            env=server_env(spec),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with SGLangServer(spec, tmp_path_factory.mktemp("leak_logs") / "server.log") as server:
            out, err = lister.communicate(timeout=300)
            match = re.search(r"^ROUTES=(.*)$", out, re.MULTILINE)
            assert match, f"could not list SGLang's routes: {err[-2000:]}"
            yield server.url, ServerKeys.from_env_names(None, "MOE_RL_TEST_LEAK_ADMIN"), json.loads(match.group(1))


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "probe", path)  # /v1/models/{model:path} -> /v1/models/probe


def test_no_get_endpoint_shows_a_key_and_server_info_needs_the_admin_key(admin_keyed):
    url, keys, routes = admin_keyed
    assert "/server_info" in routes and "/get_server_info" in routes and len(routes) > 20, routes
    bodies = {}
    with httpx.Client(timeout=60) as http:
        for path in routes:
            resp = http.get(f"{url}{_concrete(path)}")
            bodies[path] = (resp.status_code, resp.text)
            assert ADMIN_KEY not in resp.text, f"GET {path} without a key shows the admin key (HTTP {resp.status_code})"
        for path in ("/server_info", "/get_server_info"):
            assert bodies[path][0] == 401, f"GET {path} without the admin key: HTTP {bodies[path][0]}"
            admin = http.get(f"{url}{path}", headers=keys.headers(admin=True))
            assert admin.status_code == 200 and ADMIN_KEY not in admin.text
            info = admin.json()
            assert info["admin_api_key"] == "<redacted>" and info["api_key"] is None
            assert all(s.get("admin_api_key") == "<redacted>" for s in info["internal_states"])


def _pushed(model_dir) -> dict:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_served_digests_follow_every_push_and_catch_foreign_weights(
    admin_keyed, model_dir, model_dir_v2, rollout_model_cfg, tmp_path, device
):
    url, keys, _ = admin_keyed
    pushed = PushedWeights(keys)
    update_weights_from_disk([url], model_dir, "step-1-abcd0123", keys=keys)
    pushed.remember_hf_dir("step-1-abcd0123", model_dir)
    assert set(pushed.by_label["step-1-abcd0123"]) == set(_pushed(model_dir))  # every tensor
    pushed.check([url], "step-1-abcd0123")

    # the tensor transport: a push of other weights is seen, and it is what WeightSync remembers
    ws = WeightSync("tensor", rollout_model_cfg, keys=keys)
    ws.push(_pushed(model_dir_v2), [url], "step-2-abcd0123")
    ws.pushed.check([url], "step-2-abcd0123")
    with pytest.raises(ForeignWeightsError):  # the old label's weights are not what is served now
        ws.pushed.by_label["step-1-abcd0123"] = pushed.by_label["step-1-abcd0123"]
        ws.pushed.check([url], "step-1-abcd0123")

    # the walk-through: someone with the key pushes another model under the current label
    update_weights_from_disk([url], model_dir, "step-2-abcd0123", keys=keys)
    with pytest.raises(
        ForeignWeightsError,
        match=r"foreign weights on .*label 'step-2-abcd0123' serves digest "
        r"[0-9a-f]{16}, the trainer pushed [0-9a-f]{16}",
    ):
        ws.pushed.check([url], "step-2-abcd0123")
    ws.push(_pushed(model_dir_v2), [url], "step-2-abcd0123")  # the re-sync restores it
    ws.pushed.check([url], "step-2-abcd0123")

    # the disk and distributed transports: what each sent is what the server received, every tensor
    disk = WeightSync("disk", rollout_model_cfg, export_dir=tmp_path / "export", template_dir=model_dir, keys=keys)
    disk.push(_pushed(model_dir), [url], "step-3-abcd0123")
    disk.pushed.check([url], "step-3-abcd0123")
    dist = WeightSync("distributed", rollout_model_cfg, keys=keys, group_options={"backend": "gloo"})
    try:
        dist.push(_pushed(model_dir_v2), [url], "step-4-abcd0123")
        dist.pushed.check([url], "step-4-abcd0123")
        assert set(dist.pushed.by_label["step-4-abcd0123"]) == set(_pushed(model_dir_v2))
    finally:
        dist.close()


def test_every_secret_server_argument_is_redacted_at_any_depth():
    from sglang.srt.utils.auth import SECRET_SERVER_ARGS, redact_server_secrets  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import

    info = {
        "api_key": "k1",
        "admin_api_key": "k2",
        "ssl_keyfile_password": "pw",
        "tp_size": 1,
        "watermark_key": None,
        "launch_command": "python -m x --api-key k1",
        "internal_states": [{"admin_api_key": "k2", "n": 2}],
    }
    out = redact_server_secrets(info, ("k1", "k2"))
    assert out["api_key"] == out["admin_api_key"] == out["ssl_keyfile_password"] == "<redacted>"
    assert out["internal_states"] == [{"admin_api_key": "<redacted>", "n": 2}] and out["tp_size"] == 1
    assert out["watermark_key"] is None and out["launch_command"] == "python -m x --api-key <redacted>"
    assert {"api_key", "admin_api_key", "ssl_keyfile_password"} <= SECRET_SERVER_ARGS
