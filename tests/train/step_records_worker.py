"""torchrun worker (2 ranks, gloo): ``StepRecords.load`` gives every rank the bytes rank 0 read, or fails on all.

Run: ``torchrun --nproc_per_node=2 tests/train/step_records_worker.py --work DIR``. Each rank reads
``DIR/node<rank>/step_000000.safetensors``: one logical path as each node's filesystem shows it. Cases:
``fresh`` (node 1 sees rank 0's file), ``stale`` (node 1 still sees a file from an earlier session),
``refused`` (rank 0's file is for another model), ``share`` (each rank reads its one sample of the fresh
file), ``tampered`` (node 1's copy has a byte of sample 1 changed; each rank reads its one sample). Each
rank writes ``DIR/rank<r>.json``: per case the error text or ``ok`` with the identity it loaded, and the
bytes it read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from moe_rl.config import ModelConfig
from moe_rl.records import RecordError, RolloutBatch, RolloutSample
from moe_rl.records.chunks import RecordsFile
from moe_rl.source.step_records import StepRecords

MODEL = ModelConfig(num_layers=2, num_moe_experts=8, moe_router_topk=2, vocab_size=64)
VOCAB = {f"t{i}": i for i in range(64)}


def _records(path: Path, run_id: str, seed: int) -> None:
    """2 samples with top-2 routes over 8 experts, stamped as made by ``MODEL`` in run ``run_id``."""
    rng = np.random.default_rng(seed)
    samples = [
        RolloutSample(
            prompt_ids=rng.integers(0, 64, p).astype(np.int32),
            response_ids=rng.integers(0, 64, 2).astype(np.int32),
            rollout_logp=-rng.random(2).astype(np.float32),
            routes=np.stack([rng.permutation(8)[:2] for _ in range((p + 1) * 2)]).reshape(p + 1, 2, 2),
        )
        for p in (3, 4)
    ]
    StepRecords(MODEL, run_id, VOCAB).stamp(RolloutBatch.from_samples(samples, num_experts=8)).save(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = args.work / f"node{rank}"
    node.mkdir(parents=True, exist_ok=True)
    name = "step_000000.safetensors"
    results = {}
    for case in ("fresh", "stale", "refused", "share", "tampered"):
        if rank == 0:
            _records(node / name, run_id="run-a", seed=0)  # this session's file
        if rank == 1:
            _records(node / name, run_id="run-old", seed=5)  # an earlier session's file
        dist.barrier()
        if rank == 1 and case != "stale":  # the filesystem caught up
            shutil.copyfile(args.work / "node0" / name, node / name)
        if rank == 1 and case == "tampered":  # node 1's copy: one byte of sample 1's routes changed
            with RecordsFile(node / name) as f:
                dtype, shape, at = f._tensors["routes"]
            data = bytearray((node / name).read_bytes())
            data[at + 4 * shape[1] * shape[2] * dtype.itemsize] ^= 1  # sample 0 has 4 route rows
            (node / name).write_bytes(bytes(data))
        dist.barrier()
        model = MODEL.model_copy(update={"num_moe_experts": 16}) if case == "refused" else MODEL
        share = [rank] if case in ("share", "tampered") else None  # each rank: its one sample
        try:
            records = StepRecords(model, "run-a", VOCAB, source="train.rollouts_from=DIR")
            batch = records.load(node / name, share=share, num_samples=2)
            results[case] = f"ok {batch.sha256}"
            results[f"{case}_bytes"] = [records.last_read.bytes_read, records.last_read.file_bytes]
        except RecordError as exc:
            results[case] = str(exc)
        dist.barrier()
    (args.work / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
