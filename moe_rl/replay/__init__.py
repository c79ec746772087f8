"""Replay layer: R2/R3 routing replay bound to a Megatron-Core model, Keep Sampling Mask,
and router alignment (flip-rate) metrics. See docs/replay.md."""

from moe_rl.replay.binding import RoutingReplay, unsupported_router_options
from moe_rl.replay.driver import ROUTING_MODES, MicrobatchRoutes, ReplayDriver
from moe_rl.replay.keep_mask import KeepMaskResult, KeptSets, keep_mask_logprobs
from moe_rl.replay.layer_hook import ReplayError, RouteCapture
from moe_rl.replay.layout import (
    context_parallel_shard,
    from_megatron_layout,
    pack_microbatch_routes,
    sequence_parallel_shard,
    to_megatron_layout,
)
from moe_rl.replay.metrics import FlipCounter, expert_set_flips

__all__ = [
    "ROUTING_MODES",
    "FlipCounter",
    "KeepMaskResult",
    "KeptSets",
    "MicrobatchRoutes",
    "ReplayDriver",
    "ReplayError",
    "RouteCapture",
    "RoutingReplay",
    "context_parallel_shard",
    "expert_set_flips",
    "from_megatron_layout",
    "keep_mask_logprobs",
    "pack_microbatch_routes",
    "sequence_parallel_shard",
    "to_megatron_layout",
    "unsupported_router_options",
]
