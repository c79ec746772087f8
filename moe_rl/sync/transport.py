"""The weight sync's HTTP calls to the servers, and the error and the address rule every part of the sync shares.

Owns ``WeightSyncError``, ``is_local_address``, the POST of one weight-update endpoint (``post_admin``: a
``(success, message)`` reply, transport errors raised), the cache flush after a push, the ``weight_version`` a
server reports (``/model_info``) and its check after an update, and the disk load (``/update_weights_from_disk``,
server after server, each verified). It imports nothing else of ``moe_rl.sync``: the checks, the senders, the
rendezvous group and the ``WeightSync`` facade build on it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlparse

import httpx

from moe_rl.rollout.auth import ServerKeys, tls

__all__ = [
    "WeightSyncError",
    "check_version",
    "flush_server_cache",
    "is_local_address",
    "post_admin",
    "server_weight_version",
    "update_weights_from_disk",
]


class WeightSyncError(RuntimeError):
    """A sync was refused or failed; the message names the server and what state it is left in."""


def is_local_address(address: str) -> bool:
    """True when `address` (http://host:port) resolves to a loopback interface of this host."""
    host = urlparse(address if "//" in address else f"//{address}").hostname or ""
    with contextlib.suppress(OSError, ValueError):
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    return False


def post_admin(
    address: str, endpoint: str, body: dict, timeout_s: float, headers: dict | None = None
) -> tuple[bool, str]:
    """(success, message) of a weight-update endpoint; transport errors raise WeightSyncError.

    ``headers``: the admin (or API) key when the servers have one (``ServerKeys.headers(admin=True)``).
    """
    try:
        resp = httpx.post(f"{address}/{endpoint}", json=body, timeout=timeout_s, headers=headers or {}, verify=tls())
    except httpx.HTTPError as err:
        raise WeightSyncError(f"{address}/{endpoint} failed: {type(err).__name__}: {err}") from err
    reply = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    ok = resp.status_code == 200 and bool(reply.get("success", False))
    return ok, f"HTTP {resp.status_code}: {reply.get('message', resp.text[:300])}"


def flush_server_cache(address: str, headers: dict, timeout_s: float) -> dict[str, str]:
    """POST ``/flush_cache`` (a plain 200, not a ``post_admin`` reply); ``{address: message}`` when it failed."""
    try:
        resp = httpx.post(f"{address}/flush_cache", timeout=timeout_s, headers=headers, verify=tls())
    except httpx.HTTPError as err:
        return {address: f"{address}/flush_cache failed: {type(err).__name__}: {err}"}
    if resp.status_code == 200:
        return {}
    return {address: f"{address}/flush_cache: HTTP {resp.status_code}: {resp.text[:300]}"}


def server_weight_version(address: str, timeout_s: float = 30.0, keys: ServerKeys | None = None) -> str:
    """The `weight_version` a server reports in `/model_info`."""
    headers = keys.headers() if keys else {}
    resp = httpx.get(f"{address.rstrip('/')}/model_info", timeout=timeout_s, headers=headers, verify=tls())
    resp.raise_for_status()
    info = resp.json()
    if "weight_version" not in info:
        raise WeightSyncError(f"{address}/model_info has no 'weight_version' field: {str(info)[:300]}")
    return str(info["weight_version"])


def check_version(addresses: Iterable[str], weight_version: str, keys: ServerKeys | None = None) -> None:
    """Every server reports ``weight_version``; else WeightSyncError with ``foreign_label`` set (someone else
    pushed after this update)."""
    for address in addresses:
        reported = server_weight_version(address, keys=keys)
        if reported != str(weight_version):
            err = WeightSyncError(
                f"{address} reports weight_version={reported!r} after the update; expected {weight_version!r}"
            )
            err.foreign_label = True  # someone else pushed after this update
            raise err


def update_weights_from_disk(
    addresses: Sequence[str],
    model_path: str | Path,
    weight_version: str,
    timeout_s: float = 600.0,
    keys: ServerKeys | None = None,
    flush_cache: bool = True,
) -> None:
    """Load `model_path` (an HF checkpoint dir) into every server as `weight_version`; verify it.

    Servers are updated one after another; a refused load is rolled back by SGLang (the server
    keeps its previous weights) and raises WeightSyncError naming the server.
    """
    if not weight_version:
        raise ValueError("weight_version is empty; expected a non-empty version label such as 'step-12'")
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{model_path} is not an HF checkpoint directory (no config.json)")
    body = {"model_path": str(model_path.resolve()), "weight_version": str(weight_version), "flush_cache": flush_cache}
    headers = keys.headers(admin=True) if keys else None
    for address in addresses:
        address = address.rstrip("/")
        ok, message = post_admin(address, "update_weights_from_disk", body, timeout_s, headers=headers)
        if not ok:
            raise WeightSyncError(f"{address} refused weights from {model_path} ({message})")
        check_version([address], weight_version, keys)
