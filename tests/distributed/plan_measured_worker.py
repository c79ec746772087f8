"""torchrun worker (2 ranks, gloo): the job plan's host, disk and network terms, measured on the real learner.

For each layout of ``LAYOUTS`` (ep=2; dp=2 with Megatron's distributed optimizer) of the expert-heavy model
``MODELS`` (``--model``: the CI size or the benchmark's >= 200M one), every rank builds the learner and measures,
by code that does not call the plan (``moe_rl.sizing``, ``moe_rl.config.memory_plan``):

* the HF import (``checkpoint.init_from_hf``'s ``load_hf_weights``, from the bf16 HF checkpoint the caller wrote):
  the peak ``RssAnon`` (``/proc/self/status``) above its value before the import, sampled at every C-function
  return of the importing thread (``sys.setprofile``: deterministic, no sampling thread) with glibc's mmap
  threshold at 64 KiB (a freed tensor leaves the resident set at once);
* one optimizer step, then ``save_checkpoint``: ``os.stat`` of the files this rank wrote
  (``model-r<rank>`` and ``optimizer-r<rank>``);
* a weight sync with no server, ``tensor`` and ``disk``: the tensor sender's own byte counter
  (``WeightSync.sent_bytes``) and ``os.stat`` of the safetensors files the disk sender wrote for this rank;
* this rank's share of a saved records step (``--records``, written by ``write_step_records``: every sample at
  its longest), the trainer's ``plan_step`` share with μ and token versions shared, as ``train/loop.py`` reads
  it: the reader's own counter (``load_share().bytes_read``), and the file's size.

Writes ``--out.rank<r>`` (JSON: one entry per layout) from every rank.
"""

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router_replay import RouterReplay

from moe_rl.config import ExperimentConfig
from moe_rl.learner.checkpoint import save_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.train_step import Learner
from moe_rl.records import RolloutBatch, RolloutSample, load_share
from moe_rl.sync.weight_sync import WeightSync
from moe_rl.train.plan import plan_step

# The CI model: expert-heavy (experts 12.6M of 17.3M parameters), its largest tensor (the 8192 x 256 embedding,
# 8 MiB in bf16) well above the interpreter's own allocations; the benchmark's 307.5M model: bench/bench_plan_measured.py.
MODELS = {
    "ci": {
        "num_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 64,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 512,
        "ffn_hidden_size": 512,
        "vocab_size": 8192,
        "seq_length": 256,
        "first_k_dense_layers": 0,
        "moe_aux_loss_coeff": 0.0,
    },
    "300m": {
        "num_layers": 6,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 64,
        "num_moe_experts": 64,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 1024,
        "ffn_hidden_size": 1024,
        "vocab_size": 8192,
        "seq_length": 256,
        "first_k_dense_layers": 0,
        "moe_aux_loss_coeff": 0.0,
    },
}
LAYOUTS = {"ep2": ({"ep": 2}, False), "dp2_distopt": ({}, True)}
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def job_cfg(model: str, layout: str) -> ExperimentConfig:
    """The config both the worker and the test's plan use: 16 prompts x 4 samples of 128 + 128 tokens, R3."""
    parallel, distopt = LAYOUTS[layout]
    return ExperimentConfig.model_validate(
        {
            "model": MODELS[model],
            "parallel": parallel,
            "optim": {"use_distributed_optimizer": distopt},
            "train": {"seed": 1, "prompts_per_step": 16, "minibatches_per_step": 2},
            "rollout": {"samples_per_prompt": 4, "max_new_tokens": 128, "weight_sync_bucket_mb": 8},
            "replay": {"routing": "r3"},
            "checkpoint": {"init_from_hf": "hf"},
        }
    )


