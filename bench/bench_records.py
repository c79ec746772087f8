"""Route encode/decode throughput and bytes per route entry vs SGLang's int32 wire.

Workload: one 32K-token sample of a Qwen3-30B-A3B-shaped model (48 MoE layers, top-8,
128 experts) and a 256-expert / 1024-expert variant. Decode = base64 text -> int32 ->
range check -> compact dtype -> duplicate check, i.e. everything ``decode_routes`` does.
Throughput is reported in GB/s of int32-equivalent data (tokens * layers * top_k * 4 bytes).
Run: ``python bench/bench_records.py``.
"""

from __future__ import annotations

import base64
import time

import numpy as np

from moe_rl.records.routes import check_distinct_experts, compact_routes, route_dtype
from moe_rl.records.sglang_meta import RouteSpec, decode_routes


def best_of(fn, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench(tokens=32768, layers=48, top_k=8, experts=128):
    rng = np.random.default_rng(0)
    routes = np.argsort(rng.random((tokens, layers, experts), dtype=np.float32), axis=-1)[..., :top_k].astype("<i4")
    wire_b64 = base64.b64encode(routes.tobytes()).decode()
    spec = RouteSpec(num_hidden_layers=layers, moe_layer_ids=tuple(range(layers)), top_k=top_k, num_experts=experts)
    meta = {"routed_experts": wire_b64}
    int32_bytes = routes.nbytes

    t_decode = best_of(lambda: decode_routes(meta, prompt_len=tokens, response_len=1, spec=spec))
    compact = decode_routes(meta, prompt_len=tokens, response_len=1, spec=spec)
    assert np.array_equal(compact.astype("<i4"), routes)
    t_compact = best_of(lambda: compact_routes(routes, experts))
    t_dups = best_of(lambda: check_distinct_experts(compact))
    t_encode = best_of(lambda: base64.b64encode(compact.astype("<i4").tobytes()))
    return {
        "shape": f"{tokens}x{layers}x{top_k}, E={experts}",
        "bytes_per_entry": route_dtype(experts).itemsize,
        "int32_MB": int32_bytes / 1e6,
        "compact_MB": compact.nbytes / 1e6,
        "decode_GBps_int32_equiv": int32_bytes / t_decode / 1e9,
        "cast_only_GBps": int32_bytes / t_compact / 1e9,
        "dup_check_GBps": int32_bytes / t_dups / 1e9,
        "encode_to_wire_GBps": int32_bytes / t_encode / 1e9,
    }


if __name__ == "__main__":
    for experts in (128, 256, 1024):
        r = bench(experts=experts)
        print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
