"""Decode one SGLang ``/generate`` reply's ``meta_info`` into record fields, with validation.

Owns the wire contract (field-facts.md, "SGLang <-> trainer wire format"):
``routed_experts`` is base64 ``[seqlen - 1 - start_len, num_hidden_layers, top_k]`` expert ids
with no row for the last generated token (it is never forwarded) and dense layers as zeros,
int32 from upstream SGLang or ``meta_info["routed_experts_dtype"]`` (uint8 up to 256 experts,
else uint16) from moe_rl's patched server; ``output_token_logprobs`` rows are
``(logprob, token_id, text)``; the kept token ids of each output token come either as
``output_token_sampling_mask`` (upstream: one JSON list per token) or compactly as
``output_token_sampling_mask_ids`` (base64, ``output_token_sampling_mask_dtype`` uint16/int32,
all tokens' ids back to back) + ``output_token_sampling_mask_lengths`` (ids per token), and
``output_token_sampling_logprobs`` is the sampled token's log-prob renormalised over them.
Both forms of both fields are accepted, so older or unpatched servers keep working.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from moe_rl.records.routes import WIRE_ROUTE_DTYPES, RecordError, check_distinct_experts, wire_to_routes

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


MASK_ID_DTYPES = {"uint16": np.dtype("<u2"), "int32": np.dtype("<i4"), "uint32": np.dtype("<u4")}


def _b64decode_field(field: str, encoded) -> bytes:
    if not isinstance(encoded, (str, bytes)):
        raise RecordError(f"{field} must be a base64 string, got {type(encoded).__name__}")
    try:  # validate=True takes pybase64's SIMD path and rejects non-alphabet characters
        return _b64.b64decode(encoded, validate=True)
    except ValueError as exc:
        raise RecordError(f"{field} is not valid base64: {exc}") from None


def _decode_compact_masks(meta_info: dict, response_len: int, vocab_size: int | None) -> list[np.ndarray]:
    """``output_token_sampling_mask_ids`` + ``_lengths`` (+ ``_dtype``) -> R int32 arrays of kept ids."""
    dtype_name = meta_info.get("output_token_sampling_mask_dtype", "int32")
    dtype = MASK_ID_DTYPES.get(dtype_name)
    if dtype is None:
        raise RecordError(f"output_token_sampling_mask_dtype={dtype_name!r}; expected one of {sorted(MASK_ID_DTYPES)}")
    lengths = _per_token_field(meta_info, "output_token_sampling_mask_lengths", response_len)
    if lengths is None:
        raise RecordError("meta_info has output_token_sampling_mask_ids but no output_token_sampling_mask_lengths")
    try:
        lengths = np.asarray(lengths, dtype=np.int64)
    except (TypeError, ValueError):
        raise RecordError("output_token_sampling_mask_lengths must be one integer per response token") from None
    raw = _b64decode_field("output_token_sampling_mask_ids", meta_info["output_token_sampling_mask_ids"])
    if len(raw) % dtype.itemsize:
        raise RecordError(f"output_token_sampling_mask_ids has {len(raw)} bytes, not a whole number of {dtype_name}")
    ids = np.frombuffer(raw, dtype=dtype)
    if lengths.size and lengths.min() < 1:
        t = int(np.argmin(lengths))
        raise RecordError(f"output_token_sampling_mask_lengths[{t}] = {int(lengths[t])}; every kept set is non-empty")
    if int(lengths.sum()) != ids.size:
        raise RecordError(
            f"output_token_sampling_mask_ids holds {ids.size} ids but output_token_sampling_mask_lengths "
            f"sums to {int(lengths.sum())}"
        )
    if vocab_size is not None and ids.size and (int(ids.max()) >= vocab_size or (dtype.kind == "i" and ids.min() < 0)):
        first = int(np.argmax((ids >= vocab_size) | (ids < 0)))
        t = int(np.searchsorted(np.cumsum(lengths), first, side="right"))
        raise RecordError(f"output_token_sampling_mask[{t}] has ids outside [0, {vocab_size})")
    return np.split(ids.astype(np.int32), np.cumsum(lengths)[:-1])


def decode_sampling_mask(meta_info: dict, response_len: int, vocab_size: int | None) -> list[np.ndarray] | None:
    """Kept-set ids, compact or list form -> R int32 arrays (None when the server sent none)."""
    if "output_token_sampling_mask_ids" in meta_info:
        return _decode_compact_masks(meta_info, response_len, vocab_size)
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
        raise RecordError(
            "output_token_sampling_logprobs must be one float per token (sampling_logprobs_mode='selected')"
        )
    return _checked_logprobs("output_token_sampling_logprobs", values)


def decode_routes(
    meta_info: dict, prompt_len: int, response_len: int, spec: RouteSpec, start_len: int = 0
) -> np.ndarray:
    """``routed_experts`` -> compact ``[P + R - 1 - start_len, L_moe, K]`` (dense layers dropped)."""
    encoded = meta_info.get("routed_experts")
    if encoded is None:
        raise RecordError(
            "meta_info has no 'routed_experts': the request must send return_routed_experts=true and the server "
            "must run with --enable-return-routed-experts"
        )
    if not 0 <= start_len <= prompt_len:
        raise RecordError(f"routed_experts_start_len={start_len} must be in [0, prompt_len={prompt_len}]")
    wire_dtype = meta_info.get("routed_experts_dtype", "int32")  # absent: upstream SGLang's int32
    if isinstance(encoded, (str, bytes)):
        raw = _b64decode_field("routed_experts", encoded)
    else:  # some clients pass the int32 list through JSON
        raw, wire_dtype = np.asarray(encoded, "<i4").tobytes(), "int32"
    num_rows = prompt_len + response_len - 1 - start_len
    routes = wire_to_routes(
        raw, num_rows, spec.num_hidden_layers, spec.top_k, list(spec.moe_layer_ids), spec.num_experts, str(wire_dtype)
    )
    check_distinct_experts(routes, field="routed_experts")
    return routes if routes.flags.writeable else routes.copy()


def wire_payload_sizes(meta_info: dict, num_hidden_layers: int, top_k: int) -> dict:
    """Bytes on the wire of one reply: decoded payload and base64 text per route entry / per kept id."""
    out: dict = {}
    encoded = meta_info.get("routed_experts")
    if isinstance(encoded, str):
        raw = _b64decode_field("routed_experts", encoded)
        dtype = WIRE_ROUTE_DTYPES[meta_info.get("routed_experts_dtype", "int32")]
        entries = len(raw) // dtype.itemsize
        out.update(
            route_dtype=dtype.name,
            route_payload_bytes_per_entry=len(raw) / entries,
            route_base64_bytes_per_entry=len(encoded) / entries,
        )
    if "output_token_sampling_mask_ids" in meta_info:
        encoded = meta_info["output_token_sampling_mask_ids"]
        num_ids = int(sum(meta_info["output_token_sampling_mask_lengths"]))
        sent = len(encoded) + len(json.dumps(meta_info["output_token_sampling_mask_lengths"]))
        out.update(
            mask_form=f"base64 {meta_info.get('output_token_sampling_mask_dtype', 'int32')} + lengths",
            mask_payload_bytes_per_id=len(_b64decode_field("ids", encoded)) / num_ids,
            mask_sent_bytes_per_id=sent / num_ids,
        )
    elif "output_token_sampling_mask" in meta_info:
        masks = meta_info["output_token_sampling_mask"]
        num_ids = sum(len(m) for m in masks)
        out.update(
            mask_form="JSON lists",
            mask_payload_bytes_per_id=4.0,  # int32 in the server
            mask_sent_bytes_per_id=len(json.dumps(masks, separators=(",", ":"))) / num_ids,
        )
    return out


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
