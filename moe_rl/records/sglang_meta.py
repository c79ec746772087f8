"""Decode one SGLang ``/generate`` reply's ``meta_info`` into record fields, with validation.

Owns the wire contract (field-facts.md, "SGLang <-> trainer wire format"):
``routed_experts`` is base64 int32 ``[seqlen - 1 - start_len, num_hidden_layers, top_k]``
with no row for the last generated token (it is never forwarded) and dense layers
as zeros; ``output_token_logprobs`` rows are ``(logprob, token_id, text)``;
``output_token_sampling_mask`` lists, per output token, the kept token ids, and
``output_token_sampling_logprobs`` the sampled token's log-prob renormalised over them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from moe_rl.records.routes import RecordError, check_distinct_experts, wire_to_routes

try:  # pybase64 is ~5x faster; plain base64 gives identical bytes
    import pybase64 as _b64
except ImportError:  # pragma: no cover - depends on the environment
    _b64 = base64


@dataclass(frozen=True)
class RouteSpec:
    """What the model says routes must look like."""

    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def from_model_config(cls, model_cfg) -> RouteSpec:
        pattern = model_cfg.moe_layer_pattern()
        return cls(
            num_hidden_layers=model_cfg.num_layers,
            moe_layer_ids=tuple(i for i, moe in enumerate(pattern) if moe),
            top_k=model_cfg.moe_router_topk,
            num_experts=model_cfg.num_moe_experts,
        )


@dataclass
class DecodedMeta:
    """Per-sample arrays decoded from ``meta_info``."""

    rollout_logp: np.ndarray  # float32 [R]
    routes: np.ndarray | None  # compact [P + R - 1 - start_len, L_moe, K]
    sampling_mask: list[np.ndarray] | None  # R x int32 kept ids
    sampling_logp: np.ndarray | None  # float32 [R], log-prob renormalised over the kept set
    weight_version: str
    finish_reason: str


def _per_token_field(meta_info: dict, key: str, response_len: int) -> list | None:
    """``meta_info[key]`` (None if absent), checked to hold one entry per response token."""
    values = meta_info.get(key)
    if values is not None and len(values) != response_len:
        raise RecordError(f"{key} has {len(values)} entries; expected one per response token ({response_len})")
    return values


def _checked_logprobs(key: str, raw: list) -> np.ndarray:
    """float32 ``[R]`` from raw per-token log-probs; names the first that is missing, non-finite or > 0."""
    try:
        values = np.array([np.nan if v is None else v for v in raw], dtype=np.float64)
    except (TypeError, ValueError):
        raise RecordError(f"{key} must hold one number per response token, got {str(raw)[:200]}") from None
    bad = ~np.isfinite(values) | (values > 1e-4)
    if bad.any():
        t = int(np.argmax(bad))
        raise RecordError(f"{key}[{t}] = {raw[t]!r}; expected a finite log-prob <= 0")
    return values.astype(np.float32)


def decode_logprobs(meta_info: dict, response_ids: np.ndarray) -> np.ndarray:
    """``output_token_logprobs`` rows ``(logprob, token_id, text)`` -> float32 ``[R]``; checks ids too."""
    rows = _per_token_field(meta_info, "output_token_logprobs", len(response_ids))
    if rows is None:
        raise RecordError("meta_info has no 'output_token_logprobs': send return_logprob=true in the request")
    values = _checked_logprobs("output_token_logprobs", [row[0] for row in rows])
    for t, row in enumerate(rows):
        if row[1] is not None and int(row[1]) != int(response_ids[t]):
            raise RecordError(
                f"output_token_logprobs[{t}] is for token {row[1]}, but response token {t} is {int(response_ids[t])}"
            )
    return values


def decode_sampling_mask(meta_info: dict, response_len: int, vocab_size: int | None) -> list[np.ndarray] | None:
    """``output_token_sampling_mask`` -> R int32 arrays of kept ids (None when the server sent none)."""
    masks = _per_token_field(meta_info, "output_token_sampling_mask", response_len)
    if masks is None:
        return None
    out = []
    for t, kept in enumerate(masks):
        ids = np.asarray(kept, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise RecordError(f"output_token_sampling_mask[{t}] must be a non-empty list of token ids")
        if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            raise RecordError(f"output_token_sampling_mask[{t}] has ids outside [0, {vocab_size})")
        out.append(ids.astype(np.int32))
    return out


def decode_sampling_logprobs(meta_info: dict, response_len: int) -> np.ndarray | None:
    """``output_token_sampling_logprobs`` ("selected" mode: one float per token) -> float32 ``[R]``.

    This is the engine's true behaviour log-prob under top-k/top-p truncation (renormalised over
    the kept set), the mu that Keep Sampling Mask compares against.
    """
    values = _per_token_field(meta_info, "output_token_sampling_logprobs", response_len)
    if values is None:
        return None
    if any(isinstance(v, (list, tuple)) for v in values):
        raise RecordError("output_token_sampling_logprobs must be one float per token (sampling_logprobs_mode='selected')")
    return _checked_logprobs("output_token_sampling_logprobs", values)


def decode_routes(meta_info: dict, prompt_len: int, response_len: int, spec: RouteSpec, start_len: int = 0) -> np.ndarray:
    """``routed_experts`` -> compact ``[P + R - 1 - start_len, L_moe, K]`` (dense layers dropped)."""
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        raise RecordError(
            "meta_info has no 'routed_experts': the request must send return_routed_experts=true and the server "
            "must run with --enable-return-routed-experts"
        )
    if not 0 <= start_len <= prompt_len:
        raise RecordError(f"routed_experts_start_len={start_len} must be in [0, prompt_len={prompt_len}]")
    if isinstance(encoded, (str, bytes)):
        try:  # validate=True takes pybase64's SIMD path and rejects non-alphabet characters
            raw = _b64.b64decode(encoded, validate=True)
        except ValueError as exc:
            raise RecordError(f"routed_experts is not valid base64: {exc}") from None
    else:  # some clients pass the int32 list through JSON
        raw = np.asarray(encoded, "<i4").tobytes()
    num_rows = prompt_len + response_len - 1 - start_len
    routes = wire_to_routes(raw, num_rows, spec.num_hidden_layers, spec.top_k, list(spec.moe_layer_ids), spec.num_experts)
    check_distinct_experts(routes, field="routed_experts")
    return routes


def decode_sglang_meta(
    meta_info: dict,
    prompt_len: int,
    response_ids: np.ndarray,
    spec: RouteSpec | None,
    vocab_size: int | None = None,
    start_len: int = 0,
) -> DecodedMeta:
    """Decode a whole ``meta_info``; ``spec=None`` means routes were not requested."""
    response_ids = np.asarray(response_ids)
    routes = None if spec is None else decode_routes(meta_info, prompt_len, len(response_ids), spec, start_len)
    finish = meta_info.get("finish_reason")
    finish_type = finish.get("type", "") if isinstance(finish, dict) else str(finish or "")
    return DecodedMeta(
        rollout_logp=decode_logprobs(meta_info, response_ids),
        routes=routes,
        sampling_mask=decode_sampling_mask(meta_info, len(response_ids), vocab_size),
        sampling_logp=decode_sampling_logprobs(meta_info, len(response_ids)),
        weight_version=str(meta_info.get("weight_version", "")),
        finish_reason=finish_type,
    )
