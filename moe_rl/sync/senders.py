"""How one learner rank sends its buckets of a weight sync, and the session calls rank 0 makes around them.

Owns the per-rank senders of ``weight_sync.WeightSync`` (every rank that owns tensors sends its own buckets, as
``learner.hf_stream`` yields them; no rank holds more than a bucket or two):

* ``TensorSender`` (``tensor``): each bucket copied once into one shared-memory buffer (torch's
  ``file_system`` sharing: a ``/dev/shm`` file the server opens by name) and posted to
  ``/update_weights_from_tensor`` on every server (same host only), one payload per server; the file is unlinked once
  the bucket's requests are done, whether or not they succeeded (``SharedBucket``);
* ``GroupSender`` (``distributed``): this rank's own weight-update group with the servers
  (``group.WeightGroup``: the rank is rank 0 of it, one group per pipeline stage's source);
* ``DiskSender`` (``disk``): each bucket a safetensors file of the shared HF directory (``learner.hf_export``).

Every bucket is labelled ``<version>.partial``; a sender records per server the buckets loaded and the first
failure, and stops sending to a server that failed. Rank 0 opens the session (``/begin_weight_update``), ends
it, then labels the servers that loaded everything with the version and flushes their cache (``publish``).
"""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as mp

from moe_rl.learner.hf_export import ShardWriter
from moe_rl.learner.hf_stream import size_buckets
from moe_rl.sync import transport
from moe_rl.sync.transport import WeightSyncError

__all__ = ["DictStream", "DiskSender", "GroupSender", "SharedBucket", "TensorSender", "begin", "end", "publish"]


@contextlib.contextmanager
def _file_system_sharing():
    """torch shares CPU tensors by /dev/shm file name (openable by an unrelated process) inside."""
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(old)


