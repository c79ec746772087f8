"""Push learner weights to SGLang servers, verify the version they report, track servers left invalid.

Owns ``rollout.weight_sync`` and the sync's protocol (the HTTP calls are ``transport``'s, the checks ``checks``').
A sync is collective over the learner ranks and streams: the ranks that own tensors send them bucket by bucket
(``rollout.weight_sync_bucket_mb``, ``learner.hf_stream``; ``senders`` sends), no rank holds the whole model,
and a re-sync of a restarted server is the same collective call from the live weights. Transports:

* ``tensor``: each sending rank posts its buckets to ``/update_weights_from_tensor`` as shared-memory
  handles (``/dev/shm``, no disk, no copy through HTTP), so the servers must run on this host;
* ``disk``: each sending rank writes its buckets as safetensors files of one HF directory, rank 0 the
  index and side files; the servers load it with ``/update_weights_from_disk`` (any host that sees the
  path; SGLang rolls back on failure);
* ``distributed``: one source rank per pipeline stage (experts gathered to it per bucket) broadcasts
  into its own weight-update group (at its own address: ``group.stage_group_options``) with the servers (``/update_weights_from_distributed``, gloo for CPU
  servers, NCCL for GPU servers; ``group.WeightGroup``); the stages take turns;
* ``auto``: tensor when every server address is on this host, else disk.

Rank 0 opens the session (``/begin_weight_update``) on every server, the senders label every bucket
``<version>.partial``, then rank 0 ends the session and labels the servers that loaded everything with the
version (``/update_weight_version``) and flushes their cache. FP8 rollout weights
(``rollout.weight_quantization``) are applied per bucket with the function the disk export uses. Before
anything is sent the weights are checked: the names and shapes every rank will send (meta tensors, as a
16-byte digest per rank, ``checks.plan_digest``; the plans themselves only when the digests disagree) against
the previous sync (or the server's checkpoint), every rank's own tensors finite on their
device; a failure there sends nothing and raises on every rank. A sync that fails after some buckets were
loaded leaves that server half-updated (no rollback): it is marked invalid, ``check_servable`` refuses
rollouts from it, and the next (always full) sync makes it valid again. After every sync ``GET /model_info``
on every server must report the new ``weight_version``; samples carry the version of the reply.

Every successful push is remembered by label in ``WeightSync.pushed`` (``served_weights.PushedWeights``: the
digest of every tensor sent, taken by the ranks that sent them as they send it and gathered to rank 0; none with
``rollout.check_served_weights=false``), so each generation batch can be checked against what the servers received. A push whose label is overwritten behind it, or that fails,
is pushed again at most ``rollout.max_foreign_syncs`` times in a row, then the run stops
(``ForeignWeightsStop``, one line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from moe_rl.config.hf_model import initial_weights_dir, side_files_dir
from moe_rl.learner.dist import RankComm
from moe_rl.learner.hf_export import begin_dir, finish_dir
from moe_rl.learner.hf_stream import HFStream
from moe_rl.rollout.auth import ServerKeys
from moe_rl.sync import senders as ws
from moe_rl.sync.checks import (
    check_servable,
    check_shapes,
    check_weights,
    plan_digest,
    quantize_state_dict,
    reference_from_hf_dir,
)
from moe_rl.sync.group import WeightGroup, group_options, stage_group_options
from moe_rl.sync.integrity import ForeignWeightsStop
from moe_rl.sync.served_weights import PushedWeights, tensor_digests
from moe_rl.sync.transport import WeightSyncError, check_version, is_local_address, update_weights_from_disk

__all__ = ["WEIGHT_SYNC_MODES", "WeightSync"]

WEIGHT_SYNC_MODES = ("tensor", "disk", "distributed")

logger = logging.getLogger(__name__)


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
        digests: bool = True,
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
        self._planned = None  # the names and shapes (push) or their plan_digest (sync) under way (rank 0)
        self.plan_digest: tuple[int, int] | None = None  # plan_digest of the last successful sync or push (rank 0)
        self.group_options = dict(group_options or {})  # distributed: WeightGroup's backend / master address, port
        self.group = None  # distributed: this rank's open WeightGroup (a pipeline stage's source)
        self.pushed = PushedWeights(keys, timeout_s, max(4, keep_pushes))  # digests of the last pushes
        self.digests = digests  # digest every tensor sent (rollout.check_served_weights)
        self.max_foreign_syncs = max_foreign_syncs  # None: a failed push raises its WeightSyncError at once
        self.sent_bytes = 0  # tensor bytes this rank's sender handed its transport in the last attempt (per server)

    @classmethod
    def from_config(
        cls, cfg, addresses: Sequence[str], export_dir: str | Path | None = None, keys: ServerKeys | None = None
    ) -> WeightSync:
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
        init = initial_weights_dir(cfg)
        return cls(
            mode,
            cfg.model,
            export_dir=export_dir,
            template_dir=side_files_dir(cfg),
            weight_quantization=r.weight_quantization,
            bucket_bytes=r.weight_sync_bucket_mb << 20,
            reference=reference_from_hf_dir(init) if init else None,
            keys=ServerKeys.from_rollout_config(r) if keys is None else keys,
            group_options=group_options(r),
            max_foreign_syncs=r.max_foreign_syncs,
            keep_pushes=cfg.train.max_staleness + 2,
            digests=r.check_served_weights,
        )

    def check_servable(self, addresses: Sequence[str]) -> None:
        """Raise ServerInvalidError if a failed sync left any of `addresses` half-updated."""
        check_servable(self.invalid, addresses)

    def sync(self, model_module, addresses: Sequence[str], version: str, flush_cache: bool = True) -> float:
        """Push the learner's live weights to every server as ``version``; seconds taken.

        **Collective over every learner rank**, a re-sync included: rank 0 names the servers (``addresses``;
        the other ranks pass ``[]``), opens and closes the session and labels the servers; the ranks that own
        tensors stream them bucket by bucket (``learner.hf_stream``). Checked first (names and shapes against
        the served model, every rank's tensors finite on their device): a failure there sends nothing and
        raises WeightSyncError on every rank. ``flush_cache=False`` only inside an ``in_place`` pause."""
        t0, comm = time.perf_counter(), RankComm(collective=True)
        # size: the mode, the server addresses, a label and the admin headers (independent of the model)
        header = comm.bcast(self._header(addresses, version) if comm.rank0 else None)
        stream = HFStream(
            model_module, self.model_cfg, self.bucket_bytes, gather_experts=header["mode"] == "distributed"
        )
        plan, bad = {n: shape for n, (shape, _) in stream.plan().items()}, stream.nonfinite()
        # size: 16 bytes and at most one tensor name per rank (the plan's digest, not the plan)
        checked = comm.gather((plan_digest(plan), bad))
        verdict = self._check_plans(checked) if comm.rank0 else None
        # size: None, "detail" or one error line; on "detail" the digests disagree: which tensors (sends nothing)
        if (verdict := comm.bcast(verdict)) == "detail":
            # size: every rank's names x shapes, once, only on this error path (nothing is sent after it)
            detail = comm.gather(plan)
            verdict = self._plan_detail(detail) if comm.rank0 else None
            verdict = comm.bcast(verdict)  # size: one error line
        if verdict is not None:
            raise WeightSyncError(verdict)
        self._stream(stream, comm, header, flush_cache)
        return time.perf_counter() - t0

    def push(
        self, hf_state: Mapping[str, torch.Tensor], addresses: Sequence[str], version: str, flush_cache: bool = True
    ) -> None:
        """Check, (quantise,) and load a ready HF state dict into every server as ``version`` from this process
        alone (tests, benchmarks, tools; the trainer streams with ``sync``). ``flush_cache`` as in ``sync``."""
        check_weights(hf_state, self.reference)  # raises before anything is sent
        self._planned = {k: tuple(v.shape) for k, v in hf_state.items()}
        comm = RankComm(collective=False)
        self._stream(ws.DictStream(hf_state, self.bucket_bytes), comm, self._header(addresses, version), flush_cache)

    def load_dir(self, hf_dir: str | Path, addresses: Sequence[str], version: str) -> None:
        """Load an HF checkpoint dir (the run's export) into every server as ``version``, remembered like a push."""
        addresses = [a.rstrip("/") for a in addresses]
        self._again(
            version, lambda: update_weights_from_disk(addresses, hf_dir, version, self.timeout_s, keys=self.keys)
        )
        self.version = str(version)
        if self.digests:
            self.pushed.remember_hf_dir(version, hf_dir)
        else:
            self.pushed.remember(version, {})

    # ------------------------------------------------------------------ inside a sync
    def _header(self, addresses: Sequence[str], version: str) -> dict:
        """What rank 0 tells every rank at the start of a sync."""
        if not version:
            raise ValueError("weight version is empty; expected a label such as 'step-12'")
        return {
            "mode": self.mode,
            "addresses": [a.rstrip("/") for a in addresses],
            "version": str(version),
            "headers": self.keys.headers(admin=True) if self.keys else {},
        }

    def _check_plans(self, checked: list) -> str | None:
        """Rank 0: every rank's ``(plan_digest, first non-finite tensor)`` -> None, ``"detail"`` (the digests
        disagree with the served model's: gather the plans to say which tensors), or why nothing may be sent."""
        bad = [(r, name) for r, (_, name) in enumerate(checked) if name is not None]
        if bad:
            return f"weights to sync: {bad[0][1]} (rank {bad[0][0]}) holds NaN or Inf values; nothing was sent"
        count, total = sum(c for (c, _), _ in checked), sum(t for (_, t), _ in checked) % (1 << 64)
        if self.reference is not None:
            expected = plan_digest(self.reference)
        else:
            expected = self.plan_digest  # None before the first sync: nothing to compare with
        if expected is not None and (count, total) != expected:
            return "detail"
        self._planned = (count, total)
        return None

    def _plan_detail(self, plans: list) -> str:
        """Rank 0, after the digests disagreed: which names or shapes differ (``check_shapes``' message)."""
        shapes = {n: shape for plan in plans for n, shape in plan.items()}
        try:
            check_shapes(shapes, self.reference)
        except WeightSyncError as err:
            return str(err)
        dup = sum(len(p) for p in plans) - len(shapes)
        return (
            f"weights to sync do not match the last sync: {len(shapes)} tensors"
            f"{f' ({dup} sent by two ranks)' if dup else ''}, the last sync sent {self.plan_digest[0]}; nothing was sent"
        )

    def _stream(self, stream, comm, header: dict, flush_cache: bool) -> None:
        """Attempts (collective) until one succeeds, through ``_again``; every rank gets the same outcome."""

        def attempt():
            if (outcome := self._attempt(stream, comm, header, flush_cache)) is not None:
                err = WeightSyncError(outcome[1])
                err.foreign_label = outcome[0]
                raise err

        self._again(header["version"], attempt)

    def _attempt(self, stream, comm, header: dict, flush_cache: bool) -> tuple[bool, str] | None:
        """One push over ``header['mode']``'s transport (collective): None, or ``(foreign, message)``."""
        mode, addresses, version, headers = header["mode"], header["addresses"], header["version"], header["headers"]
        start = None
        if comm.rank0:
            if mode == "disk":
                start = {"tmp": str(begin_dir(self.export_dir)), "refused": {}}
            else:
                start = {"tmp": None, "refused": ws.begin(addresses, headers, self.timeout_s)}
        start = comm.bcast(start)  # size: a path and at most one refusal line per server
        if start["refused"]:  # nothing was sent: every server keeps its previous weights
            if comm.rank0:
                ws.end([a for a in addresses if a not in start["refused"]], headers, self.timeout_s)
            return False, f"weight sync to version {version!r} failed: " + "; ".join(
                f"{a} keeps its previous weights: {m}" for a, m in start["refused"].items()
            )
        sender = self._sender(mode, stream, start, header) if stream.sender else None
        digests: dict[str, str] = {}  # of every tensor this rank sends, as sent (served_weights.tensor_digest)
        for stage in range(stream.stages):  # pipeline stages take turns (one source and group each)
            if stage == stream.stage:
                for bucket in stream.buckets():
                    named = quantize_state_dict(dict(bucket), self.weight_quantization)
                    if self.digests:
                        digests.update(tensor_digests(named))
                    sender.send(list(named.items()))
                    del named, bucket
            comm.barrier_if(stream.stages > 1)
        self.sent_bytes = sender.bytes if sender else 0
        # size: this rank's sender report (per server address; disk: its files' names) and one ~50-byte digest
        # string per tensor it sent, received by rank 0 at its own size (no padding), which keeps them all anyway
        reports = comm.gather((sender.report() if sender else None, digests))
        outcome = self._finish(header, start, reports, flush_cache) if comm.rank0 else None
        return comm.bcast(outcome)  # size: None or (flag, one line per server)

    def _sender(self, mode: str, stream, start: dict, header: dict):
        if mode == "disk":
            return ws.DiskSender(start["tmp"], RankComm(collective=True).rank)
        args = (header["addresses"], header["version"], header["headers"], self.timeout_s)
        if mode == "tensor":
            return ws.TensorSender(*args)
        options = stage_group_options(self.group_options, stream.stage)  # this stage's address and port
        self.group = WeightGroup.reuse(
            self.group, header["addresses"], timeout_s=self.timeout_s, headers=header["headers"], **options
        )
        return ws.GroupSender(self.group, *args)

    def _finish(self, header: dict, start: dict, reports: list, flush_cache: bool) -> tuple[bool, str] | None:
        """Rank 0 after every rank streamed: end the session, label, verify; remember the push."""
        mode, addresses, version, headers = header["mode"], header["addresses"], header["version"], header["headers"]
        sent = [r for r, _ in reports if r is not None]
        if mode == "disk":
            path = finish_dir(
                Path(start["tmp"]),
                self.export_dir,
                [(r["weight_map"], r["total_size"]) for r in sent],
                self.model_cfg,
                self.template_dir,
            )
            try:
                update_weights_from_disk(
                    addresses, path, version, self.timeout_s, keys=self.keys, flush_cache=flush_cache
                )
            except WeightSyncError as err:
                return bool(getattr(err, "foreign_label", False)), str(err)
            self._done(version)
            self.pushed.remember(version, {n: d for _, ds in reports for n, d in ds.items()})
            return None
        loaded = {a: sum(r["loaded"][a] for r in sent) for a in addresses}
        errors = {a: next((r["errors"][a] for r in sent if r["errors"][a]), None) for a in addresses}
        ws.end(addresses, headers, self.timeout_s)
        ok = [a for a in addresses if errors[a] is None]
        errors |= ws.publish(ok, version, flush_cache, headers, self.timeout_s)
        failures, foreign = [], False
        for address in addresses:
            try:
                if errors[address] is not None:
                    raise WeightSyncError(errors[address])
                check_version([address], version, self.keys)
            except WeightSyncError as err:
                foreign = foreign or bool(getattr(err, "foreign_label", False))
                if loaded[address] > 0:
                    self.invalid[address] = f"{address}: {err}"
                    failures.append(f"{address} is left half-updated and marked invalid: {err}")
                else:
                    failures.append(f"{address} keeps its previous weights: {err}")
                continue
            self.invalid.pop(address, None)
        if failures:
            return foreign, f"weight sync to version {version!r} failed: " + "; ".join(failures)
        self._done(version)
        self.pushed.remember(version, {n: d for _, ds in reports for n, d in ds.items()})
        return None

    def _done(self, version: str) -> None:
        if isinstance(self._planned, dict):  # a push from a ready state dict: its names and shapes
            self.reference = dict(self._planned)
            self.plan_digest = plan_digest(self.reference)
        else:  # a sync: what was sent matched the reference (when there is one); its digest is the next sync's
            self.plan_digest = self._planned
        self.version = str(version)

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
                    raise ForeignWeightsStop(
                        f"{what}the push of {version!r} failed {attempt + 1} time(s) in a row "
                        f"(rollout.max_foreign_syncs={self.max_foreign_syncs}): {err}"
                    ) from None
                logger.warning(
                    "%s%s; pushing %r again (%d/%d)", what, err, version, attempt + 1, self.max_foreign_syncs
                )

    def close(self) -> None:
        """Tear down this rank's distributed weight-update group (servers and here); a later sync opens a new one."""
        if self.group is not None:
            self.group.close()
            self.group = None
