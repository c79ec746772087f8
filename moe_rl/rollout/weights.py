"""Push a learner-exported HF checkpoint to SGLang servers and verify the version they report.

Owns weight sync without NCCL: `POST /update_weights_from_disk` (the server reloads the files,
flushes its prefix cache and takes the new `weight_version`), then `GET /model_info` on every
server must report exactly that version before the next batch is generated. Rollout records
carry the version reported in each reply's `meta_info`, so stale samples are identifiable.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import httpx

from moe_rl.rollout.auth import ServerKeys


class WeightSyncError(RuntimeError):
    """A server refused the update or reports a different weight version afterwards."""


def server_weight_version(address: str, timeout_s: float = 30.0, keys: ServerKeys | None = None) -> str:
    """The `weight_version` a server reports in `/model_info`."""
    headers = keys.headers() if keys else {}
    resp = httpx.get(f"{address.rstrip('/')}/model_info", timeout=timeout_s, headers=headers)
    resp.raise_for_status()
    info = resp.json()
    if "weight_version" not in info:
        raise WeightSyncError(f"{address}/model_info has no 'weight_version' field: {str(info)[:300]}")
    return str(info["weight_version"])


def update_weights_from_disk(
    addresses: Sequence[str], model_path: str | Path, weight_version: str, timeout_s: float = 600.0,
    keys: ServerKeys | None = None,
) -> None:
    """Load `model_path` (an HF checkpoint dir) into every server as `weight_version`; verify it.

    Servers are updated one after another; any failure raises WeightSyncError naming the server,
    after which the servers may hold different versions (re-run the sync before generating).
    ``keys``: the servers' keys (the admin key goes on the update when set, auth.py).
    """
    if not weight_version:
        raise ValueError("weight_version is empty; expected a non-empty version label such as 'step-12'")
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{model_path} is not an HF checkpoint directory (no config.json)")
    body = {"model_path": str(model_path.resolve()), "weight_version": str(weight_version), "flush_cache": True}
    for address in addresses:
        address = address.rstrip("/")
        try:
            resp = httpx.post(f"{address}/update_weights_from_disk", json=body, timeout=timeout_s,
                              headers=keys.headers(admin=True) if keys else {})  # fmt: skip
        except httpx.HTTPError as err:
            raise WeightSyncError(f"{address}/update_weights_from_disk failed: {type(err).__name__}: {err}") from err
        reply = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code != 200 or not reply.get("success", False):
            raise WeightSyncError(
                f"{address} refused weights from {model_path} (HTTP {resp.status_code}): "
                f"{reply.get('message', resp.text[:300])}"
            )
        reported = server_weight_version(address, keys=keys)
        if reported != str(weight_version):
            raise WeightSyncError(
                f"{address} reports weight_version={reported!r} after the update; expected {weight_version!r}"
            )
