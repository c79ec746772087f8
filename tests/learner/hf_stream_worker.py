"""2-rank worker (torchrun, gloo): the streaming HF export and the weight-sync stream at ep=2 and at pp=2.

Oracle: the learner was loaded from a random HF checkpoint, so the export must give back exactly that
checkpoint (every name, every bit), whoever writes which shard. For each layout the worker writes
``export_hf_checkpoint`` to ``<root>/<layout>`` (experts written by their owners) and, for the stream the
distributed sync uses (experts gathered to one source per stage), gathers every sender's buckets' names,
sizes and tensors to rank 0 and saves them to ``<root>/<layout>_stream.safetensors``. The test compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_rl.config import ExperimentConfig  # noqa: E402
from moe_rl.learner.dist import destroy_distributed, init_distributed  # noqa: E402
from moe_rl.learner.hf_export import export_hf_checkpoint  # noqa: E402
from moe_rl.learner.hf_init import write_random_hf_checkpoint  # noqa: E402
from moe_rl.learner.hf_stream import HFStream  # noqa: E402
from moe_rl.learner.train_step import Learner  # noqa: E402

BUCKET = 24 << 10  # small: many buckets, experts of both ep ranks in one bucket


def config(hf_dir: str, **parallel) -> ExperimentConfig:
    return ExperimentConfig(
        model=dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=8, vocab_size=128, seq_length=32, num_moe_experts=8, moe_router_topk=2,
                   moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall"),
        parallel=parallel, checkpoint=dict(init_from_hf=hf_dir), train=dict(steps=1),
    )  # fmt: skip


def run(layout: str, hf_dir: str, root: Path, **parallel) -> dict:
    cfg = config(hf_dir, **parallel)
    init_distributed(cfg.parallel)
    learner = Learner(cfg)
    export_hf_checkpoint(learner.model, cfg.model, root / layout, bucket_bytes=BUCKET)
    stream = HFStream(learner.model, cfg.model, BUCKET, gather_experts=True)
    sent, sizes, plan = {}, [], stream.plan()
    for stage in range(stream.stages):  # stages take turns, as the distributed sync does
        if stage == stream.stage:
            for bucket in stream.buckets():
                sizes.append(sum(t.numel() * t.element_size() for _, t in bucket) if len(bucket) > 1 else 0)
                sent.update({n: t.clone() for n, t in bucket})
        dist.barrier()
    assert set(sent) == set(plan), "plan() names what buckets() sends"
    assert all(tuple(sent[n].shape) == plan[n][0] for n in sent)
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((sent, max(sizes, default=0), stream.sender), every, dst=0)
    report = {}
    if dist.get_rank() == 0:
        merged = {}
        for part, _, _ in every:
            assert not set(part) & set(merged), "a tensor was sent twice"
            merged.update(part)
        from safetensors.torch import save_file

        save_file(merged, root / f"{layout}_stream.safetensors")
        report = {"senders": [s for _, _, s in every], "max_multi_bucket": max(m for _, m, _ in every)}
    return report


def main() -> None:
    root = Path(sys.argv[1])
    hf_dir = str(root / "init")
    init_distributed(config(hf_dir).parallel)
    if dist.get_rank() == 0:
        write_random_hf_checkpoint(config(hf_dir).model, hf_dir, seed=3)
    dist.barrier()
    reports = {"ep2": run("ep2", hf_dir, root, ep=2), "pp2": run("pp2", hf_dir, root, pp=2)}
    if reports["ep2"]:
        (root / "report.json").write_text(json.dumps(reports))
    destroy_distributed()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
