"""Compact storage of MoE routes: dtype choice, wire conversion, validation, pad rows.

Routes are ``[rows, moe_layers, top_k]`` expert ids. On the upstream SGLang wire they are
int32 (4 bytes); moe_rl's patched server and the records use 1 byte per id when experts <= 256,
2 bytes otherwise.
"""

from __future__ import annotations

import numpy as np


class RecordError(ValueError):
    """A rollout record that disagrees with the model or is malformed; the message names the field."""


def route_dtype(num_experts: int) -> np.dtype:
    """Smallest unsigned dtype holding expert ids ``0..num_experts-1`` (uint8 up to 256 experts)."""
    if num_experts < 1:
        raise RecordError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise RecordError(f"num_experts={num_experts} exceeds 65536, the most a uint16 route holds")


def compact_routes(routes: np.ndarray, num_experts: int, field: str = "routes") -> np.ndarray:
    """Check ``routes[rows, L, K]`` ids are in ``[0, num_experts)`` and cast to the compact dtype."""
    if routes.ndim != 3:
        raise RecordError(f"{field} must be [rows, moe_layers, top_k], got shape {tuple(routes.shape)}")
    if routes.size:
        # one pass: negative ids wrap to huge unsigned values, so max() alone catches both ends
        unsigned = routes.view(np.dtype(routes.dtype.str.replace("i", "u"))) if routes.dtype.kind == "i" else routes
        if int(unsigned.max()) >= num_experts:
            lo, hi = int(routes.min()), int(routes.max())
            raise RecordError(f"{field}: expert ids must be in [0, {num_experts}), got range [{lo}, {hi}]")
    return routes.astype(route_dtype(num_experts), copy=False)


def check_distinct_experts(routes: np.ndarray, field: str = "routes") -> None:
    """Raise if any ``routes[row, layer, :]`` repeats an expert (they collapse in Megatron's routing map)."""
    top_k = routes.shape[-1]
    if top_k < 2 or routes.size == 0:
        return
    if top_k <= 16:  # K(K-1)/2 vectorised slot comparisons beat a per-row sort for the top-k sizes used
        slots = np.ascontiguousarray(routes.reshape(-1, top_k).T)  # [K, rows*L]: contiguous per slot
        dup = np.zeros(slots.shape[1], dtype=bool)
        for i in range(top_k - 1):
            for j in range(i + 1, top_k):
                dup |= slots[i] == slots[j]
        dup = dup.reshape(routes.shape[:-1])
    else:
        ordered = np.sort(routes, axis=-1)
        dup = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
    if dup.any():
        row, layer = (int(i) for i in np.argwhere(dup)[0])
        raise RecordError(
            f"{field}[{row}, {layer}] repeats an expert: {routes[row, layer].tolist()} "
            f"({int(dup.sum())} rows with duplicates); top-k experts of a token must be distinct"
        )


def pad_routes(num_rows: int, num_layers: int, top_k: int, num_experts: int, start: int = 0) -> np.ndarray:
    """Pad rows ``[num_rows, num_layers, top_k]`` with distinct experts per row, spread over all experts.

    Row ``r``, layer ``l`` holds ``(c + arange(top_k)) % E`` with ``c = (start + r) * top_k + l``:
    distinct within a row (top_k <= E) and cycling through every expert across rows, so padded
    tokens neither collapse in the routing map nor pile onto expert 0 (EP load imbalance).
    """
    if top_k > num_experts:
        raise RecordError(f"top_k={top_k} must be <= num_experts={num_experts}")
    rows = np.arange(start, start + num_rows, dtype=np.int64)[:, None, None]
    layers = np.arange(num_layers, dtype=np.int64)[None, :, None]
    slots = np.arange(top_k, dtype=np.int64)[None, None, :]
    ids = (rows * top_k + layers + slots) % num_experts
    return ids.astype(route_dtype(num_experts))


WIRE_ROUTE_DTYPES = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}


def wire_to_routes(
    raw: bytes,
    num_rows: int,
    num_hidden_layers: int,
    top_k: int,
    moe_layer_ids: list[int],
    num_experts: int,
    wire_dtype: str = "int32",
) -> np.ndarray:
    """Decode SGLang's raw ``[rows, num_hidden_layers, top_k]`` route bytes into compact MoE-layer routes.

    ``wire_dtype`` is ``int32`` (upstream SGLang) or ``uint8`` / ``uint16`` (moe_rl's patched server,
    ``meta_info["routed_experts_dtype"]``). Dense layers (zeros on the wire) are dropped by keeping
    only ``moe_layer_ids``.
    """
    dtype = WIRE_ROUTE_DTYPES.get(wire_dtype)
    if dtype is None:
        raise RecordError(f"routed_experts_dtype={wire_dtype!r}; expected one of {sorted(WIRE_ROUTE_DTYPES)}")
    if dtype.kind == "u" and num_experts > np.iinfo(dtype).max + 1:
        raise RecordError(
            f"routed_experts_dtype={wire_dtype} cannot hold ids of {num_experts} experts "
            f"(the server's model disagrees with this config's num_moe_experts)"
        )
    per_row = num_hidden_layers * top_k * dtype.itemsize
    expected = num_rows * per_row
    if len(raw) != expected:
        raise RecordError(
            f"routed_experts has {len(raw)} bytes = {len(raw) / max(per_row, 1):g} rows of [{num_hidden_layers} "
            f"layers x top_k {top_k}] {wire_dtype}; expected {num_rows} rows (prompt + response - 1 - start_len) "
            f"= {expected} bytes"
        )
    full = np.frombuffer(raw, dtype=dtype).reshape(num_rows, num_hidden_layers, top_k)
    if moe_layer_ids == list(range(num_hidden_layers)):
        selected = full
    else:
        selected = full[:, moe_layer_ids, :]
    routes = compact_routes(selected, num_experts, field="routed_experts")
    return np.ascontiguousarray(routes)


def routes_to_wire(
    routes: np.ndarray, num_hidden_layers: int, moe_layer_ids: list[int], wire_dtype: str = "int32"
) -> bytes:
    """Inverse of ``wire_to_routes``: bytes with dense layers as zeros (for fixtures and tests)."""
    rows, _, top_k = routes.shape
    full = np.zeros((rows, num_hidden_layers, top_k), dtype=WIRE_ROUTE_DTYPES[wire_dtype])
    full[:, moe_layer_ids, :] = routes
    return full.tobytes()
