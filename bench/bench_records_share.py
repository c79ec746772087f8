"""Records per rank (issue 52): bytes each data-parallel rank reads of a step's records file, and its time.

Writes one synthetic step of an expert-heavy model's records (format 3): ``--samples`` samples of 256-1024
prompt and 128-512 response tokens, R3 routes over 48 MoE layers x top-8 of 128 experts (uint8, the 30B
config's routing), μ and token versions. Then, for dp in 1, 2, 4, 8, every rank's share of the step plan
(``plan_step``: 4 minibatches, the trainer's split) is read with ``load_share`` as the trainer reads it
(μ = ``rollout_logp``, token versions), and the worst rank's bytes (the reader's own counter) and wall
time are printed, next to the previous release's read by every rank: the whole file read, hashed, parsed and
checked (``RolloutBatch.load``; format 3 hashes per chunk, as the previous release hashed the whole file).

  python bench/bench_records_share.py [--samples 256]   # ~92 MiB in a temp dir
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_rl.records import RolloutBatch, RolloutSample, load_share
from moe_rl.train.plan import plan_step

LAYERS, TOPK, EXPERTS = 48, 8, 128


def _step_file(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(n):
        p, r = int(rng.integers(256, 1025)), int(rng.integers(128, 513))
        routes = np.argsort(rng.random((p + r - 1, LAYERS, EXPERTS)), axis=-1)[..., :TOPK].astype(np.uint8)
        samples.append(
            RolloutSample(
                prompt_ids=rng.integers(0, 150000, p).astype(np.int32),
                response_ids=rng.integers(0, 150000, r).astype(np.int32),
                rollout_logp=-rng.random(r).astype(np.float32),
                routes=routes,
                weight_version="step-0",
            )
        )
    RolloutBatch.from_samples(samples, num_experts=EXPERTS).save(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step_000000.safetensors"
        _step_file(path, args.samples)
        size = path.stat().st_size
        t0 = time.perf_counter()
        RolloutBatch.load(path)  # what every rank did before: the whole file read, hashed, parsed and checked
        whole_s = time.perf_counter() - t0
        print(json.dumps({"file_mib": round(size / 2**20, 1), "whole_file_load_s": round(whole_s, 3)}))
        for dp in (1, 2, 4, 8):
            worst, seconds = 0, 0.0
            for rank in range(dp):
                ids = plan_step(args.samples, minibatches=4, micro_batch_size=1, dp_rank=rank, dp_size=dp).owned_ids
                t0 = time.perf_counter()
                read = load_share(path, ids, shared=("rollout_logp", "token_versions"))
                seconds = max(seconds, time.perf_counter() - t0)
                worst = max(worst, read.bytes_read)
            row = {"dp": dp, "read_frac_worst_rank": round(worst / size, 4), "read_mib": round(worst / 2**20, 1)}
            print(json.dumps(row | {"read_and_check_s": round(seconds, 3)}))


if __name__ == "__main__":
    main()
