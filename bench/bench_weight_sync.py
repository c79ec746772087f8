"""Weight sync seconds, disk vs tensor (vs distributed), on the real SGLang CPU server: tiny and ~100M parameters.

For each model: start one server on checkpoint A, load checkpoint B's HF state dict into memory (what
`export_hf_state_dict` hands over after a train step), then time interleaved pairs of
  disk:   write the HF dir (safetensors + side files) and POST /update_weights_from_disk
  tensor: check names/shapes/finite, copy into shared memory, POST /update_weights_from_tensor
          in `rollout.weight_sync_bucket_mb` buckets between begin/end_weight_update
  distributed: the same checks, then per bucket POST /update_weights_from_distributed while this
          process broadcasts the tensors over the gloo weight-update group (opened once, at warm-up)
each followed by the `/model_info` version check. Prints per-pair seconds, medians and the median of
the per-pair ratios disk/tensor. Last line: `weight_sync_speedup_<model>=...` per model.

  python bench/bench_weight_sync.py [--pairs 5] [--models tiny,100m] [--bucket-mb 256]
                                    [--modes disk,tensor[,distributed]]

``--learner-ranks 1,2 --modes streamed-tensor,gathered-tensor,...`` times the trainer's own sync instead (issue 35):
the 300m expert-heavy model loaded by 1 and 2 learner ranks (ep = ranks, torchrun, ``weight_sync_ranks.py``),
``WeightSync.sync`` streaming from the owners vs the previous release's whole-model gather into rank 0, with every
rank's peak resident-set increase during a sync (sampled from /proc every millisecond).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_rl.config import ModelConfig
from moe_rl.learner.dist import free_port
from moe_rl.learner.hf_convert import read_hf_state_dict
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from moe_rl.sync.checks import reference_from_hf_dir
from moe_rl.sync.weight_sync import WeightSync

MODELS = {
    "tiny": ModelConfig(num_layers=2, vocab_size=512),
    # Qwen3-MoE-shaped: GQA attention with qk-norm, 16 experts top-2 in every layer; ~103M parameters
    "100m": ModelConfig(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=64,
        vocab_size=32768,
        num_moe_experts=16,
        moe_router_topk=2,
        moe_ffn_hidden_size=320,
    ),
    # expert-heavy (issue 35): 6 layers, hidden 256, 64 experts of 1024; ~306M parameters, 302M of them experts
    "300m": ModelConfig(
        num_layers=6, hidden_size=256, num_moe_experts=64, moe_router_topk=2, moe_ffn_hidden_size=1024, vocab_size=8192
    ),
}


def bench_model(name: str, cfg: ModelConfig, pairs: int, bucket_mb: int, tmp: Path, modes: list[str]) -> float:
    dir_a = write_random_hf_checkpoint(cfg, tmp / f"{name}_a", seed=0)
    dir_b = write_random_hf_checkpoint(cfg, tmp / f"{name}_b", seed=1)
    state = read_hf_state_dict(dir_b)
    params = sum(t.numel() for t in state.values())
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    reference = reference_from_hf_dir(dir_a)
    syncs = {
        "disk": WeightSync("disk", cfg, export_dir=tmp / f"{name}_export", template_dir=dir_a, reference=reference),
        "tensor": WeightSync("tensor", cfg, bucket_bytes=bucket_mb << 20, reference=reference),
        "distributed": WeightSync(
            "distributed", cfg, bucket_bytes=bucket_mb << 20, reference=reference, group_options={"backend": "gloo"}
        ),
    }
    syncs = {mode: syncs[mode] for mode in ["disk", "tensor"] + [m for m in modes if m == "distributed"]}
    spec = ServerSpec(str(dir_a), dtype="float32", deterministic=False, mem_fraction_static=0.3, startup_timeout_s=600)
    times: dict[str, list[float]] = {mode: [] for mode in syncs}
    with SGLangServer(spec, tmp / f"{name}_server.log") as server:
        print(f"[{name}] {params / 1e6:.1f}M parameters, {mib:.0f} MiB fp32; load average {os.getloadavg()[0]:.1f}")
        for mode in syncs:  # first-call imports on both sides; the distributed group's rendezvous
            if mode != "disk":
                syncs[mode].push(state, [server.url], "warmup")
        for pair in range(pairs):
            order = list(syncs.items()) if pair % 2 == 0 else list(syncs.items())[::-1]
            for mode, sync in order:
                t0 = time.perf_counter()
                sync.push(state, [server.url], f"{mode}-{pair}")
                times[mode].append(time.perf_counter() - t0)
            print(f"[{name}] pair {pair}: " + ", ".join(f"{m} {t[-1]:.3f} s" for m, t in times.items()))
        syncs.get("distributed", syncs["disk"]).close()
    ratios = sorted(d / t for d, t in zip(times["disk"], times["tensor"]))
    for mode, values in times.items():
        print(
            f"[{name}] median {mode:6s}: {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"
        )
    print(f"[{name}] disk/tensor per pair: {' '.join(f'{r:.2f}' for r in ratios)}")
    if "distributed" in times:
        dist = sorted(d / t for d, t in zip(times["disk"], times["distributed"]))
        print(f"[{name}] disk/distributed per pair: {' '.join(f'{r:.2f}' for r in dist)}")
    return statistics.median(ratios)


def bench_learner_ranks(name: str, ranks: list[int], modes: list[str], repeats: int, bucket_mb: int, tmp: Path) -> dict:
    """The trainer's sync from 1..N learner ranks (``weight_sync_ranks.py`` under torchrun, ep = N) to one server:
    seconds and every rank's peak resident-set increase per mode (streamed vs the previous release's gather)."""

    cfg = MODELS[name]
    dir_a = write_random_hf_checkpoint(cfg, tmp / f"{name}_a", seed=0)
    dir_b = write_random_hf_checkpoint(cfg, tmp / f"{name}_b", seed=1)
    params = sum(t.numel() for t in read_hf_state_dict(dir_b).values())
    spec = ServerSpec(str(dir_a), dtype="float32", deterministic=False, mem_fraction_static=0.3, startup_timeout_s=900)
    worker = Path(__file__).with_name("weight_sync_ranks.py")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),  # big frees go back at once
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    out: dict = {}
    with SGLangServer(spec, tmp / f"{name}_server.log") as server:
        print(f"[{name}] {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MiB fp32, bucket {bucket_mb} MiB")
        for n in ranks:
            result = tmp / f"ranks_{n}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={n}",
                f"--master_port={free_port()}",
                str(worker),
                server.url,
                str(dir_a),
                str(dir_b),
                str(result),
                ",".join(modes),
                str(repeats),
                str(bucket_mb),
                name,
            ]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            for row in json.loads(result.read_text()):
                out.setdefault((n, row["mode"]), []).append(row)
            for mode in modes:
                rows = out[(n, mode)]
                secs = statistics.median(r["seconds"] for r in rows if r["rank"] == 0)
                peaks = {r["rank"]: max(x["rss_increase"] for x in rows if x["rank"] == r["rank"]) for r in rows}
                print(
                    f"[{name}] {n} rank(s) {mode:22s} median {secs:6.2f} s; peak RSS increase per rank: "
                    + ", ".join(f"rank {k} {v / 2**20:.0f} MiB" for k, v in sorted(peaks.items()))
                )
    return out


def main() -> None:
    # The trainer side uses one thread: on this 2-core host the server needs the other, and torch's
    # OpenMP copies/reductions slow down by 10-100x when the machine is oversubscribed.
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--models", default=None, help="default tiny,100m; with --learner-ranks one model, default 300m")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--modes", default="disk,tensor", help="add ',distributed' for the gloo group")
    ap.add_argument(
        "--learner-ranks",
        default="",
        help="e.g. 1,2: the trainer's sync from that many learner ranks "
        "(300m model; --modes are then streamed-<t>/gathered-<t>)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.learner_ranks:
        with tempfile.TemporaryDirectory() as tmp:
            name = args.models or "300m"
            out = bench_learner_ranks(
                name,
                [int(n) for n in args.learner_ranks.split(",")],
                args.modes.split(","),
                args.repeats,
                args.bucket_mb,
                Path(tmp),
            )
        for (n, mode), rows in out.items():
            print(
                f"weight_sync_{name}_{mode}_{n}ranks: median {statistics.median(r['seconds'] for r in rows):.2f} s, "
                f"peak_rss_mib={max(r['rss_increase'] for r in rows) / 2**20:.0f}"
            )
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in (args.models or "tiny,100m").split(","):
            modes = args.modes.split(",")
            results[name] = bench_model(name, MODELS[name], args.pairs, args.bucket_mb, Path(tmp), modes)
    for name, speedup in results.items():
        print(f"weight_sync_speedup_{name}={speedup:.2f}")


if __name__ == "__main__":
    main()
