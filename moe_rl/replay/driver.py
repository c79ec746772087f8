"""R2 / R3 / natural routing over one RL step, and the router alignment metrics it yields.

Owns which routes each learner pass uses (``replay.routing`` in the config) and the flip
counters; it must not run forwards itself. Policy (seed 001, Zheng et al. 2025; field-facts.md
"R2 vs R3"):

- ``r3``: the rollout records' routes are replayed in the old-log-prob pass and in every
  update minibatch.
- ``r2``: the learner's own routes are recorded in the old-log-prob pass (decoupled mode) and
  replayed in every update minibatch.
- ``none``: natural routing everywhere; no replay is bound to the model (so router options
  that replay cannot honour stay allowed), routes are only observed.

Under pipeline parallelism each stage binds and probes only its own MoE layers; the flips of a
microbatch are gathered over the stages before counting, so every stage logs the whole model's
per-layer rates and ``tokens_with_flip`` over all layers.

Under sequence parallel (tp > 1) each router sees only its rank's block of positions: the routes and
masks are cut to that block with the shard the binding replays with
(``layout.sequence_parallel_positions``; context parallel likewise), and the counts are summed over
the tensor- / context-parallel ranks as well as the data-parallel ones, so the comparison still covers
every token and can still fail.

Metrics per step, counted in the update passes over positions that score a response token
(``response``) and, separately, the prompt positions before them (``prompt``); names
``replay/<comparison>/<response|prompt>/{flip_rate, flip_rate/layer<i>, tokens_with_flip}``:

- ``rollout_vs_dispatched``: the rollout's routes vs the experts Megatron's dispatcher actually
  received (``DispatchProbe``). Exactly 0 under working R3; any unbound or bypassed router shows.
- ``rollout_vs_natural``: the rollout's routes vs the learner's own top-k (under replay, what a
  layer would pick given the replayed routing of the layers before it).
- ``r2_vs_dispatched`` / ``r2_vs_natural`` (R2): the old-policy record vs what was dispatched /
  what the current policy would pick.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from moe_rl.config.rollout_sections import replay_correction_problem
from moe_rl.records.routes import pad_routes
from moe_rl.replay.binding import RoutingReplay
from moe_rl.replay.dispatch_probe import DispatchCapture, DispatchProbe
from moe_rl.replay.layout import context_parallel_shard, sequence_parallel_positions
from moe_rl.replay.metrics import FlipCounter, expert_set_flips, routes_vs_map_flips

__all__ = ["ROUTING_MODES", "MicrobatchRoutes", "ReplayDriver"]

ROUTING_MODES = ("none", "r2", "r3")


@dataclass
class MicrobatchRoutes:
    """What the driver needs of one learner microbatch.

    ``sample_ids``: B stable ids (R2 keys its records by them). ``valid[B, S]``: real input
    positions (not padding). ``rollout[B, S, L_moe, K]``: the rollout routes packed with
    ``pack_microbatch_routes`` (None if the rollout returned none). ``response[B, S]``: positions
    that score a response token (the metrics' ``response`` class; ``valid & ~response`` is ``prompt``).
    """

    sample_ids: Sequence[int]
    valid: torch.Tensor
    rollout: torch.Tensor | None = None
    response: torch.Tensor | None = None


class ReplayDriver:
    """Chooses the routes of each pass for ``mode`` in ``ROUTING_MODES`` and accumulates metrics."""

    def __init__(self, model, mode: str, correction_mode: str = "decoupled"):
        if mode not in ROUTING_MODES:
            raise ValueError(f"replay.routing must be one of {ROUTING_MODES}; got {mode!r}")
        if (problem := replay_correction_problem(mode, correction_mode)) is not None:  # the schema's rule
            raise ValueError(problem)
        self.probe = DispatchProbe(model)
        self.replay = RoutingReplay(model) if mode != "none" else None
        tcfg = unwrap_model(model).config
        sharded = tcfg.context_parallel_size > 1 or (tcfg.sequence_parallel and tcfg.tensor_model_parallel_size > 1)
        if mode == "r2" and sharded:
            raise ValueError(
                "replay.routing='r2' keeps per-sample records of unsharded sequences; context parallel and "
                "sequence parallel (tp > 1) are not supported with it yet -- use replay.routing='r3'"
            )
        self.mode = mode
        self.num_experts = tcfg.num_moe_experts
        self.shard = DispatchShard.of(tcfg) if sharded else DispatchShard()
        self._r2_records: dict[int, torch.Tensor] = {}  # sample id -> local routes [rows, L_local, K]
        self._pp_group = _pipeline_group()
        self._counters: dict[str, FlipCounter] = {}

    @classmethod
    def from_config(cls, model, cfg) -> ReplayDriver:
        """Driver for ``cfg.replay.routing`` bound to ``model`` (an ``ExperimentConfig``)."""
        return cls(model, cfg.replay.routing, cfg.correction.mode)

    @property
    def layer_ids(self) -> list[int]:
        """Global MoE-layer index of each router this rank holds."""
        return self.probe.moe_layer_ids

    # ------------------------------------------------------------------ passes
    @contextlib.contextmanager
    def old_logprob_pass(self, microbatches: Sequence[MicrobatchRoutes]) -> Iterator[None]:
        """Context for the old-log-prob forwards, one per microbatch in order (R2 records here)."""
        if self.mode == "r2":
            with self.replay.record() as cap:
                yield
            for i, mb in enumerate(microbatches):
                rec = cap.recorded(i)
                lengths = mb.valid.sum(dim=1)
                for b, sid in enumerate(mb.sample_ids):
                    self._r2_records[int(sid)] = rec[b, : int(lengths[b])].cpu()
            return
        with self._routing(self._replayed_routes(microbatches), observe_natural=False):
            yield

    @contextlib.contextmanager
    def update_pass(self, microbatches: Sequence[MicrobatchRoutes]) -> Iterator[None]:
        """Context for one update minibatch: forwards *and backwards* of its microbatches; counts flips."""
        given = self._replayed_routes(microbatches)
        with self.probe.capture() as dispatched, self._routing(given, observe_natural=True) as cap:
            yield
        self._count_update(microbatches, dispatched, cap, given)

    @contextlib.contextmanager
    def prepass(self, microbatches: Sequence[MicrobatchRoutes]) -> Iterator[None]:
        """Context for a no-grad forward of an update minibatch with its update routing (no metrics)."""
        with self._routing(self._replayed_routes(microbatches), observe_natural=False):
            yield

    def _replayed_routes(self, microbatches) -> list[torch.Tensor] | None:
        """The routes each microbatch is replayed with: the rollout's (R3), the records' (R2), none (natural)."""
        if self.mode == "none":
            return None
        if self.mode == "r3":
            missing = [i for i, mb in enumerate(microbatches) if mb.rollout is None]
            if missing:
                raise ValueError(
                    f"replay.routing='r3' but microbatches {missing} carry no rollout routes; start SGLang with "
                    "--enable-return-routed-experts and request return_routed_experts=true"
                )
            return [mb.rollout for mb in microbatches]
        return [self.r2_routes(mb) for mb in microbatches]

    @contextlib.contextmanager
    def _routing(self, given: list[torch.Tensor] | None, observe_natural: bool):
        if given is None:
            yield None
            return
        with self.replay.replay(given, local=self.mode == "r2", observe_natural=observe_natural) as cap:
            yield cap

    def r2_routes(self, mb: MicrobatchRoutes) -> torch.Tensor:
        """R2 records of ``mb.sample_ids`` as local ``[B, S, L_local, K]`` for S = valid's width."""
        S = mb.valid.shape[1]
        rows = []
        for b, sid in enumerate(mb.sample_ids):
            rec = self._r2_records.get(int(sid))
            if rec is None:
                raise KeyError(
                    f"sample id {sid} has no R2 record on this rank; the step plan must give every rank the "
                    "samples it scored in the old-log-prob pass"
                )
            if rec.shape[0] >= S:
                rows.append(rec[:S])
                continue
            pad = pad_routes(S - rec.shape[0], rec.shape[1], rec.shape[2], self.num_experts, start=b * S)
            rows.append(torch.cat([rec, torch.from_numpy(pad.astype("int64")).to(rec.device)]))
        return torch.stack(rows)

    @contextlib.contextmanager
    def using(self, mode: str) -> Iterator[None]:
        """Temporarily route as ``mode`` (``none`` / ``r3``; e.g. the diagnose settings); R3 needs a bound replay."""
        if mode not in ("none", "r3") or (mode == "r3" and self.replay is None):
            raise ValueError(f"cannot switch this driver (replay.routing={self.mode!r}) to routing {mode!r}")
        saved, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = saved

    def begin_step(self) -> None:
        """Forget the previous step's R2 records."""
        self._r2_records.clear()

    # ------------------------------------------------------------------ metrics
    def _count_update(self, microbatches, dispatched: DispatchCapture, cap, given) -> None:
        local = self.layer_ids
        for i, mb in enumerate(microbatches):
            maps = dispatched.maps(i)  # [B, S_local, L_local, E]: this rank's block of positions
            valid, response = self.shard.positions(mb.valid), self.shard.positions(mb.response)
            rollout = None if mb.rollout is None else self.shard.positions(mb.rollout[:, :, local])
            natural = cap.natural(i) if cap is not None else None
            if rollout is not None:
                self._add("rollout_vs_dispatched", valid, response, routes_vs_map_flips(rollout, maps))
                self._add("rollout_vs_natural", valid, response, self._natural_flips(rollout, natural, maps))
            if self.mode == "r2":  # R2 refuses sharded sequences: given[i] is this rank's whole sequence
                r2 = given[i]
                self._add("r2_vs_dispatched", valid, response, routes_vs_map_flips(r2, maps))
                self._add("r2_vs_natural", valid, response, self._natural_flips(r2, natural, maps))

    def _natural_flips(self, reference, natural, maps) -> torch.Tensor:
        """``reference[B, S, L, K]`` vs the learner's natural top-k on every probed layer ``[B, S, L]``.

        Under replay the binding observes each bound layer's natural top-k; a layer routing
        naturally (no replay, or not bound) dispatched its natural choice, so its map is used.
        """
        flips = routes_vs_map_flips(reference, maps)
        if natural is None:
            return flips
        bound = {lid: j for j, lid in enumerate(self.replay.moe_layer_ids)}
        for col, lid in enumerate(self.layer_ids):
            if lid in bound:
                flips[..., col] = expert_set_flips(reference[..., col, :].cpu(), natural[..., bound[lid], :].cpu())
        return flips

    def _add(self, name: str, valid: torch.Tensor, response: torch.Tensor | None, flips: torch.Tensor) -> None:
        layer_ids = self.layer_ids
        if self._pp_group is not None:  # every stage counts the whole model's layers
            layer_ids, flips = gather_stage_flips(layer_ids, flips, self._pp_group)
        add_flip_counts(self._counters, name, layer_ids, valid, response, flips)

    def step_metrics(self, reset: bool = True, group=None) -> dict[str, float]:
        """Flip metrics since the last reset, summed over ``group`` (the data-parallel ranks) and, under
        sequence / context parallel, over the ranks holding the other blocks of each sequence."""
        out: dict[str, float] = {}
        for key in sorted(self._counters):
            counter = self._counters[key]
            counter.all_reduce(group)
            for shard_group in self.shard.groups():
                counter.all_reduce(shard_group)
            out.update(counter.summary())
        if reset:
            self._counters.clear()
        return out

    def close(self) -> None:
        """Release the routers (replay binding and probe hooks)."""
        if self.replay is not None:
            self.replay.close()
        self.probe.close()


def add_flip_counts(counters: dict, name: str, layer_ids, valid, response, flips: torch.Tensor) -> None:
    """Add ``flips[B, S, L]`` to ``counters['replay/<name>/{response,prompt}']`` over ``valid[B, S]`` positions
    split by ``response[B, S]`` (None: all valid positions are response positions)."""
    valid = valid.cpu().bool()
    response = valid if response is None else response.cpu().bool() & valid
    for part, where in (("response", response), ("prompt", valid & ~response)):
        key = f"replay/{name}/{part}"
        counters.setdefault(key, FlipCounter(key, layer_ids)).add_flips(flips, where)


@dataclass(frozen=True)
class DispatchShard:
    """Which positions of a sequence this rank's routers see: context-parallel chunks, then the
    sequence-parallel block (the shards ``RoutingReplay`` replays with). Default: all of them."""

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0

    @classmethod
    def of(cls, tcfg) -> DispatchShard:
        sp = bool(tcfg.sequence_parallel) and tcfg.tensor_model_parallel_size > 1
        cp = tcfg.context_parallel_size > 1
        return cls(
            tp_size=tcfg.tensor_model_parallel_size if sp else 1,
            tp_rank=ps.get_tensor_model_parallel_rank() if sp else 0,
            cp_size=tcfg.context_parallel_size,
            cp_rank=ps.get_context_parallel_rank() if cp else 0,
        )

    def positions(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``x[B, S, ...]`` -> the positions this rank routes, ``[B, S_local, ...]``."""
        if x is None:
            return None
        if self.cp_size > 1:
            x = context_parallel_shard(x, self.cp_size, self.cp_rank)
        return sequence_parallel_positions(x, self.tp_size, self.tp_rank)

    def groups(self) -> list:
        """The process groups over which the blocks of one sequence are spread (summed after the dp sum)."""

        out = []
        if self.tp_size > 1:
            out.append(ps.get_tensor_model_parallel_group())
        if self.cp_size > 1:
            out.append(ps.get_context_parallel_group())
        return out


def _pipeline_group():
    """Megatron's pipeline-parallel group when pp > 1 (each stage holds some of the MoE layers), else None."""

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_pipeline_model_parallel_group()


def gather_stage_flips(layer_ids, flips: torch.Tensor, group) -> tuple[list[int], torch.Tensor]:
    """This stage's ``flips[B, S, L_local]`` -> every stage's ``flips[B, S, L_all]`` in global layer order.

    Collective over the pipeline group: all stages saw the same tokens of the microbatch, each through
    its own MoE layers, so the per-token "any layer flipped" count needs the whole row of layers.
    """

    parts = [None] * dist.get_world_size(group)
    # size: this stage's layer ids and one bool per (token of the microbatch, local layer): grows with the batch
    # and the layer count, never with the weights
    dist.all_gather_object(parts, (list(layer_ids), flips.cpu()), group=group)
    ids = [lid for part_ids, _ in parts for lid in part_ids]
    merged = torch.cat([part for _, part in parts], dim=-1)
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return [ids[i] for i in order], merged[..., order]
