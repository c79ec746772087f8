"""The weight-update process group of ``rollout.weight_sync: distributed``: one learner source rank -> SGLang servers.

Owns the group's life and its wire: the rendezvous (a TCPStore this process hosts on
``rollout.weight_sync_master_port`` at ``rollout.weight_sync_master_address``; every server joins through
SGLang's ``/init_weights_update_group``, which returns only after all ranks joined, so this side joins
from a thread while those HTTP calls are in flight, else both wait for each other), one bucket (inside the
session rank 0 opened: the names, dtypes and shapes go to ``/update_weights_from_distributed`` on every server
while this rank broadcasts the same tensors in the same order), and teardown (``/destroy_weights_update_group`` on every
server, the local group destroyed, no thread left). Backend gloo for CPU servers, NCCL for GPU servers (the
NCCL path is the same code with CUDA tensors; it has not been run on this CPU-only project host).

Every call carries the admin key. A group that saw a failure is closed; the next sync opens a new one
(new group name, so a server that kept the old one cannot mix them up). It does not check weights, label
versions or track half-updated servers (``weight_sync.WeightSync`` does).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlparse

import httpx
import torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from moe_rl.rollout.auth import ServerKeys, tls
from moe_rl.sync import transport
from moe_rl.sync.transport import WeightSyncError, is_local_address

logger = logging.getLogger(__name__)

GROUP_PREFIX = "moe_rl_weight_sync"


def default_backend(server_device: str) -> str:
    """``rollout.weight_sync_backend: auto``: NCCL for CUDA servers, gloo for CPU servers."""
    return "nccl" if server_device == "cuda" else "gloo"


def group_options(rollout) -> dict:
    """WeightGroup's keyword arguments from a RolloutConfig (``weight_sync_backend: auto`` resolved)."""
    backend = rollout.weight_sync_backend
    return {
        "backend": default_backend(rollout.device) if backend == "auto" else backend,
        "master_address": rollout.weight_sync_master_address,
        "master_port": rollout.weight_sync_master_port,
        "stage_addresses": rollout.weight_sync_stage_addresses,
    }


def stage_group_options(options: dict, stage: int) -> dict:
    """``group_options`` for pipeline stage ``stage``'s source rank: its own address (``stage_addresses[stage]``,
    else the one master address, else its own host's: ``master_address_for`` runs on that rank) and its own
    rendezvous port (``master_port + stage``)."""
    out = dict(options)
    stages = out.pop("stage_addresses", None)
    if stages:
        if stage >= len(stages):
            raise WeightSyncError(
                f"rollout.weight_sync_stage_addresses names {len(stages)} address(es); pipeline stage {stage} has none"
            )
        out["master_address"] = stages[stage]
    if out.get("master_port"):
        out["master_port"] += stage
    return out


def master_address_for(addresses: Sequence[str], configured: str | None = None) -> str:
    """The address the servers reach this process at: the configured one, loopback when every server is
    on this host, else this host's address on the route to the first server."""
    if configured:
        return configured
    if all(is_local_address(a) for a in addresses):
        return "127.0.0.1"
    host = urlparse(addresses[0]).hostname
    port = urlparse(addresses[0]).port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: picks the route only
        s.connect((host, port))
        return s.getsockname()[0]


