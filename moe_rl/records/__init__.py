"""Rollout records: the batch contract between the SGLang rollout engine and the learner."""

from moe_rl.records.batch import RolloutBatch, RolloutSample
from moe_rl.records.chunks import RecordMismatch
from moe_rl.records.routes import (
    RecordError,
    check_distinct_experts,
    compact_routes,
    pad_routes,
    route_dtype,
    routes_to_wire,
    wire_to_routes,
)
from moe_rl.records.sglang_meta import DecodedMeta, RouteSpec, decode_sglang_meta
from moe_rl.records.share import SharedRead, load_share

__all__ = [
    "DecodedMeta",
    "RecordError",
    "RecordMismatch",
    "RolloutBatch",
    "RolloutSample",
    "RouteSpec",
    "SharedRead",
    "check_distinct_experts",
    "compact_routes",
    "decode_sglang_meta",
    "load_share",
    "pad_routes",
    "route_dtype",
    "routes_to_wire",
    "wire_to_routes",
]