def write_step_records(path: Path, cfg) -> None:
    """One step's records at the plan's worst case: every sample at its longest (prompt + max_new_tokens), R3."""
    m, new = cfg.model, cfg.rollout.max_new_tokens
    prompt, layers = m.seq_length - new, sum(m.moe_layer_pattern())
    rng = np.random.default_rng(0)
    samples = [
        RolloutSample(
            prompt_ids=rng.integers(0, m.vocab_size, prompt).astype(np.int32),
            response_ids=rng.integers(0, m.vocab_size, new).astype(np.int32),
            rollout_logp=-rng.random(new).astype(np.float32),
            routes=np.argsort(rng.random((prompt + new - 1, layers, m.num_moe_experts)), axis=-1)[
                ..., : m.moe_router_topk
            ].astype(np.uint8),
            token_versions=np.zeros(new, np.int32),
            weight_version="step-0",
            group_id=i // cfg.rollout.samples_per_prompt,
        )
        for i in range(cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt)
    ]
    RolloutBatch.from_samples(samples, num_experts=m.num_moe_experts).save(path)


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeak:
    """Peak RssAnon above its value at entry, read at every C-function return of this thread (sys.setprofile)."""

    def __enter__(self):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = self.peak = rss_anon()
        sys.setprofile(self._hook)
        return self

    def _hook(self, frame, event, arg):
        if event == "c_return":
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc):
        sys.setprofile(None)
        self.increase = max(self.peak, rss_anon()) - self.base


def measure(cfg: ExperimentConfig, hf_dir: Path, records: Path, scratch: Path) -> dict:
    init_distributed(cfg.parallel)
    RouterReplay.clear_global_router_replay_instances()
    rank = dist.get_rank()
    # built at random, then the import the learner runs for checkpoint.init_from_hf, alone under the measurement
    learner = Learner(cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"init_from_hf": None})}))
    with AnonPeak() as peak:
        stats = load_hf_weights(learner.model, hf_dir, cfg.model)
    out = {"hf_import_rss_anon": peak.increase, "hf_import_read": stats.total_bytes, "hf_tensors": len(stats.reads)}
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=torch.Generator().manual_seed(rank))
    learner.train_step(  # one optimizer step, so the save writes Adam's moments
        [{"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}], lambda logp, ent, mb: (-logp.mean(), {})
    )
    step_dir = save_checkpoint(learner, scratch / "ckpt", keep_last=1, step=1)
    out["checkpoint_files"] = {f.name: f.stat().st_size for f in sorted(step_dir.glob(f"*-r{rank:05d}.safetensors"))}
    tensor = WeightSync("tensor", cfg.model, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20, digests=False)
    tensor.sync(learner.module, [], "v1")
    out["sync_tensor_sent"] = tensor.sent_bytes
    export = scratch / "export"
    disk = WeightSync("disk", cfg.model, export_dir=export, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
    disk.sync(learner.module, [], "v1", flush_cache=False)
    out["sync_disk_files"] = {f.name: f.stat().st_size for f in sorted(export.glob(f"model-r{rank:05d}-*.safetensors"))}
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
    share = plan_step(
        n,
        minibatches=cfg.train.minibatches_per_step,
        micro_batch_size=cfg.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp,
    ).owned_ids
    read = load_share(records, share, num_samples=n, shared=("rollout_logp", "token_versions"))
    out |= {"records_read": read.bytes_read, "records_file": read.file_bytes, "dp": dp, "samples": len(share)}
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--records", required=True)
    parser.add_argument("--model", default="ci", choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    scratch = Path(args.scratch)
    report = {}
    for layout in LAYOUTS:
        cfg = job_cfg(args.model, layout)
        t0 = time.perf_counter()
        report[layout] = measure(cfg, scratch / "hf", Path(args.records), scratch / layout)
        report[layout]["seconds"] = time.perf_counter() - t0
    Path(f"{args.out}.rank{_rank()}").write_text(json.dumps(report))


def _rank() -> int:
    return int(os.environ["RANK"])


if __name__ == "__main__":
    main()