def port_is_free(port: int, host: str = "") -> bool:
    """True when ``port`` can be bound on this host (preflight of ``rollout.weight_sync_master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _new_group(store, rank: int, world_size: int, backend: str, group_name: str, timeout: timedelta):
    """A process group over ``store`` exactly as SGLang's ``init_custom_process_group`` builds its side
    (same store prefixes), without touching this process's default group (the learner's own)."""
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightGroup:
    """Rank 0's weight-update group with ``addresses`` (opened on first use, reused across syncs)."""

    _names = itertools.count()  # group names unique within this process

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        backend: str = "gloo",
        master_address: str | None = None,
        master_port: int | None = None,
        timeout_s: float = 600.0,
        keys: ServerKeys | None = None,
        headers: dict | None = None,
    ):
        self.addresses = [a.rstrip("/") for a in addresses]
        self.backend = backend
        self.master_address = master_address_for(self.addresses, master_address)
        self.master_port = master_port or 0  # 0: the store picks a free port
        self.timeout_s = timeout_s
        # every call below is an admin call: rank 0's keys (``headers``: as rank 0 handed them to a source rank)
        self.headers = dict(headers) if headers is not None else keys.headers(admin=True) if keys else {}
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.group = self.store = self.group_name = None

    @classmethod
    def reuse(cls, group: WeightGroup | None, addresses: Sequence[str], **kwargs) -> WeightGroup:
        """``group`` when it serves ``addresses``, else a new (unopened) one; a replaced group is closed."""
        if group is not None and group.addresses == [a.rstrip("/") for a in addresses]:
            return group
        if group is not None:
            group.close()
        return cls(addresses, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Rendezvous with every server (no-op when open). Raises WeightSyncError naming the server."""
        if self.group is not None:
            return
        for address in self.addresses:  # a refusal after the rendezvous started would leave this side waiting
            self._check_admin(address)
        ranks = [self._tp_size(a) for a in self.addresses]
        world = 1 + sum(ranks)
        self.group_name = f"{GROUP_PREFIX}_{next(self._names)}"
        timeout = timedelta(seconds=self.timeout_s)
        self.store = torch.distributed.TCPStore(
            "0.0.0.0", self.master_port, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        port, offsets = self.store.port, [1 + sum(ranks[:i]) for i in range(len(ranks))]
        joined: dict = {}

        def join():  # this side of the rendezvous: blocks until every server rank has joined
            try:
                joined["group"] = _new_group(self.store, 0, world, self.backend, self.group_name, timeout)
            except Exception as err:  # reported by the caller  # noqa: BLE001
                joined["error"] = err

        thread = threading.Thread(target=join, name=f"{self.group_name}-rendezvous", daemon=True)
        thread.start()
        bodies = {
            a: {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": off,
                "world_size": world,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for a, off in zip(self.addresses, offsets)
        }
        refused = self._on_every_server("init_weights_update_group", bodies)
        if refused:  # a refused server never joins: the rendezvous thread gives up after the timeout
            self.store = None
            raise WeightSyncError(
                f"weight-update group {self.group_name} (tcp://{self.master_address}:{port}, "
                f"backend {self.backend}) not created: " + "; ".join(refused.values())
            )
        thread.join(self.timeout_s)
        if "group" not in joined:
            self.store = None
            raise WeightSyncError(
                f"weight-update group {self.group_name}: the servers joined but this side did not "
                f"({joined.get('error', 'timed out')})"
            )
        self.group = joined["group"]
        logger.info(
            "weight-update group %s open: %d server rank(s), tcp://%s:%d, %s",
            self.group_name,
            world - 1,
            self.master_address,
            port,
            self.backend,
        )

    def close(self) -> None:
        """Destroy the group on every server (best effort: a dead server has none) and here."""
        if self.group is None:
            return
        with contextlib.suppress(WeightSyncError):
            self._on_every_server(
                "destroy_weights_update_group", {a: {"group_name": self.group_name} for a in self.addresses}
            )
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group(self.group)
        self.group = self.store = None

    # ------------------------------------------------------------------ one bucket
    def send(self, bucket: list[tuple[str, torch.Tensor]], label: str) -> dict[str, str]:
        """One bucket to every server of the open group, labelled ``label``; ``{address: message}`` of refusals.

        Runs inside a weight-update session rank 0 opened (``senders.begin``); a caller that sees a
        refusal closes the group (a broadcast may be half-consumed) and the next sync opens a new one."""
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "weight_version": label,
            "flush_cache": False,
        }
        return self._bucket(bucket, body)

    def _bucket(self, group: list[tuple[str, torch.Tensor]], body: dict) -> dict[str, str]:
        """One bucket: the request to every server and, meanwhile, rank 0's broadcasts; refusals by address."""
        tensors = [t.detach().to(self.device).contiguous() for _, t in group]
        with ThreadPoolExecutor(len(self.addresses), thread_name_prefix=f"{self.group_name}-bucket") as pool:
            futures = {
                a: pool.submit(
                    transport.post_admin, a, "update_weights_from_distributed", body, self.timeout_s, self.headers
                )
                for a in self.addresses
            }
            works = [torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
            refused = _refusals(futures)  # a server replies after it received (and loaded) the whole bucket
            try:  # done when every server received; else it may never be (the group is closed after this)
                for work in works:
                    work.wait(timeout=timedelta(seconds=self.timeout_s if not refused else 5))
            except Exception as err:  # noqa: BLE001
                sent = f"rank 0's broadcast failed: {type(err).__name__}: {err}"
                refused = refused or dict.fromkeys(self.addresses, sent)
        return refused

    # ------------------------------------------------------------------ HTTP
    def _on_every_server(self, endpoint: str, bodies: Mapping[str, dict]) -> dict[str, str]:
        """POST ``endpoint`` to every server concurrently; ``{address: message}`` of those that refused."""
        with ThreadPoolExecutor(len(bodies), thread_name_prefix=f"{GROUP_PREFIX}-http") as pool:
            futures = {
                a: pool.submit(transport.post_admin, a, endpoint, body, self.timeout_s, self.headers)
                for a, body in bodies.items()
            }
            return {a: f"{a}/{endpoint}: {message}" for a, message in _refusals(futures).items()}

    def _check_admin(self, address: str) -> None:
        """The server takes this process's admin calls and has the group endpoints: destroying a group that
        does not exist answers 400 when it does, 401/403 without the admin key, 404 on an SGLang without them."""
        probe = {"group_name": f"{GROUP_PREFIX}_probe"}
        ok, message = transport.post_admin(address, "destroy_weights_update_group", probe, self.timeout_s, self.headers)
        if not ok and not message.startswith("HTTP 400"):
            raise WeightSyncError(
                f"{address}/destroy_weights_update_group refused ({message}): the weight-update "
                "group needs the servers' admin key (rollout.admin_api_key_env, or the run's own) "
                "and an SGLang with /init_weights_update_group"
            )

    def _tp_size(self, address: str) -> int:
        """Server ranks that join the group (``tp_size`` in ``/server_info``; one per tensor-parallel rank)."""
        try:
            resp = httpx.get(
                f"{address}/server_info", timeout=60, headers=self.headers, verify=tls()
            )  # admin (patch 0009)
            resp.raise_for_status()
            return int(resp.json().get("tp_size") or 1)
        except (httpx.HTTPError, ValueError) as err:
            raise WeightSyncError(f"{address}/server_info failed: {type(err).__name__}: {err}") from err


def _refusals(futures: Mapping) -> dict[str, str]:
    """``{address: message}`` of the admin calls (``transport.post_admin`` futures by address) that were refused."""
    refused = {}
    for address, future in futures.items():
        try:
            ok, message = future.result()
        except WeightSyncError as err:
            ok, message = False, str(err)
        if not ok:
            refused[address] = message
    return refused
