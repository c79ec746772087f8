"""torchrun worker (2 ranks, gloo): the exact learner at pp=2 or tp=2 recomputes a true-on-policy run's records.

``parallel_exact_worker.py HF_DIR RECORDS OUT_DIR``: the learner of ``configs/tiny_cpu.yaml`` under the
exact gate's settings (``rollout.true_on_policy``, fp32), its weights imported from ``HF_DIR`` (the step-0 policy
of the run that made ``RECORDS``), recomputes every sample of ``RECORDS`` in right-padded microbatches through
the trainer's log-prob pass (``Learner.forward_logprobs``), capturing every MoE layer's natural top-k at every
position. Each rank writes ``OUT_DIR/rank<r>.json``, one entry per pass: ``log_ratio_abs_max`` and ``kl_k3``
against the records' behaviour log-probs (the trainer's estimator), ``flips`` (``{global MoE layer: positions
whose top-k differs from the recorded route}``, the layers this rank holds), ``routes`` (those top-k, per sample)
and ``logp`` (every response token).

The passes, in order: ``pp2``, ``parallel.pp=2`` (one decoder layer per stage, Megatron's 1F1B schedule);
``pp2_stock_attention_on_stage_1``, the same with ``kernels.attention`` swapped back to torch's stock SDPA on the
last stage only; ``tp2``, ``parallel.tp=2, etp=1`` (sequence parallel; the exact spec's norms, linears with the fixed-order
combine, LM head and whole-vocabulary log-softmax); then, re-initialised at tp=1 (2 data-parallel ranks), the
stock tp=1 exact learner (``tp1``: what the tp=1 server computes), and the same with every non-expert
row-parallel linear splitting K into 2 blocks (``tp1_blocks2``: ``tp_blocks=2``, the tp=1 side of TBIK).
After the tp=2 passes and again after the tp=1 ones, one training step (the mean NLL of the first microbatch's
response tokens, the same batch on every rank): ``train_tp2`` / ``train_tp1`` hold its grad norm and, at tp=2, the
largest difference between the two tp ranks' copies of each expert weight (etp=1: every rank holds every expert).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_rl.config import load_config
from moe_rl.exact import kernels
from moe_rl.learner.dist import destroy_distributed, init_distributed
from moe_rl.learner.exact_spec import ExactRowParallelLinear
from moe_rl.learner.train_step import Learner, default_logprob_fn
from moe_rl.records import RolloutBatch
from moe_rl.train.warm_start import _nll_loss
from tests.exact.conftest import GATE

ROOT = Path(__file__).resolve().parents[2]
MICRO = 4  # the gate's train.micro_batch_size


def stock_attention(q, k, v, start):
    """torch's causal SDPA over whole sequences (the learner calls the kernel with ``start=0``)."""
    rep = q.shape[1] // k.shape[1]
    kv = [t.float().repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v)]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), *kv, is_causal=True)
    return out.transpose(0, 1).to(q.dtype)


def microbatches(samples, multiple: int):
    """Right-padded microbatches of ``MICRO`` samples (targets -1 and ``padding_mask`` on the padding), their length
    a multiple of ``multiple`` (sequence parallelism splits it over the tp ranks)."""
    mbs = []
    for i in range(0, len(samples), MICRO):
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples[i : i + MICRO]]
        T = max(len(t) for t in seqs) - 1
        T += (-T) % multiple
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        targets = torch.full((len(seqs), T), -1, dtype=torch.long)
        for b, t in enumerate(seqs):
            ids[b, : len(t) - 1] = torch.as_tensor(t[:-1])
            targets[b, : len(t) - 1] = torch.as_tensor(t[1:])
        mbs.append({"input_ids": ids, "targets": targets, "padding_mask": targets < 0})
    return mbs


def moe_layer_ids(learner, cfg) -> dict:
    """``{id(router): global MoE layer index}`` for this rank's routers (Megatron's global layer numbers)."""
    pattern = cfg.model.moe_layer_pattern()
    out = {}
    for layer in learner.module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            out[id(router)] = sum(pattern[: layer.layer_number - 1])
    return out


def _whole_sequence(routing_map: torch.Tensor) -> torch.Tensor:
    """A router's ``routing_map`` of this tp rank's sequence chunk -> the whole microbatch's (seq-major rows)."""
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return routing_map
    parts = [torch.empty_like(routing_map) for _ in range(tp)]
    dist.all_gather(parts, routing_map.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts)


