"""R2 / R3 / natural routing over one RL step, and the router alignment metrics it yields.

Owns which routes each learner pass uses (``replay.routing`` in the config) and the flip
counters; it must not run forwards itself. Policy (seed 001, Zheng et al. 2025; field-facts.md
"R2 vs R3"):

- ``r3``: the rollout records' routes are replayed in the old-log-prob pass and in every
  update minibatch.
- ``r2``: the learner's own routes are recorded in the old-log-prob pass (decoupled mode) and
  replayed in every update minibatch.
- ``none``: natural routing everywhere (routes are still observed for the metrics).

Metrics per step (no extra forward; names ``replay/<comparison>/...``):
``rollout_vs_natural`` rollout routes vs the learner's natural top-k, ``rollout_vs_applied``
rollout vs the routes the learner actually used (exactly 0 under R3), ``r2_vs_natural`` R2's
record vs the current policy's natural top-k. Under replay a layer's "natural" top-k is what
it would pick given the replayed routing of the layers before it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from moe_rl.records.routes import pad_routes
from moe_rl.replay.binding import RouteCapture, RoutingReplay
from moe_rl.replay.metrics import FlipCounter

__all__ = ["MicrobatchRoutes", "ReplayDriver", "ROUTING_MODES"]

ROUTING_MODES = ("none", "r2", "r3")


@dataclass
class MicrobatchRoutes:
    """What the driver needs of one learner microbatch.

    ``sample_ids``: B stable ids (R2 keys its records by them, so update minibatches may
    regroup samples). ``rollout[B, S, L_moe, K]``: the rollout routes packed with
    ``pack_microbatch_routes`` (None if the rollout returned none). ``valid[B, S]``: input
    positions that carry a real rollout route (excludes padding).
    """

    sample_ids: Sequence[int]
    valid: torch.Tensor
    rollout: torch.Tensor | None = None


class ReplayDriver:
    """Chooses the routes of each pass for ``mode`` in ``ROUTING_MODES`` and accumulates metrics."""

    def __init__(self, replay: RoutingReplay, mode: str, correction_mode: str = "decoupled"):
        if mode not in ROUTING_MODES:
            raise ValueError(f"replay.routing must be one of {ROUTING_MODES}; got {mode!r}")
        if mode == "r2" and correction_mode != "decoupled":
            raise ValueError(
                "replay.routing='r2' needs correction.mode='decoupled' (it records routes in the old-log-prob "
                f"pass, which correction.mode={correction_mode!r} does not run)"
            )
        tcfg = replay.config
        sharded = tcfg.context_parallel_size > 1 or (tcfg.sequence_parallel and tcfg.tensor_model_parallel_size > 1)
        if mode == "r2" and sharded:
            raise ValueError(
                "replay.routing='r2' keeps per-sample records of unsharded sequences; context parallel and "
                "sequence parallel (tp > 1) are not supported with it yet -- use replay.routing='r3'"
            )
        self.replay = replay
        self.mode = mode
        self._r2_records: dict[int, torch.Tensor] = {}  # sample id -> local routes [S, L_local, K]
        self._counters: dict[str, FlipCounter] = {}

    @classmethod
    def from_config(cls, model, cfg) -> ReplayDriver:
        """Driver for ``cfg.replay.routing`` bound to ``model`` (an ``ExperimentConfig``)."""
        return cls(RoutingReplay(model), cfg.replay.routing, cfg.correction.mode)

    # ------------------------------------------------------------------ passes
    @contextlib.contextmanager
    def old_logprob_pass(self, microbatches: Sequence[MicrobatchRoutes]) -> Iterator[RouteCapture]:
        """Context for the old-log-prob forwards, one per microbatch in order."""
        if self.mode == "r2":
            self._r2_records.clear()
            with self.replay.record() as cap:
                yield cap
            for i, mb in enumerate(microbatches):
                rec = cap.recorded(i)
                for b, sid in enumerate(mb.sample_ids):
                    self._r2_records[int(sid)] = rec[b]
                self._count("rollout_vs_natural", mb, mb.rollout, rec)
            return
        with self._rollout_or_natural(microbatches) as cap:
            yield cap

    @contextlib.contextmanager
    def update_pass(self, microbatches: Sequence[MicrobatchRoutes]) -> Iterator[RouteCapture]:
        """Context for one update minibatch: forwards *and backwards* of its microbatches."""
        if self.mode != "r2":
            with self._rollout_or_natural(microbatches) as cap:
                yield cap
            return
        given = [self._r2_routes(mb) for mb in microbatches]
        with self.replay.replay(given, local=True) as cap:
            yield cap
        for i, (mb, r2) in enumerate(zip(microbatches, given)):
            self._count("r2_vs_natural", mb, r2, cap.natural(i))
            self._count("r2_vs_applied", mb, r2, cap.applied(i))
            self._count("rollout_vs_natural", mb, mb.rollout, cap.natural(i))

    @contextlib.contextmanager
    def _rollout_or_natural(self, microbatches: Sequence[MicrobatchRoutes]) -> Iterator[RouteCapture]:
        if self.mode == "r3":
            missing = [i for i, mb in enumerate(microbatches) if mb.rollout is None]
            if missing:
                raise ValueError(
                    f"replay.routing='r3' but microbatches {missing} carry no rollout routes; start SGLang with "
                    "--enable-return-routed-experts and request return_routed_experts=true"
                )
            with self.replay.replay([mb.rollout for mb in microbatches]) as cap:
                yield cap
            for i, mb in enumerate(microbatches):
                self._count("rollout_vs_natural", mb, mb.rollout, cap.natural(i))
                self._count("rollout_vs_applied", mb, mb.rollout, cap.applied(i))
            return
        with self.replay.record() as cap:
            yield cap
        for i, mb in enumerate(microbatches):
            self._count("rollout_vs_natural", mb, mb.rollout, cap.recorded(i))

    def _r2_routes(self, mb: MicrobatchRoutes) -> torch.Tensor:
        """Stack R2 records of ``mb.sample_ids`` into local ``[B, S, L_local, K]`` for S = valid's width."""
        S = mb.valid.shape[1]
        rows = []
        for b, sid in enumerate(mb.sample_ids):
            rec = self._r2_records.get(int(sid))
            if rec is None:
                raise KeyError(f"sample id {sid} has no R2 record; was it in this step's old-log-prob pass?")
            if rec.shape[0] >= S:
                rows.append(rec[:S])
                continue
            pad = pad_routes(S - rec.shape[0], rec.shape[1], rec.shape[2], self.replay.num_experts, start=b * S)
            rows.append(torch.cat([rec, torch.from_numpy(pad.astype("int64"))]))
        return torch.stack(rows)

    # ------------------------------------------------------------------ metrics
    def _count(self, name: str, mb: MicrobatchRoutes, reference, other: torch.Tensor) -> None:
        if reference is None:
            return
        ids = self.replay.moe_layer_ids
        if reference.shape[2] != len(ids):  # global rollout routes: keep this stage's layers
            reference = reference[:, :, ids]
        if reference.shape[1] != other.shape[1]:
            return  # sequence-sharded (SP / CP) comparisons need the shard layout; skipped
        counter = self._counters.setdefault(name, FlipCounter(f"replay/{name}", ids))
        counter.add(reference, other, mb.valid)

    def step_metrics(self, reset: bool = True) -> dict[str, float]:
        """Flip metrics accumulated since the last reset (see module docstring for the names)."""
        out: dict[str, float] = {}
        for counter in self._counters.values():
            out.update(counter.summary())
        if reset:
            self._counters.clear()
        return out
