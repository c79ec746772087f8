"""The trainer's weight pushes: one owner for exporting the learner, labelling versions and syncing the servers.

Owns ``<run>/hf/current`` (the HF export the servers start from, and what a disk sync reads), the version label
``step-<s>-<nonce>`` (``moe_rl.rollout.integrity.version_label``), the run's ``WeightSync`` (created at the first push:
its mode depends on the servers' hosts) and, in async mode, the handshake around a push with the batch source
(``push_section`` while it runs, ``weights_pushed`` after). Every rank takes part in the export and in the collective
parts of a sync; rank 0 talks to the servers.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from moe_rl.config.hf_model import side_files_dir
from moe_rl.train.collectives import barrier

__all__ = ["WeightPusher"]


class WeightPusher:
    """``export()``, ``version(step)``, ``push(addresses, step)``, ``resync(addresses, step)``, ``close()``."""

    def __init__(self, cfg, learner, run_dir: Path, nonce: str, is_main: bool):
        self.cfg, self.learner, self.nonce, self.is_main = cfg, learner, nonce, is_main
        self.export_dir = Path(run_dir) / "hf" / "current"
        self.keys = None  # the run's server keys (the trainer sets them before any server starts)
        self.source = None  # async: rank 0's producer, told of every push (the trainer sets it)
        self.sync = None  # the WeightSync, created at the first push
        self._lock = threading.RLock()  # one push at a time: the step's push, a re-sync (any thread)

    def export(self) -> Path:
        """Export the learner as an HF dir for SGLang (collective); the path of the live copy."""
        from moe_rl.learner.hf_export import export_hf_checkpoint
        from moe_rl.rollout.weight_checks import quantize_state_dict

        fmt = self.cfg.rollout.weight_quantization
        export_hf_checkpoint(self.learner.module, self.cfg.model, self.export_dir, template_dir=side_files_dir(self.cfg),
                             bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20,
                             transform=None if fmt == "none" else lambda named: quantize_state_dict(named, fmt))  # fmt: skip
        barrier()
        return self.export_dir

    def version(self, step: int) -> str:
        """The weight-version label of ``step``: ``step-<step>-<nonce>`` (the nonce derived from the run id)."""
        from moe_rl.rollout.integrity import version_label

        return version_label(step, self.nonce)

    def weight_sync(self, addresses: list[str]):
        """The run's ``WeightSync`` (created at first use)."""
        from moe_rl.rollout.weights import WeightSync

        if self.sync is None:
            self.sync = WeightSync.from_config(self.cfg, addresses, export_dir=self.export_dir, keys=self.keys)
        return self.sync

    def push(self, addresses: list[str], step: int) -> float:
        """Load the learner into every server as ``version(step)`` (collective): tensors through shared memory for
        servers on this host, an HF checkpoint on disk otherwise (``rollout.weight_sync``); seconds taken."""
        around = lambda: self._push_section(addresses, step)
        seconds = self.weight_sync(addresses).sync(self.learner.module, addresses if self.is_main else [],
                                                   self.version(step), around_push=around)  # fmt: skip
        if self.source is not None:
            self.source.weights_pushed(step)  # (already, unless the sync pushed nothing)
        return seconds

    @contextlib.contextmanager
    def _push_section(self, addresses: list[str], step: int):
        """pause (or wait) -> update -> publish ``step`` -> continue. Async: the new version is published before
        the producer may admit a batch or a paused request continues, so nothing made by the new weights is
        labelled with the old version (with max_staleness >= 2 a batch admitted in between was). The push lock
        is taken inside the section, once the batch in flight has finished (its own re-sync needs the lock)."""
        if self.source is None:
            with self._lock:
                yield {}
            return
        from moe_rl.train.producer import push_section

        with push_section(self.source, self.cfg.rollout, addresses, self.keys) as push_kwargs, self._lock:
            yield push_kwargs
            self.source.weights_pushed(step)

    def resync(self, addresses: list[str], step: int) -> None:
        """Push the served weights again (rank 0: at the start, after a restart, a version mismatch or foreign
        weights), labelled with the version they are: the last one pushed, or ``version(step)`` before any push
        (a paused push may have moved past the batch's own version). Under the push lock: never inside another
        push (a restart on the producer thread used to end the main thread's update session, or destroy the
        group it broadcast on). Remembered with its fingerprint like every push."""
        with self._lock:
            ws = self.weight_sync(addresses)
            label = ws.version or self.version(step)
            if ws.last_state is not None:
                ws.close()  # distributed: a restarted server lost its group; the full sync rendezvouses again
                ws.push(ws.last_state, addresses, label)  # a full sync: clears any half-updated state
                return
            ws.load_dir(self.export_dir, addresses, label)

    def export_final(self) -> None:
        """``<run>/hf/current`` holds the final weights whatever the sync path (a disk sync wrote them already)."""
        if self.sync is not None and self.sync.mode != "disk":
            self.export()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()  # distributed: the weight-update group, on the servers and here
