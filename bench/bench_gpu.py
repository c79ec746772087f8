"""GPU benchmark at a realistic MoE layer shape: R3 replay vs plain fwd+bwd, a Learner step, FP8 if TE.

Shape (Qwen3-30B-A3B layers): 4 MoE layers, hidden 2048, 32 heads / 4 query groups x 128, 128 experts
top-8 with expert width 768, vocab 151,936, one sequence of 4,096 tokens, bf16, local layer spec
(``--spec te`` when Transformer Engine is importable). Step times are paired: each round runs plain,
then R3 (rollout routes replayed), in turn, so clock and thermal drift hit both; the figure is the
median of per-round R3/plain ratios. Also times ``Learner.train_step`` (Megatron optimizer) under R3
at ``LEARNER_SHAPE`` (hidden 1024, 64 experts: the optimizer state of the full shape is ~45 GB).

Run: python bench/bench_gpu.py [--rounds 15] [--fp8] [--deterministic] [--only a,b]   (one JSON line last)
``--deterministic`` adds the cost of ``precision.deterministic`` (paired off/on rounds of the plain fwd+bwd).
Without a CUDA GPU it exits 2 with one line saying so; ``--smoke`` runs a tiny shape anywhere (code path only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from megatron.core import parallel_state

from moe_rl.config import ExperimentConfig, FP8Config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.fp8 import fp8_runtime_missing
from moe_rl.learner.mcore_compat import megatron_core_version
from moe_rl.learner.model import build_model, forward_logits, use_transformer_engine
from moe_rl.learner.train_step import Learner
from moe_rl.replay.binding import RoutingReplay

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--fp8", action="store_true", help="also a TE FP8 forward/backward (needs TE)")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="also the cost of precision.deterministic: plain fwd+bwd with deterministic algorithms on vs off",
    )
    ap.add_argument("--only", default="", help="comma-separated sections to run (replay, learner, fp8, deterministic)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shape, CPU allowed: checks the benchmark code path only (figures meaningless)",
    )
    return ap.parse_args()


SMOKE_SHAPE = {
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "vocab_size": 512,
    "num_moe_experts": 8,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
}


LEARNER_SHAPE = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "kv_channels": 64,
    "num_moe_experts": 64,
}
"""The train-step shape (Adam state for 128 experts x hidden 2048 x 4 layers is ~45 GB; the earlier H100 run
used this one): 4 MoE layers, hidden 1024, 64 experts top-8, same vocab and tokens."""


def realistic_cfg(layers: int, tokens: int, fp8: dict | None = None, smoke: bool = False, learner: bool = False):
    model = {
        "num_layers": layers,
        "hidden_size": 2048,
        "ffn_hidden_size": 6144,
        "num_attention_heads": 32,
        "num_query_groups": 4,
        "kv_channels": 128,
        "vocab_size": 151936,
        "seq_length": tokens,
        "num_moe_experts": 128,
        "moe_router_topk": 8,
        "moe_ffn_hidden_size": 768,
        "moe_token_dispatcher_type": "alltoall",
    }
    if learner:
        model.update(LEARNER_SHAPE)
    if smoke:
        model.update(SMOKE_SHAPE)
    precision = {"params_dtype": "float32" if smoke else "bfloat16", "fp8": fp8}
    return ExperimentConfig.model_validate(
        {"model": model, "precision": precision, "optim": {"lr": 1e-6, "clip_grad": 1.0}}
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def bench_replay(cfg, rounds: int, warmup: int) -> dict:
    model = build_model(cfg, seed=0)
    replay = RoutingReplay(model)
    L, K, E = replay.num_moe_layers, replay.top_k, replay.num_experts
    S = cfg.model.seq_length
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (1, S), generator=g)  # host-built: the library moves it
    routes = torch.argsort(torch.rand(1, S, L, E, generator=g), dim=-1)[..., :K]

    def step():
        forward_logits(model, ids).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    def plain():
        step()

    def r3():
        with replay.replay([routes], observe_natural=False):
            step()

    for _ in range(warmup):
        plain(), r3()
    times = {"plain": [], "r3": []}
    for _ in range(rounds):
        times["plain"].append(_timed(plain))
        times["r3"].append(_timed(r3))
    ratios = [r / p for r, p in zip(times["r3"], times["plain"])]
    replay.close()
    model = None  # frees the model (the closures above hold it)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "plain_ms": 1e3 * statistics.median(times["plain"]),
        "r3_ms": 1e3 * statistics.median(times["r3"]),
        "r3_over_plain": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
    }


def bench_learner_step(cfg, steps: int = 5) -> dict:
    learner = Learner(cfg, total_steps=steps + 1)
    replay = RoutingReplay(learner.model)
    L, K, E = replay.num_moe_layers, replay.top_k, replay.num_experts
    S = cfg.model.seq_length
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, S + 1), generator=g)
    device = next(learner.model.parameters()).device
    mb = {"input_ids": tokens[:, :-1].to(device), "targets": tokens[:, 1:].to(device)}
    routes = torch.argsort(torch.rand(1, S, L, E, generator=g), dim=-1)[..., :K]

    def nll(logp, entropy, mb):
        return -logp.mean(), {}

    def one():
        with replay.replay([routes], observe_natural=False):
            return learner.train_step([mb], nll)

    one()  # warmup (optimizer state allocation)
    ms, losses = [], []
    for _ in range(steps):
        t = _timed(lambda: losses.append(one().loss))
        ms.append(1e3 * t)
    replay.close()
    return {"r3_train_step_ms": statistics.median(ms), "losses": [round(x, 4) for x in losses]}


def bench_deterministic(cfg, rounds: int, warmup: int) -> dict:
    """``precision.deterministic``'s cost (``learner.dist.deterministic_kernels``): paired rounds of the plain
    fwd+bwd with ``torch.use_deterministic_algorithms`` off, then on (``warn_only``, as the library sets it). The
    cuBLAS workspace it needs (``CUBLAS_WORKSPACE_CONFIG``) is set for both arms: it must precede the first cuBLAS
    call. Also lists the ops that warned they have no deterministic implementation at this shape."""

    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length), generator=torch.Generator().manual_seed(0))

    def step(on: bool):
        torch.use_deterministic_algorithms(on, warn_only=True)
        forward_logits(model, ids).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warmup):
            step(False), step(True)
    nondeterministic = sorted(
        {str(w.message).splitlines()[0][:160] for w in caught if "deterministic" in str(w.message)}
    )
    times = {"off": [], "on": []}
    for _ in range(rounds):
        times["off"].append(_timed(lambda: step(False)))
        times["on"].append(_timed(lambda: step(True)))
    torch.use_deterministic_algorithms(False)
    ratios = [a / b for a, b in zip(times["on"], times["off"])]
    return {
        "det_off_ms": 1e3 * statistics.median(times["off"]),
        "det_on_ms": 1e3 * statistics.median(times["on"]),
        "det_on_over_off": statistics.median(ratios),
        "det_ratio_min": min(ratios),
        "det_ratio_max": max(ratios),
        "det_ops_without_deterministic_impl": nondeterministic,
    }


def bench_fp8(layers: int, tokens: int) -> dict:
    missing = fp8_runtime_missing()
    if missing:
        return {"fp8_ran": False, "fp8_missing": missing}

    cfg = realistic_cfg(layers, tokens, fp8=FP8Config().model_dump())
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.model.vocab_size, (1, tokens))
    t = _timed(lambda: forward_logits(model, ids).float().pow(2).mean().backward())
    return {"fp8_ran": True, "fp8_recipe": cfg.precision.fp8.recipe, "fp8_fwd_bwd_ms": 1e3 * t}


def main() -> int:
    args = parse()
    if args.smoke:
        args.layers, args.tokens, args.rounds, args.warmup = 2, 32, 2, 1
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU visible (torch.cuda.is_available() is False); nothing to measure")
        return 2
    if args.deterministic:  # before the first cuBLAS call (bench_deterministic)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    cfg = realistic_cfg(args.layers, args.tokens, smoke=args.smoke)
    init_distributed(cfg.parallel, environ={})
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (--smoke on CPU)"
    out = {
        "gpu": gpu,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "megatron_core": ".".join(map(str, megatron_core_version())),
        "spec": "te" if use_transformer_engine() else "local",
        "layers": args.layers,
        "tokens": args.tokens,
    }
    sections = [
        ("replay", lambda: bench_replay(cfg, args.rounds, args.warmup)),
        (
            "learner",
            lambda: bench_learner_step(realistic_cfg(args.layers, args.tokens, smoke=args.smoke, learner=True)),
        ),
    ]
    if args.fp8:
        sections.append(("fp8", lambda: bench_fp8(args.layers, args.tokens)))
    if args.deterministic:
        sections.append(("deterministic", lambda: bench_deterministic(cfg, args.rounds, args.warmup)))
    if args.only:
        sections = [(n, r) for n, r in sections if n in args.only.split(",")]
    failed = []
    for name, run in sections:
        try:
            out.update(run())
        except torch.cuda.OutOfMemoryError as exc:  # report and go on: the other sections still mean something
            out[f"{name}_error"] = f"CUDA out of memory: {str(exc).splitlines()[0]}"
            failed.append(name)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if torch.cuda.is_available():
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    for k, v in out.items():
        print(f"  {k:18s} {v:.4f}" if isinstance(v, float) else f"  {k:18s} {v}")
    print(json.dumps(out))
    parallel_state.destroy_model_parallel()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