def recompute(learner, cfg, samples) -> dict:
    mbs = microbatches(samples, ps.get_tensor_model_parallel_world_size())
    layer_of = moe_layer_ids(learner, cfg)
    maps: dict[int, list] = {lid: [] for lid in layer_of.values()}
    hooks = [
        m.register_forward_hook(lambda mod, _i, out: maps[layer_of[id(mod)]].append(_whole_sequence(out[1].detach())))
        for m in learner.module.modules()
        if isinstance(m, TopKRouter)
    ]
    learner.model.eval()
    try:
        with torch.no_grad():
            logps = learner.forward_logprobs(mbs, default_logprob_fn, cfg.rollout.temperature)
    finally:
        for h in hooks:
            h.remove()
    got, want, flips, routes = [], [], {lid: 0 for lid in maps}, {lid: [] for lid in maps}
    for j, (mb, logp) in enumerate(zip(mbs, logps)):
        B, T = mb["input_ids"].shape
        for b, s in enumerate(samples[j * MICRO : (j + 1) * MICRO]):
            P, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
            got.append(logp[b, P - 1 : n - 1])
            want.append(torch.as_tensor(s.rollout_logp, dtype=torch.float32))
            recorded = torch.as_tensor(s.routes.astype("int64")).sort(-1).values  # [n - 1, L_moe, k]
            for lid, per_mb in maps.items():
                routing_map = per_mb[j].view(T, B, -1)[: n - 1, b]  # Megatron's rows are [T, B], seq-major
                top = routing_map.nonzero()[:, 1].view(n - 1, -1)
                flips[lid] += int((top != recorded[:, lid]).any(-1).sum())
                routes[lid].append(top.tolist())
    logp = torch.cat(got)
    r = (logp - torch.cat(want)).double()
    return {
        "log_ratio_abs_max": float(r.abs().max()),
        "kl_k3": float((torch.expm1(r) - r).mean()),
        "flips": flips,
        "routes": routes,
        "logp": logp.tolist(),
    }


def train_once(learner, samples) -> dict:
    """One step on the first microbatch (the same on every rank); its grad norm and, over the tp group, the largest
    difference between the ranks' copies of each expert weight afterwards."""
    mb = microbatches(samples, ps.get_tensor_model_parallel_world_size())[0]
    mb["mask"] = (mb["targets"] >= 0).float()
    stats = learner.train_step([mb], _nll_loss)
    diff, group = 0.0, ps.get_tensor_model_parallel_group()
    for name, p in learner.module.named_parameters():
        if ".mlp.experts." in name and ps.get_tensor_model_parallel_world_size() > 1:
            parts = [torch.empty_like(p.detach()) for _ in range(group.size())]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            diff = max(diff, max(float((q - parts[0]).abs().max()) for q in parts))
    return {"grad_norm": float(stats.grad_norm), "expert_replica_diff": diff}


def learner(hf_dir: str, *parallel: str):
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [*GATE[:4], *parallel, f"checkpoint.init_from_hf={hf_dir}"])
    init_distributed(cfg.parallel)
    return Learner(cfg), cfg


def main() -> None:
    hf_dir, records, out_dir = sys.argv[1:]
    samples = RolloutBatch.load(records).samples()
    report = {}
    lrn, cfg = learner(hf_dir, "parallel.pp=2")
    report["pp2"] = recompute(lrn, cfg, samples)
    stock = kernels.attention
    if dist.get_rank() == 1:  # the last stage only: one contract item swapped back on one stage
        kernels.attention = stock_attention
    report["pp2_stock_attention_on_stage_1"] = recompute(lrn, cfg, samples)
    kernels.attention = stock
    lrn, cfg = learner(hf_dir, "parallel.tp=2", "parallel.etp=1")
    report["tp2"] = recompute(lrn, cfg, samples)
    report["train_tp2"] = train_once(lrn, samples)
    lrn, cfg = learner(hf_dir, "parallel.etp=1")
    report["tp1"] = recompute(lrn, cfg, samples)
    split = [m for m in lrn.module.modules() if isinstance(m, ExactRowParallelLinear) and not m.is_expert]
    assert split, "no non-expert row-parallel linear"
    for m in split:
        m.tp_blocks = 2
    report["tp1_blocks2"] = recompute(lrn, cfg, samples)
    report["train_tp1"] = train_once(lrn, samples)
    rank = dist.get_rank()
    tmp = Path(out_dir) / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(Path(out_dir) / f"rank{rank}.json")
    destroy_distributed()


if __name__ == "__main__":
    main()
