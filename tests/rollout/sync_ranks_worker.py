"""2-rank worker (torchrun, gloo): the streaming HF export and weight sync at ep=2 and at pp=2, to a real server.

``sync_ranks_worker.py URL V1_DIR V2_DIR ROOT``: for each layout the learner is loaded from the V2 checkpoint and

* ``export_hf_checkpoint`` writes ``ROOT/<layout>`` (experts written by their owners, each stage its layers);
* the stream the distributed sync uses (experts gathered to one source per stage) is drained, stages taking
  turns, and every sender's buckets gathered to rank 0 into ``ROOT/<layout>_stream.safetensors``;
* ``WeightSync.sync`` pushes the live weights to the server over each transport (tensor, distributed, disk),
  then rank 0 generates and saves the tokens, log-probs and routes to ``ROOT/<layout>-<mode>.npz``
  (the server is put back on V1 between transports, so each sync is a real change).

The distributed sync gives each pipeline stage's source its own address (``stage_addresses``: two loopback
addresses, so only the plumbing is exercised: the server reaches stage 1's source at 127.0.0.2).
Last, a NaN on rank 1 only: the sync must send nothing and raise the same error on both ranks.
``ROOT/report.json``: which ranks sent, the largest bucket of several tensors, the most any rank held for
the stream at once (``HFStream.peak_bytes``: the open bucket plus what it received), the NaN sync's errors and the
version the server reports after it. The test compares everything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors.torch import save_file

from moe_rl.config import ExperimentConfig
from moe_rl.learner.dist import destroy_distributed, init_distributed
from moe_rl.learner.hf_export import export_hf_checkpoint
from moe_rl.learner.hf_stream import HFStream
from moe_rl.learner.train_step import Learner
from moe_rl.records import RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.sync.checks import reference_from_hf_dir
from moe_rl.sync.transport import WeightSyncError, server_weight_version, update_weights_from_disk
from moe_rl.sync.weight_sync import WeightSync

MODEL = {"num_layers": 4, "first_k_dense_layers": 1, "vocab_size": 512}  # pp=2: a MoE layer on each stage
BUCKET = 64 << 10  # small: many buckets, experts of both ep ranks in one bucket
SAMPLING = SamplingSettings(temperature=0.8, top_p=0.9, top_k=16, max_new_tokens=8)
STAGE_ADDRESSES = ["127.0.0.1", "127.0.0.2"]  # one per pipeline stage (ep2: one stage, the first); both loopback
PROMPTS = [[5, 17, 99, 250, 7, 31], [400, 12, 3, 88, 91, 64, 23, 9]]


def config(hf_dir: str, **parallel) -> ExperimentConfig:
    return ExperimentConfig(model=MODEL, parallel=parallel, checkpoint={"init_from_hf": hf_dir}, train={"steps": 1})


def generate(url: str, cfg) -> dict:
    client = RolloutClient([url], RouteSpec.from_model_config(cfg.model), 512, SAMPLING, max_concurrency=1)
    samples = client.generate(PROMPTS, n=1, step=3)
    out = {"versions": np.array([s.weight_version for s in samples])}
    for i, s in enumerate(samples):
        out |= {f"ids{i}": s.response_ids, f"logp{i}": s.rollout_logp, f"routes{i}": s.routes}
    return out


def stream_to_rank0(learner, cfg, root: Path, layout: str) -> dict:
    stream = HFStream(learner.model, cfg.model, BUCKET, gather_experts=True)
    sent, sizes, plan = {}, [], stream.plan()
    for stage in range(stream.stages):  # stages take turns, as the distributed sync does
        if stage == stream.stage:
            for bucket in stream.buckets():
                sizes.append(sum(t.numel() * t.element_size() for _, t in bucket) if len(bucket) > 1 else 0)
                sent.update({n: t.clone() for n, t in bucket})
        dist.barrier()
    assert set(sent) == set(plan) and all(tuple(sent[n].shape) == plan[n][0] for n in sent), "plan() != buckets()"
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((sent, max(sizes, default=0), stream.sender, stream.peak_bytes), every, dst=0)
    if every is None:
        return {}
    merged = {}
    for part, *_ in every:
        assert not set(part) & set(merged), "a tensor was sent twice"
        merged.update(part)

    save_file(merged, root / f"{layout}_stream.safetensors")
    return {
        "senders": [s for _, _, s, _ in every],
        "max_multi_bucket": max(m for _, m, _, _ in every),
        "peak_bytes": max(p for *_, p in every),
        "largest_expert": max(t.numel() * t.element_size() for n, t in merged.items() if ".experts." in n),
    }


def run(layout: str, url: str, v1: str, v2: str, root: Path, **parallel) -> dict:
    cfg = config(v2, **parallel)
    init_distributed(cfg.parallel)
    learner = Learner(cfg)
    rank0 = dist.get_rank() == 0
    export_hf_checkpoint(learner.model, cfg.model, root / layout, bucket_bytes=BUCKET)
    report = stream_to_rank0(learner, cfg, root, layout)
    for mode in ("tensor", "distributed", "disk"):
        ws = WeightSync(
            mode,
            cfg.model,
            export_dir=root / f"{layout}-{mode}-export",
            template_dir=v2,
            bucket_bytes=BUCKET,
            reference=reference_from_hf_dir(v1) if rank0 else None,
            timeout_s=120,
            group_options={"backend": "gloo", "stage_addresses": STAGE_ADDRESSES},
        )
        ws.sync(learner.module, [url] if rank0 else [], f"{layout}-{mode}")
        if mode == "distributed":  # the address each stage's source advertised to the server
            where = [None] * dist.get_world_size() if rank0 else None
            # size: one address per rank
            dist.gather_object(None if ws.group is None else ws.group.master_address, where, dst=0)
            report["group_addresses"] = where
        ws.close()
        if rank0:
            np.savez(root / f"{layout}-{mode}.npz", **generate(url, cfg))
            update_weights_from_disk([url], v1, "v1")
        dist.barrier()
    if layout == "pp2":  # last: a NaN on rank 1 only (stage 1's layers): nothing is sent, every rank raises
        if dist.get_rank() == 1:
            with torch.no_grad():
                next(p for n, p in learner.module.named_parameters() if "experts" in n).view(-1)[0] = float("nan")
        ws = WeightSync(
            "tensor", cfg.model, bucket_bytes=BUCKET, reference=reference_from_hf_dir(v1) if rank0 else None
        )
        try:
            ws.sync(learner.module, [url] if rank0 else [], "nan")
            error = None
        except WeightSyncError as err:
            error = str(err)
        errors = [None] * dist.get_world_size() if rank0 else None
        dist.gather_object(error, errors, dst=0)
        if rank0:
            report["nan_errors"], report["after_nan"] = errors, server_weight_version(url)
    return report


def main() -> None:
    url, v1, v2, root = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    reports = {"ep2": run("ep2", url, v1, v2, root, ep=2), "pp2": run("pp2", url, v1, v2, root, pp=2)}
    if dist.get_rank() == 0:
        (root / "report.json").write_text(json.dumps(reports))
    destroy_distributed()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