class SharedBucket:
    """A bucket's tensors copied into ONE shared-memory buffer (64-byte aligned views), pickled per receiver.

    Each ``payload()`` names that single /dev/shm file, which a server opens once (torch caches the storage).
    torch's ``file_system`` protocol counts references in the file and unlinks it when a process's count drop
    reaches zero -- exact only if every payload is read exactly once: a payload never read (a request that
    failed before the server read it) keeps the file until this process exits, and one payload read by three
    servers drops the count to zero while the third still needs the name. So the buffer holds one extra
    reference that is never given back (no process ever unlinks by count) and ``close`` unlinks the name once
    the bucket's requests are done; a server that read it keeps its mapping until it lets go.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]):
        offsets, total = [], 0
        for _, tensor in named:
            offsets.append(total)
            total += -(-tensor.numel() * tensor.element_size() // 64) * 64
        with _file_system_sharing():  # allocate by file name directly: no second copy when pickling
            self.buffer = torch.empty(total, dtype=torch.uint8).share_memory_()
        storage = self.buffer.untyped_storage()
        self.path = Path("/dev/shm") / storage._share_filename_cpu_()[1].decode().lstrip("/")
        storage._shared_incref()  # the pin: no count drop anywhere reaches zero
        self.views = []
        for (name, tensor), start in zip(named, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            view = self.buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            self.views.append((name, view))

    def payload(self) -> str:
        """Base64 ForkingPickler payload of the views, for one receiver."""
        buf = io.BytesIO()
        with _file_system_sharing():
            ForkingPickler(buf, 4).dump(self.views)
        return base64.b64encode(buf.getvalue()).decode()

    def close(self) -> None:
        """Unlink the file (after the bucket's last request) and drop this process's mapping."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.views, self.buffer = [], None


# ----------------------------------------------------------------------------------- ranks
class DictStream:
    """A ready HF state dict as ``HFStream``'s surface: this process sends it all, one stage."""

    stage, stages, sender = 0, 1, True

    def __init__(self, named: Mapping[str, torch.Tensor], bucket_bytes: int):
        self.named, self.bucket_bytes = named, bucket_bytes

    def buckets(self):
        yield from size_buckets(self.named, self.bucket_bytes)


# ----------------------------------------------------------------------------------- senders
class _Sender:
    def __init__(self, addresses: Sequence[str], version: str, headers: dict, timeout_s: float):
        self.addresses = [a.rstrip("/") for a in addresses]
        self.label, self.headers, self.timeout_s = f"{version}.partial", headers, timeout_s
        self.loaded = dict.fromkeys(self.addresses, 0)
        self.errors: dict[str, str | None] = dict.fromkeys(self.addresses)
        self.count = 0  # buckets this rank sent
        self.bytes = 0  # tensor bytes of those buckets (each live server gets them all: ``bytes`` per server)

    def live(self) -> list[str]:
        return [a for a in self.addresses if self.errors[a] is None]

    def _fail(self, address: str, message: str, reached: bool) -> None:
        """``reached``: the server may have loaded the bucket before failing (counts as loaded)."""
        self.errors[address] = message
        self.loaded[address] += int(reached)

    def report(self) -> dict:
        return {"loaded": self.loaded, "errors": self.errors}


def _nbytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


class TensorSender(_Sender):
    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.count += 1
        self.bytes += _nbytes(bucket)
        live = self.live()
        if not live:
            return
        shared = SharedBucket(bucket)
        try:
            for address in live:
                body = {
                    "serialized_named_tensors": [shared.payload()],
                    "weight_version": self.label,
                    "flush_cache": False,
                }
                try:
                    ok, message = transport.post_admin(
                        address, "update_weights_from_tensor", body, self.timeout_s, self.headers
                    )
                except WeightSyncError as err:
                    self._fail(address, str(err), True)
                    continue
                if ok:
                    self.loaded[address] += 1
                else:
                    self._fail(address, f"{address} refused bucket {self.count} ({message})", True)
        finally:
            shared.close()


class GroupSender(_Sender):
    """Sends over ``group`` (a ``WeightGroup`` of this rank, opened on the first bucket)."""

    def __init__(self, group, *args):
        super().__init__(*args)
        self.group = group

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.count += 1
        self.bytes += _nbytes(bucket)
        live = self.live()
        if not live:
            return
        if self.group.group is None:
            try:
                self.group.open()
            except WeightSyncError as err:
                for address in live:
                    self._fail(address, str(err), False)
                return
        refused = self.group.send(bucket, self.label)
        for address in live:
            if address in refused:
                self._fail(address, f"{address} refused bucket {self.count} ({refused[address]})", True)
            else:
                self.loaded[address] += 1
        if refused:  # a broadcast may be half-consumed: the group is closed, the sync stops for every server
            self.group.close()
            for address in self.live():
                self._fail(address, f"the sync stopped at bucket {self.count}: {'; '.join(refused.values())}", False)


class DiskSender:
    """Writes this rank's buckets into the shared temporary HF directory ``tmp`` (rank 0 finishes it)."""

    def __init__(self, tmp: str | Path, rank: int):
        self.writer = ShardWriter(tmp, f"model-r{rank:05d}")
        self.bytes = 0  # tensor bytes written (``writer.total_size``; the files add their safetensors headers)

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.writer.write(dict(bucket))
        self.bytes = self.writer.total_size

    def report(self) -> dict:
        return {"weight_map": self.writer.weight_map, "total_size": self.writer.total_size}


# ----------------------------------------------------------------------------------- rank 0's session
def _each(addresses: Sequence[str], endpoint: str, body: dict, headers: dict, timeout_s: float) -> dict[str, str]:
    """POST to every server; ``{address: message}`` of those that refused (transport errors included)."""
    refused = {}
    for address in addresses:
        try:
            ok, message = transport.post_admin(address, endpoint, body, timeout_s, headers)
        except WeightSyncError as err:
            ok, message = False, str(err)
        if not ok:
            hint = " (a weight sync needs the servers' admin key: rollout.admin_api_key_env, or the run's own)"
            refused[address] = f"{address}/{endpoint}: {message}" + (
                hint if message.startswith(("HTTP 401", "HTTP 403")) else ""
            )
    return refused


def begin(addresses: Sequence[str], headers: dict, timeout_s: float) -> dict[str, str]:
    """Open a weight-update session on every server (one left open by a learner that died is closed first)."""
    refused = _each(addresses, "begin_weight_update", {}, headers, timeout_s)
    stale = [a for a, m in refused.items() if "already open" in m]
    if stale:
        _each(stale, "end_weight_update", {}, headers, timeout_s)
        refused = {a: m for a, m in refused.items() if a not in stale} | _each(
            stale, "begin_weight_update", {}, headers, timeout_s
        )
    return refused


def end(addresses: Sequence[str], headers: dict, timeout_s: float) -> dict[str, str]:
    return _each(addresses, "end_weight_update", {}, headers, timeout_s)


def publish(
    addresses: Sequence[str], version: str, flush_cache: bool, headers: dict, timeout_s: float
) -> dict[str, str]:
    """Label every server ``version`` (no request aborted) and, unless paused in place, flush its cache."""
    refused = _each(
        addresses,
        "update_weight_version",
        {"new_version": str(version), "abort_all_requests": False},
        headers,
        timeout_s,
    )
    if flush_cache:
        for address in [a for a in addresses if a not in refused]:
            refused |= transport.flush_server_cache(address, headers, timeout_s)
    return refused
