"""The trainer's weight pushes: one owner for exporting the learner, labelling versions and syncing the servers.

Owns ``<run>/hf/current`` (the HF export the servers start from, and what a disk sync reads), the version label
``step-<s>-<nonce>`` (``moe_rl.sync.integrity.version_label``), the run's ``WeightSync`` (created at the first push:
its mode depends on the servers' hosts) and, in async mode, the handshake around a push with the batch source
(``push_section`` while it runs, ``weights_pushed`` after). Every rank takes part in the export and in every sync
(a re-sync included: rank 0 starts it on every rank through ``rank0_calls``); rank 0 talks to the servers about the
session, the ranks that own tensors stream them. A re-sync is labelled with the version of the weights it pushes
(``live``: from the start of ``push(s)`` on, the learner holds version ``s``), and rank 0 restarts a server that died
since its last batch before it pauses or pushes (``revive``: the run's ``ServerPool.restart``).

What the trainer makes after the pusher (in ``run()``: the server keys, the server pool, the batch source) the pusher
is given at construction as callables (``keys``, ``revive``, ``source``) and asks for when a push needs it; nothing
is set on it from outside afterwards.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

from moe_rl.config.hf_model import side_files_dir
from moe_rl.learner.hf_export import export_hf_checkpoint
from moe_rl.rollout.auth import ServerKeys
from moe_rl.source.producer import push_section
from moe_rl.sync.checks import quantize_state_dict
from moe_rl.sync.integrity import version_label
from moe_rl.sync.weight_sync import WeightSync
from moe_rl.train.collectives import barrier
from moe_rl.train.rank0_calls import Rank0Calls

__all__ = ["WeightPusher"]


class WeightPusher:
    """``export()``, ``version(step)``, ``push(addresses, step)``, ``resync(addresses, step)``, ``close()``."""

    def __init__(
        self,
        cfg,
        learner,
        run_dir: Path,
        nonce: str,
        is_main: bool,
        *,
        keys: Callable[[], ServerKeys | None] = lambda: None,
        revive: Callable[[], list[str]] = list,
        source: Callable[[], object | None] = lambda: None,
    ):
        """``keys()``: the run's server keys (None before the trainer made them); ``revive()``: rank 0 restarts the
        servers dead since their last batch, returns their URLs (the run's pool's ``restart``); ``source()``: rank 0's
        batch source, told of every push (None before the trainer made it, and on the other ranks)."""
        self.cfg, self.learner, self.nonce, self.is_main = cfg, learner, nonce, is_main
        self.export_dir = Path(run_dir) / "hf" / "current"
        self._keys, self._source, self.revive = keys, source, revive
        self.sync = None  # the WeightSync, created at the first push
        self.live: int | None = None  # the version the learner's weights are (set at each push and the first load)
        self._lock = threading.RLock()  # one push at a time: the step's push, a re-sync (any thread)
        self._addresses: list[str] = []  # rank 0: the servers of the re-sync under way
        # collectives rank 0 starts while the others wait
        self.calls = Rank0Calls({"resync": self._resync_all, "reopen": self._reopen})

    @property
    def keys(self) -> ServerKeys | None:
        """The run's server keys (None before the trainer made them: the configured variables are used)."""
        return self._keys()

    @property
    def source(self):
        """Rank 0's batch source (a push waits for, or pauses, its batch in flight); None on the other ranks."""
        return self._source()

    def export(self) -> Path:
        """Export the learner as an HF dir for SGLang (collective); the path of the live copy."""
        fmt = self.cfg.rollout.weight_quantization
        export_hf_checkpoint(
            self.learner.module,
            self.cfg.model,
            self.export_dir,
            template_dir=side_files_dir(self.cfg),
            bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20,
            transform=None if fmt == "none" else lambda named: quantize_state_dict(named, fmt),
        )
        barrier()
        return self.export_dir

    def version(self, step: int) -> str:
        """The weight-version label of ``step``: ``step-<step>-<nonce>`` (the nonce derived from the run id)."""
        return version_label(step, self.nonce)

    def weight_sync(self, addresses: list[str]):
        """The run's ``WeightSync`` (created at first use)."""
        if self.sync is None:
            self.sync = WeightSync.from_config(self.cfg, addresses, export_dir=self.export_dir, keys=self.keys)
        return self.sync

    def push(self, addresses: list[str], step: int) -> float:
        """Load the learner into every server as ``version(step)`` (collective: every rank streams what it owns;
        ``rollout.weight_sync``); seconds taken. The other ranks wait in ``calls.follow()`` until rank 0 is inside
        its push section (where it may first run a re-sync the producer asked for)."""
        version, self.live = self.version(step), step
        ws = self.weight_sync(addresses)
        if not self.is_main:
            self.calls.follow()
            return ws.sync(self.learner.module, [], version)
        with self._push_section(addresses, step) as push_kwargs:
            self.calls.release()
            seconds = ws.sync(self.learner.module, addresses, version, **(push_kwargs or {}))
        if self.source is not None:
            self.source.weights_pushed(step)  # (already, unless the sync pushed nothing)
        return seconds

    @contextlib.contextmanager
    def _push_section(self, addresses: list[str], step: int):
        """pause (or wait) -> update -> publish ``step`` -> continue. Async: the new version is published before
        the producer may admit a batch or a paused request continues, so nothing made by the new weights is
        labelled with the old version (with max_staleness >= 2 a batch admitted in between was). The push lock
        is taken inside the section, once the batch in flight has finished (its own re-sync runs first)."""
        if self.source is None:
            with self._lock:
                self._revive_dead()
                yield {}
            return

        section = push_section(self.source, self.cfg.rollout, addresses, self.keys, before=self._revive_dead)
        with section as push_kwargs, self._lock:
            yield push_kwargs
            self.source.weights_pushed(step)

    def _revive_dead(self) -> None:
        """Rank 0, before a push pauses or updates the servers (the other ranks are in ``follow``): restart a server
        that died since its last batch (the push would fail on it); the push then syncs it too, through a new
        weight-update group (``distributed``: a restarted server lost its own) opened on every rank."""
        if self.revive():
            self.calls.call("reopen")

    def _reopen(self, _=None) -> None:
        if self.sync is not None:
            self.sync.close()

    def resync(self, addresses: list[str], step: int) -> int:
        """Push the served weights again (rank 0: at the start, after a restart, a version mismatch or foreign
        weights), labelled with the version they are (``live``), or ``version(step)`` before any push; that version.

        Before any push the servers' own export (``<run>/hf/current``, the live weights) is loaded (rank 0 alone).
        After one it is a sync from the live weights, **collective over every learner rank** (no rank keeps a copy
        of the model): rank 0 calls it on every rank (``rank0_calls``; from the producer thread it is run by the
        main thread at its next wait), never inside another push."""
        ws = self.weight_sync(addresses)
        if ws.version is None:
            with self._lock:
                ws.load_dir(self.export_dir, addresses, self.version(step))
                self.live = step
            return step
        self._addresses = list(addresses)
        return self.calls.call("resync")

    def _resync_all(self, _=None) -> int | None:
        """Every rank: the collective re-sync ``resync`` calls, labelled with the version the live weights are when it
        runs (rank 0's label reaches the others in the sync's header): inside a push section, before the update, they
        are already the new version, and were labelled the old one (the batch regenerated on them too); a new group
        under ``distributed`` (a restarted server lost its own). Rank 0: the version pushed."""
        with self._lock:
            addresses = self._addresses if self.is_main else []
            ws = self.weight_sync(addresses)
            ws.close()
            ws.sync(self.learner.module, addresses, self.version(self.live) if self.is_main else "")
            return self.live

    def served_state(self) -> dict | None:
        """What rank 0 knows the servers hold, for the rollout process's checks: the half-updated servers and the
        digests of every tensor of the version last pushed (None before the first push)."""
        ws = self.sync
        if ws is None or ws.version is None:
            return None
        return {
            "invalid": dict(ws.invalid),
            "label": ws.version,
            "digests": ws.pushed.by_label.get(ws.version),
            "version": self.live,
        }

    def export_final(self) -> None:
        """``<run>/hf/current`` holds the final weights whatever the sync path (a disk sync wrote them already)."""
        if self.sync is not None and self.sync.mode != "disk":
            self.export()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()  # distributed: the weight-update group, on the servers and here
