"""The job plan: GPU, host, disk and network per rank and per node, and the times they take, from the config.

Owns ``job_plan`` (a pure function of the config and the learner world size) and its printed lines: the
learner state from ``moe_rl.config.memory_plan`` (checked against built models), plus the terms of
``moe_rl.sizing.terms``. Lines marked ``[GPU check pending]`` are estimates only a GPU run can validate.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config.memory_plan import GB, activation_bytes, memory_plan, rank_memory
from moe_rl.config.schema import ExperimentConfig
from moe_rl.sizing import terms

__all__ = ["GB", "JobPlan", "RankPlan", "job_plan", "rank_plan"]

PENDING = " [GPU check pending]"


@dataclass(frozen=True)
class RankPlan:
    """One learner rank of pipeline stage ``stage``: GPU and host bytes by term."""

    stage: int
    gpu: dict[str, float]  # weights, gradients, optimizer, fp8_cache, activations, logits, overhead
    host: dict[str, float]  # offloaded_optimizer, hf_import, records, checkpoint_buffer
    checkpoint_bytes: float  # written per save
    hf_read_bytes: float  # read at checkpoint.init_from_hf

    @property
    def state(self) -> float:
        return self.gpu["weights"] + self.gpu["gradients"] + self.gpu["optimizer"]

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        """Offloaded optimizer + records + the larger of the HF import and the save buffer (never at once)."""
        h = self.host
        return h["offloaded_optimizer"] + h["records"] + max(h["hf_import"], h["checkpoint_buffer"])


def rank_plan(cfg: ExperimentConfig, world: int, stage: int) -> RankPlan:
    mem = rank_memory(cfg, world, stage)
    dp = memory_plan(cfg, world).dp
    gpu = {
        "weights": mem.weights,
        "gradients": mem.grads,
        "optimizer": mem.optimizer,
        "fp8_cache": terms.fp8_cache_bytes(cfg, stage),
        "activations": activation_bytes(cfg, stage, terms.micro_batch_tokens(cfg), logit_bytes=0.0),
        "logits": terms.logits_bytes(cfg, stage),
        "overhead": terms.CUDA_NCCL_OVERHEAD,
    }
    host = {
        "offloaded_optimizer": mem.host_optimizer,
        "hf_import": terms.hf_import_peak(cfg, stage) if _imports_hf(cfg) else 0.0,
        "records": terms.records_bytes_per_rank(cfg, dp),
        "checkpoint_buffer": terms.checkpoint_write_buffer(cfg),
    }
    hf_read = terms.HF_BYTES * (mem.dense_params + mem.expert_params) if _imports_hf(cfg) else 0.0
    return RankPlan(stage, gpu, host, mem.checkpoint_host, float(hf_read))


def _imports_hf(cfg: ExperimentConfig) -> bool:
    return bool(cfg.checkpoint.init_from_hf or cfg.model.hf_path)


@dataclass(frozen=True)
class JobPlan:
    cfg: ExperimentConfig
    world: int
    world_from: str
    ranks: tuple[RankPlan, ...]  # one per pipeline stage

    @property
    def worst(self) -> RankPlan:
        """The rank with the largest GPU total (ties: the first stage)."""
        return max(self.ranks, key=lambda r: r.gpu_total)

    @property
    def worst_host(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.host_total)

    @property
    def weight_sync_bytes(self) -> float:
        """Bytes of one weight sync to each rollout server (``terms.weight_sync_bytes``)."""
        return terms.weight_sync_bytes(self.cfg)

    @property
    def records_step_bytes(self) -> float:
        """Bytes of one step's records file (``terms.records_bytes_per_step``)."""
        return terms.records_bytes_per_step(self.cfg)

    def lines(self) -> list[str]:
        """GPU, host, disk and network lines per rank and per node (``moe-rl plan``, ``launch --dry-run``)."""
        cfg, ln = self.cfg, self.cfg.launch
        old = memory_plan(cfg, self.world)
        w, node = self.worst, ln.gpus_per_node
        g = w.gpu
        stage = f", pipeline stage {w.stage} of {len(self.ranks)}" if len(self.ranks) > 1 else ""
        worst_old = next(r for r in old.ranks if r.stage == w.stage)
        fp8 = cfg.precision.fp8
        fp8_why = (
            "FP8 off"
            if fp8 is None
            else "precision.fp8.disable_parameter_transpose_cache=true"
            if fp8.disable_parameter_transpose_cache
            else "2 B/param: TE row- and column-wise copies; precision.fp8.disable_parameter_transpose_cache"
        )
        tokens = terms.micro_batch_tokens(cfg)
        out = [
            (
                f"memory plan per GPU ({self.world} learner ranks from {self.world_from}: dp {old.dp}, expert dp "
                f"{old.edp}{stage}; {_count(worst_old.dense_params)} dense + {_count(worst_old.expert_params)} expert "
                "params):"
            ),
            f"  weights          {_size(g['weights'])}",
            f"  gradients        {_size(g['gradients'])} (fp32 reduction buffer)",
            f"  optimizer state  {_size(g['optimizer'])} ({old.optimizer_words})",
            f"  state total      {_size(w.state)} of launch.gpu_memory_gb={ln.gpu_memory_gb:g}",
            f"  FP8 caches       {_size(g['fp8_cache'])} ({fp8_why}){PENDING if g['fp8_cache'] else ''}",
            (
                f"  activations     ~{_size(g['activations'])} ({tokens} tokens = train.micro_batch_size x (prompt + "
                f"rollout.max_new_tokens), recompute={cfg.train.recompute}){PENDING}"
            ),
            (
                f"  logits           {_size(g['logits'])} ({tokens} tokens x vocab/tp x {terms.LOGIT_BYTES} B, "
                f"logprobs_from_logits){PENDING}"
            ),
            f"  CUDA/NCCL        {_size(g['overhead'])} (documented constant){PENDING}",
            f"  GPU total        {_size(w.gpu_total)} of launch.gpu_memory_gb={ln.gpu_memory_gb:g}",
        ]
        h = self.worst_host
        limit = "unchecked" if ln.host_memory_gb is None else f"{ln.host_memory_gb:g}"
        out.append(f"host per rank | per node ({node} GPUs):")
        for key, words in (
            ("offloaded_optimizer", "offloaded optimizer"),
            ("hf_import", "HF import peak   "),
            ("records", "records (share)  "),
            ("checkpoint_buffer", "save buffer      "),
        ):
            out.append(f"  {words.ljust(19)}{_size(h.host[key])} | {_size(node * h.host[key])}")
        out.append(
            f"  host total         {_size(h.host_total)} | {_size(node * h.host_total)} of launch.host_memory_gb="
            f"{limit} (optimizer + records + the larger of HF import and save buffer)"
        )
        ckpt = max(r.checkpoint_bytes for r in self.ranks)
        hf_read = max(r.hf_read_bytes for r in self.ranks)
        fs, net = ln.fs_bandwidth_gb_s, ln.network_bandwidth_gb_s
        out.append(f"disk per rank | per node ({node} GPUs):")
        out.append(
            f"  checkpoint save  {_size(ckpt)} | {_size(node * ckpt)} (x checkpoint.keep_last="
            f"{cfg.checkpoint.keep_last} kept); {node * ckpt / (fs * GB):.0f} s at launch.fs_bandwidth_gb_s={fs:g}"
        )
        out.append(
            f"  HF import read   {_size(hf_read)} | {_size(node * hf_read)}; "
            f"{node * hf_read / (fs * GB):.0f} s at launch.fs_bandwidth_gb_s={fs:g}"
        )
        sync, records = self.weight_sync_bytes, self.records_step_bytes
        out.append("network per step:")
        out.append(
            f"  weight sync      {_size(sync)} of {cfg.precision.params_dtype} weights to each rollout server; "
            f"{sync / (net * GB):.0f} s at "
            f"launch.network_bandwidth_gb_s={net:g}"
        )
        share = terms.records_bytes_per_rank(cfg, old.dp)
        out.append(f"  records          {_size(records)} per step ({_size(share).strip()} read per rank: its share)")
        return out


def job_plan(cfg: ExperimentConfig, world: int | None = None) -> JobPlan:
    """The plan for ``world`` learner ranks (default: ``launch.learner_nodes * launch.gpus_per_node``)."""
    ln = cfg.launch
    if world is None:
        world, world_from = ln.learner_nodes * ln.gpus_per_node, "launch.learner_nodes*launch.gpus_per_node"
    else:
        world_from = "the process count"
    return JobPlan(cfg, world, world_from, tuple(rank_plan(cfg, world, s) for s in range(cfg.parallel.pp)))


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:8.1f} GB" if nbytes >= 0.05 * GB else f"{nbytes / 1e6:8.2f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"
