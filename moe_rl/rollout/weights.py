"""Push learner weights to SGLang servers, verify the version they report, track servers left invalid.

Owns ``rollout.weight_sync``:

* ``tensor``: the HF-named state dict goes to ``/update_weights_from_tensor`` in buckets of
  ``rollout.weight_sync_bucket_mb`` between ``/begin_weight_update`` and ``/end_weight_update``.
  Tensors travel as shared-memory handles (torch's ``file_system`` sharing: ``/dev/shm``, no disk
  and no copy through HTTP), so the servers must run on this host; a GPU server copies them to
  its device.
* ``disk``: the state dict is written as an HF checkpoint dir and loaded with
  ``/update_weights_from_disk`` (any host that sees the path; SGLang rolls back on failure).
* ``distributed``: a broadcast from the learner's rank 0 into a process group with the servers
  (``/update_weights_from_distributed``, gloo for CPU servers, NCCL for GPU servers), in the same
  buckets and session as ``tensor``; the group is ``weight_group.WeightGroup``'s.
* ``auto``: tensor when every server address is on this host, else disk.

FP8 rollout weights (``rollout.weight_quantization``) are applied to the in-memory tensors with the
same function the disk path uses, so both paths serve identical weights. Before anything is sent
the weights are checked against the previous sync (or the server's checkpoint): same names, same
shapes, all finite; a failure there sends nothing, so the previous weights keep serving. A tensor
or distributed sync that fails after some buckets were loaded leaves that server half-updated (no
rollback): it is marked invalid, ``check_servable`` refuses rollouts from it, and the next
``sync`` (always a full one) makes it valid again. After every sync ``GET /model_info`` on every
server must report the new ``weight_version``; samples carry the version of the reply.

Every successful push is remembered by label in ``WeightSync.pushed`` (``served_weights.PushedWeights``: the
fingerprinted tensors of what was sent), so each generation batch can be checked against what the servers
really hold. A push whose label is overwritten behind it, or that fails, is pushed again at most
``rollout.max_foreign_syncs`` times in a row, then the run stops (``ForeignWeightsStop``, one line).
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import httpx
import torch

WEIGHT_SYNC_MODES = ("tensor", "disk", "distributed")

from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.integrity import ForeignWeightsStop
from moe_rl.rollout.served_weights import PushedWeights
from moe_rl.rollout.weight_checks import (  # noqa: F401 (re-exported: the sync's public names)
    ServerInvalidError,
    WeightSyncError,
    check_weights,
    is_local_address,
    quantize_state_dict,
    reference_from_hf_dir,
)

logger = logging.getLogger(__name__)


def server_weight_version(address: str, timeout_s: float = 30.0, keys: ServerKeys | None = None) -> str:
    """The `weight_version` a server reports in `/model_info`."""
    headers = keys.headers() if keys else {}
    resp = httpx.get(f"{address.rstrip('/')}/model_info", timeout=timeout_s, headers=headers)
    resp.raise_for_status()
    info = resp.json()
    if "weight_version" not in info:
        raise WeightSyncError(f"{address}/model_info has no 'weight_version' field: {str(info)[:300]}")
    return str(info["weight_version"])


def _post(address: str, endpoint: str, body: dict, timeout_s: float, headers: dict | None = None) -> tuple[bool, str]:
    """(success, message) of a weight-update endpoint; transport errors raise WeightSyncError.

    ``headers``: the admin (or API) key when the servers have one (``ServerKeys.headers(admin=True)``).
    """
    try:
        resp = httpx.post(f"{address}/{endpoint}", json=body, timeout=timeout_s, headers=headers or {})
    except httpx.HTTPError as err:
        raise WeightSyncError(f"{address}/{endpoint} failed: {type(err).__name__}: {err}") from err
    reply = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    ok = resp.status_code == 200 and bool(reply.get("success", False))
    return ok, f"HTTP {resp.status_code}: {reply.get('message', resp.text[:300])}"


def _check_version(addresses: Iterable[str], weight_version: str, keys: ServerKeys | None = None) -> None:
    for address in addresses:
        reported = server_weight_version(address, keys=keys)
        if reported != str(weight_version):
            err = WeightSyncError(
                f"{address} reports weight_version={reported!r} after the update; expected {weight_version!r}"
            )
            err.foreign_label = True  # someone else pushed after this update
            raise err


def update_weights_from_disk(
    addresses: Sequence[str], model_path: str | Path, weight_version: str, timeout_s: float = 600.0,
    keys: ServerKeys | None = None, flush_cache: bool = True,
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
    for address in addresses:
        address = address.rstrip("/")
        ok, message = _post(address, "update_weights_from_disk", body, timeout_s,
                            headers=keys.headers(admin=True) if keys else None)  # fmt: skip
        if not ok:
            raise WeightSyncError(f"{address} refused weights from {model_path} ({message})")
        _check_version([address], weight_version, keys)


# ----------------------------------------------------------------------------------- tensor transport
@contextlib.contextmanager
def _file_system_sharing():
    """torch shares CPU tensors by /dev/shm file name (openable by an unrelated process) inside."""
    import torch.multiprocessing as mp

    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(old)


def _serialize_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """Base64 ForkingPickler payload of one bucket; returns it with the buffer that must outlive the request.

    The bucket's tensors are copied into ONE shared-memory buffer (64-byte aligned views), so the
    payload names a single /dev/shm file that the server opens once (torch caches the storage).
    """
    from multiprocessing.reduction import ForkingPickler

    offsets, total = [], 0
    for _, tensor in named:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // 64) * 64
    buf = io.BytesIO()
    with _file_system_sharing():  # allocate by file name directly: no second copy when pickling
        flat = torch.empty(total, dtype=torch.uint8).share_memory_()
        views = []
        for (name, tensor), start in zip(named, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            view = flat[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            views.append((name, view))
        ForkingPickler(buf, 4).dump(views)
    return base64.b64encode(buf.getvalue()).decode(), flat


def buckets(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a bigger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return [b for b in out if b]


def push_tensors(
    address: str, named: Mapping[str, torch.Tensor], weight_version: str, bucket_bytes: int, timeout_s: float = 600.0,
    headers: dict | None = None, flush_cache: bool = True,
) -> int:
    """Load `named` into one server in buckets; returns the number of buckets.

    Raises WeightSyncError; its ``buckets_loaded`` attribute says how many buckets the server had
    already loaded (0 = the server still serves its previous weights). Intermediate buckets label
    the server ``<version>.partial`` so a half-updated server can never pass for either version.
    """
    groups = buckets(named, bucket_bytes)
    ok, message = _post(address, "begin_weight_update", {}, timeout_s, headers)
    if not ok and "already open" in message:  # a session left open by an earlier failed sync
        _post(address, "end_weight_update", {}, timeout_s, headers)
        ok, message = _post(address, "begin_weight_update", {}, timeout_s, headers)
    if not ok:
        raise _failed(f"{address}/begin_weight_update refused ({message})", 0)
    loaded = 0
    try:
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            payload, keep_alive = _serialize_bucket(group)
            body = {
                "serialized_named_tensors": [payload],
                "weight_version": str(weight_version) if last else f"{weight_version}.partial",
                "flush_cache": last and flush_cache,
            }
            try:
                ok, message = _post(address, "update_weights_from_tensor", body, timeout_s, headers)
            except WeightSyncError as err:
                raise _failed(str(err), loaded + 1) from err  # the server may have loaded it before failing
            del keep_alive
            if not ok:
                raise _failed(f"{address} refused bucket {i + 1}/{len(groups)} ({message})", loaded + 1)
            loaded += 1
    finally:
        with contextlib.suppress(WeightSyncError):
            _post(address, "end_weight_update", {}, timeout_s, headers)
    return len(groups)


def _failed(message: str, buckets_loaded: int) -> WeightSyncError:
    err = WeightSyncError(message)
    err.buckets_loaded = buckets_loaded
    return err


# ----------------------------------------------------------------------------------- the entry point
class WeightSync:
    """Learner -> rollout servers, per ``rollout.weight_sync``; remembers which servers are invalid.

    ``sync(model_module, addresses, version)`` is collective (every learner rank calls it; rank 0
    talks to the servers) and returns seconds. ``push(hf_state, addresses, version)`` is the
    rank-0 half for a ready HF-named state dict. ``check_servable(addresses)`` raises
    ServerInvalidError for a server a failed sync left half-updated. ``close()`` ends a distributed
    sync's weight-update group (a later sync opens a new one).
    """

    def __init__(
        self,
        mode: str,
        model_cfg,
        *,
        export_dir: str | Path | None = None,
        template_dir: str | Path | None = None,
        weight_quantization: str = "none",
        bucket_bytes: int = 256 << 20,
        reference: Mapping[str, tuple[int, ...]] | None = None,
        timeout_s: float = 600.0,
        keys: ServerKeys | None = None,
        group_options: Mapping | None = None,
        max_foreign_syncs: int | None = None,
        keep_pushes: int = 4,
    ):
        if mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"rollout.weight_sync={mode!r}; expected one of {WEIGHT_SYNC_MODES} (or 'auto')")
        if mode == "disk" and export_dir is None:
            raise ValueError("rollout.weight_sync='disk' needs an export_dir for the HF checkpoint")
        self.mode = mode
        self.model_cfg = model_cfg
        self.export_dir = None if export_dir is None else Path(export_dir)
        self.template_dir = template_dir
        self.weight_quantization = weight_quantization
        self.bucket_bytes = bucket_bytes
        self.reference = None if reference is None else dict(reference)
        self.timeout_s = timeout_s
        self.invalid: dict[str, str] = {}  # address -> why
        self.version: str | None = None
        self.keys = keys
        self.last_state: Mapping[str, torch.Tensor] | None = None  # what the servers should hold (rank 0)
        self.group_options = dict(group_options or {})  # distributed: WeightGroup's backend / master address, port
        self.group = None  # distributed: the open WeightGroup (rank 0)
        self.pushed = PushedWeights(keys, timeout_s, max(4, keep_pushes))  # fingerprints of the last pushes
        self.max_foreign_syncs = max_foreign_syncs  # None: a failed push raises its WeightSyncError at once

    @classmethod
    def from_config(cls, cfg, addresses: Sequence[str], export_dir: str | Path | None = None,
                    keys: ServerKeys | None = None) -> WeightSync:  # fmt: skip
        """The sync for an ExperimentConfig and the servers in use (``auto`` looks at their hosts).

        ``keys``: the servers' keys (a run's generated admin key); default: the configured variables."""
        r = cfg.rollout
        mode = r.weight_sync
        local = all(is_local_address(a) for a in addresses)
        if mode == "auto":
            mode = "tensor" if local else "disk"
        elif mode == "tensor" and not local:
            remote = [a for a in addresses if not is_local_address(a)]
            raise ValueError(
                f"rollout.weight_sync='tensor' shares tensors through this host's memory, but {remote} are not "
                f"on this host; use rollout.weight_sync='disk' (or 'auto')"
            )
        from moe_rl.config.hf_model import initial_weights_dir, side_files_dir
        from moe_rl.rollout.weight_group import group_options

        init = initial_weights_dir(cfg)
        return cls(
            mode, cfg.model, export_dir=export_dir, template_dir=side_files_dir(cfg),
            weight_quantization=r.weight_quantization,
            bucket_bytes=r.weight_sync_bucket_mb << 20, reference=reference_from_hf_dir(init) if init else None,
            keys=ServerKeys.from_rollout_config(r) if keys is None else keys, group_options=group_options(r),
            max_foreign_syncs=r.max_foreign_syncs, keep_pushes=cfg.train.max_staleness + 2,
        )  # fmt: skip

    def check_servable(self, addresses: Sequence[str]) -> None:
        """Raise ServerInvalidError if a failed sync left any of `addresses` half-updated."""
        bad = {a: why for a, why in self.invalid.items() if a in {x.rstrip("/") for x in addresses}}
        if bad:
            raise ServerInvalidError(
                f"refusing rollouts from {sorted(bad)}: a failed weight sync left them half-updated "
                f"({'; '.join(bad.values())}); run a full sync first"
            )

    def sync(self, model_module, addresses: Sequence[str], version: str, around_push=contextlib.nullcontext) -> float:
        """Export the learner (collective) and push it to every server inside ``around_push()`` (the async
        producer's exclusive section); seconds taken (rank 0)."""
        from moe_rl.learner.hf_convert import export_hf_state_dict

        t0 = time.perf_counter()
        hf_state = export_hf_state_dict(model_module, self.model_cfg)
        if hf_state is not None:
            with around_push() as push_kwargs:  # e.g. {"flush_cache": False} inside an in_place pause
                self.push(hf_state, addresses, version, **(push_kwargs or {}))
        return time.perf_counter() - t0

    def push(self, hf_state: Mapping[str, torch.Tensor], addresses: Sequence[str], version: str,
             flush_cache: bool = True) -> None:  # fmt: skip
        """Check, (quantise,) and load `hf_state` into every server as `version`; verify the version.

        ``flush_cache=False`` only inside ``partial.paused_generation`` in ``in_place`` mode
        (``PauseWindow.flush_cache``): SGLang refuses a flush while paused requests hold KV."""
        if not version:
            raise ValueError("weight version is empty; expected a label such as 'step-12'")
        addresses = [a.rstrip("/") for a in addresses]
        check_weights(hf_state, self.reference)  # raises before anything is sent
        named = quantize_state_dict(hf_state, self.weight_quantization)
        path = self._again(version, lambda: self._send(named, addresses, version, flush_cache))
        self.reference = {k: tuple(v.shape) for k, v in hf_state.items()}
        self.version = str(version)
        self.last_state = hf_state
        if path is not None:  # the disk path: what the servers read is the file (its dtype), not the tensors
            self.pushed.remember_hf_dir(version, path)
        else:
            self.pushed.remember(version, named)

    def load_dir(self, hf_dir: str | Path, addresses: Sequence[str], version: str) -> None:
        """Load an HF checkpoint dir (the run's export) into every server as ``version``, remembered like a push."""
        addresses = [a.rstrip("/") for a in addresses]
        self._again(version, lambda: update_weights_from_disk(addresses, hf_dir, version, self.timeout_s, keys=self.keys))
        self.version = str(version)
        self.pushed.remember_hf_dir(version, hf_dir)

    def _again(self, version: str, send) -> None:
        """``send()``, again after a failed push (its label overwritten behind it: foreign weights) at most
        ``max_foreign_syncs`` times in a row, then ForeignWeightsStop (one line); None: no second try."""
        for attempt in range(1 + (self.max_foreign_syncs or 0)):
            try:
                return send()
            except WeightSyncError as err:
                if self.max_foreign_syncs is None:
                    raise
                what = "foreign weights: " if getattr(err, "foreign_label", False) else ""
                if attempt == self.max_foreign_syncs:
                    raise ForeignWeightsStop(f"{what}the push of {version!r} failed {attempt + 1} time(s) in a row "
                                             f"(rollout.max_foreign_syncs={self.max_foreign_syncs}): {err}") from None  # fmt: skip
                logger.warning("%s%s; pushing %r again (%d/%d)", what, err, version, attempt + 1, self.max_foreign_syncs)

    def _send(self, named, addresses: list[str], version: str, flush_cache: bool) -> Path | None:
        """One push of the (checked, quantised) ``named`` over this sync's transport (the disk path returns the
        directory it wrote); WeightSyncError on failure."""
        if self.mode == "disk":
            from moe_rl.learner.hf_convert import write_hf_checkpoint

            path = write_hf_checkpoint(named, self.model_cfg, self.export_dir, self.template_dir)
            update_weights_from_disk(addresses, path, version, self.timeout_s, keys=self.keys, flush_cache=flush_cache)
            return Path(path)
        else:
            failures, foreign, errors = [], [], self._push_buckets(named, addresses, version, flush_cache)
            for address, err in errors.items():
                try:
                    if err is not None:
                        raise err
                    _check_version([address], version, self.keys)
                except WeightSyncError as err:
                    foreign.append(err)
                    if getattr(err, "buckets_loaded", 1) > 0:
                        self.invalid[address] = f"{address}: {err}"
                        failures.append(f"{address} is left half-updated and marked invalid: {err}")
                    else:
                        failures.append(f"{address} keeps its previous weights: {err}")
                    continue
                self.invalid.pop(address, None)
            if failures:
                err = WeightSyncError(f"weight sync to version {version!r} failed: " + "; ".join(failures))
                err.foreign_label = any(getattr(e, "foreign_label", False) for e in foreign)
                raise err
        return None

    def _push_buckets(self, named, addresses: list[str], version: str,
                      flush_cache: bool = True) -> dict[str, WeightSyncError | None]:  # fmt: skip
        """The tensor or distributed transport; ``{address: None | error with buckets_loaded}``."""
        if self.mode == "distributed":
            from moe_rl.rollout.weight_group import WeightGroup

            self.group = WeightGroup.reuse(self.group, addresses, timeout_s=self.timeout_s, keys=self.keys,
                                           **self.group_options)  # fmt: skip
            return self.group.push(named, version, self.bucket_bytes, flush_cache)
        errors: dict[str, WeightSyncError | None] = dict.fromkeys(addresses)
        for address in addresses:
            try:
                push_tensors(address, named, version, self.bucket_bytes, self.timeout_s,
                             self.keys.headers(admin=True) if self.keys else None, flush_cache)  # fmt: skip
            except WeightSyncError as err:
                errors[address] = err
        return errors

    def close(self) -> None:
        """Tear down the distributed weight-update group (servers and here); a later sync opens a new one."""
        if self.group is not None:
            self.group.close()
            self.group = None
