"""torchrun worker (2 ranks, gloo, CPU tensors): tensor-parallel shards against the unsharded reference.

1. Keep Sampling Mask on vocab-sharded logits: each rank holds half the vocabulary; log-probs,
   outside-mask flags and gradients must equal the unsharded computation (float64).
2. Σ_v π_v² (``sum_pi_squared_from_logits``) on vocab-sharded logits against the unsharded softmax, and its
   kept-set form (``kept_sum_pi_squared``, Keep Sampling Mask) against the softmax over each row's kept set.
3. HF export gathering: a state dict sharded BY HAND here (column/row/SwiGLU/vocab splits written
   out below, not by the code under test) is gathered by ``gather_tp_shards`` and compared with the
   full one; ``tp_slice`` must give back each rank's hand shard.
Writes a JSON report to ``--out`` from rank 0.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_rl.learner.logprobs import sum_pi_squared_from_logits
from moe_rl.learner.tp_shards import gather_tp_shards, tp_slice
from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs, kept_sum_pi_squared

V, N, TP = 40, 9, 2


def ksm_check(rank: int) -> dict:
    g = torch.Generator().manual_seed(11)
    full = (torch.randn(N, V, generator=g) * 3).double()
    targets = torch.randint(0, V, (N,), generator=g)
    rows = []
    for i in range(N):
        if i % 3 == 0:
            rows.append(None)  # untruncated row: full softmax over both shards
        else:
            kept = torch.randperm(V, generator=g)[: 2 + i].tolist()
            if i % 4 == 1:  # sampled token missing from the engine's mask (cutoff disagreement)
                kept = [k for k in kept if k != int(targets[i])]
            elif int(targets[i]) not in kept:
                kept.append(int(targets[i]))
            rows.append(kept)
    rows[2] = [t for t in range(20) if t != int(targets[2])][:3] + [int(targets[2])]  # a set inside one shard
    kept = KeptSets.from_lists(rows)
    ref_logits = full.clone().requires_grad_(True)
    ref = keep_mask_logprobs(ref_logits, targets, kept, temperature=0.7)
    (ref.logp * torch.arange(1, N + 1)).sum().backward()
    shard = full[:, rank * V // TP : (rank + 1) * V // TP].clone().requires_grad_(True)
    got = keep_mask_logprobs(shard, targets, kept, temperature=0.7, tp_group=dist.group.WORLD)
    (got.logp * torch.arange(1, N + 1)).sum().backward()
    ref_grad = ref_logits.grad[:, rank * V // TP : (rank + 1) * V // TP]
    # Σπ² over each row's support (kept ∪ {target}; all of V when untruncated), by hand from the full logits
    want = []
    for i, row in enumerate(rows):
        support = list(range(V)) if row is None else sorted(set(row) | {int(targets[i])})
        want.append(torch.softmax(full[i, support] / 0.7, dim=-1).pow(2).sum())
    want = torch.stack(want)
    spp = kept_sum_pi_squared(full[:, rank * V // TP : (rank + 1) * V // TP], targets, kept, 0.7, dist.group.WORLD)
    return {
        "kept_spp_max_rel_diff": float(((spp - want).abs() / want).max()),
        "kept_spp_range": [float(want.min()), float(want.max())],
        "logp_max_diff": float((got.logp - ref.logp).abs().max()),
        "outside_equal": bool(torch.equal(got.outside_mask, ref.outside_mask)),
        "num_outside": ref.num_outside,
        "grad_max_diff": float((shard.grad - ref_grad).abs().max()),
        "max_abs_grad": float(ref_grad.abs().max()),
    }


def sum_pi_squared_check(rank: int) -> dict:
    """Σ_v π_v² on vocab shards (each rank half the vocabulary) against softmax(z/τ)² summed, float64."""
    g = torch.Generator().manual_seed(12)
    full = (torch.randn(2, N, V, generator=g) * 4).double()
    ref = torch.softmax(full / 0.7, dim=-1).pow(2).sum(-1)
    shard = full[..., rank * V // TP : (rank + 1) * V // TP]
    got = sum_pi_squared_from_logits(shard, temperature=0.7, tp_group=dist.group.WORLD)
    return {"max_rel_diff": float(((got - ref).abs() / ref).max()), "min": float(ref.min()), "max": float(ref.max())}


def full_state() -> dict:
    """A 1-layer MoE + 1 dense layer state with distinct values everywhere (H=8, 4 heads, 2 groups, d=4)."""
    g = torch.Generator().manual_seed(3)
    H, F, FE, E = 8, 12, 6, 2
    shapes = {
        "embedding.word_embeddings.weight": (V, H),
        "output_layer.weight": (V, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.layers.0.input_layernorm.weight": (H,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (2 * (2 + 2) * 4, H),
        "decoder.layers.0.self_attention.linear_proj.weight": (H, 4 * 4),
        "decoder.layers.0.self_attention.q_layernorm.weight": (4,),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * F, H),
        "decoder.layers.0.mlp.linear_fc2.weight": (H, F),
        "decoder.layers.1.mlp.router.weight": (E, H),
        "decoder.layers.1.mlp.router.expert_bias": (E,),
        **{f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight": (2 * FE, H) for e in range(E)},
        **{f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight": (H, FE) for e in range(E)},
    }
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def hand_shard(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """Megatron's tp layout, written out by hand for the check."""
    if name.endswith("linear_fc1.weight"):  # SwiGLU: rank r holds [gate rows of r; up rows of r]
        half, per = t.shape[0] // 2, t.shape[0] // 2 // TP
        return torch.cat([t[rank * per : (rank + 1) * per], t[half + rank * per : half + (rank + 1) * per]])
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        per = t.shape[0] // TP  # qkv: one whole query group [q, q, k, v] per rank
        return t[rank * per : (rank + 1) * per]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        per = t.shape[1] // TP
        return t[:, rank * per : (rank + 1) * per]
    return t


def gather_check(rank: int) -> dict:
    full = full_state()
    local = {n: hand_shard(n, t, rank).clone() for n, t in full.items()}
    gathered = gather_tp_shards(local, tp_group=dist.group.WORLD, etp_group=dist.group.WORLD)
    mismatched = sorted(n for n in full if not torch.equal(gathered[n], full[n]))
    slices_wrong = sorted(n for n in full if not torch.equal(tp_slice(n, full[n], rank, TP), local[n]))
    return {
        "num_tensors": len(full),
        "gather_mismatched": mismatched,
        "slice_mismatched": slices_wrong,
        "names_equal": sorted(gathered) == sorted(full),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"ksm": ksm_check(rank), "gather": gather_check(rank), "spp": sum_pi_squared_check(rank)}
    reports = [None, None]
    dist.all_gather_object(reports, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(reports, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
