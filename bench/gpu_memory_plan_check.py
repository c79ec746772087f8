"""GPU check of the memory plan's bf16 optimizer bytes (one GPU, world 1): run on a lent GPU machine.

Builds the learner's bf16 MoE model on the GPU (moe_rl.learner.model.build_model), wraps it in Megatron
DDP (fp32 grad buffer, as the learner does) and builds Megatron-Core's own optimizer
(``get_megatron_optimizer``) for each setting the shipped configs use; after one step it measures the
GPU bytes the optimizer added (``torch.cuda.memory_allocated``) and the host tensors it holds, and
prints them next to ``moe_rl.config.memory_plan.optimizer_bytes_per_element`` x the local elements.
Prints one JSON line per setting. Usage: ``python bench/gpu_memory_plan_check.py``. Not run on a GPU yet
(docs/launch.md "Memory plan"); without Transformer Engine the precision-aware setting reports Megatron's
TypeError.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.moe.router_replay import RouterReplay

from moe_rl.config import ExperimentConfig
from moe_rl.config.memory_plan import optimizer_bytes_per_element
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.model import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {
    "plain": {},
    "distributed": {"use_distributed_optimizer": True},
    "distributed+offload": {"use_distributed_optimizer": True, "optimizer_cpu_offload": True},
    "distributed+offload+precision_aware": {
        "use_distributed_optimizer": True,
        "optimizer_cpu_offload": True,
        "use_precision_aware_optimizer": True,
    },
}


def cfg_for(optim: dict):
    model = {
        "num_layers": 2,
        "hidden_size": 512,
        "ffn_hidden_size": 1024,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "kv_channels": 64,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 512,
        "vocab_size": 4096,
    }
    return ExperimentConfig.model_validate(
        {
            "model": model,
            "precision": {"params_dtype": "bfloat16"},
            "optim": {"optimizer_offload_fraction": 1.0, **optim},
        }
    )


def host_bytes(opt) -> int:
    """Bytes of host tensors an optimizer (chained / distributed / hybrid) holds: params, grads, state."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and not t.is_cuda and t.dim() > 0 and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", o)
        for sub in getattr(inner, "sub_optimizers", [inner]):
            for group in sub.param_groups:
                for p in group["params"]:
                    add(p)
                    add(p.grad)
            for state in sub.state.values():
                for t in state.values():
                    add(t)
    return total


def run(name: str, optim: dict) -> dict:
    cfg = cfg_for(optim)
    RouterReplay.clear_global_router_replay_instances()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = build_model(cfg)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=bool(optim.get("use_distributed_optimizer")),
        ),
        model,
    )
    n = sum(p.numel() for p in ddp.parameters())
    before = torch.cuda.memory_allocated()
    mcfg = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=1.0,
        optimizer_offload_fraction=1.0,
        **optim,
    )
    opt = get_megatron_optimizer(mcfg, [ddp])
    for p in ddp.parameters():
        p.main_grad.normal_(0, 1e-3)
    opt.step()
    torch.cuda.synchronize()
    gpu = torch.cuda.memory_allocated() - before
    plan = optimizer_bytes_per_element(cfg)
    out = {
        "setting": name,
        "elements": n,
        "weights_and_grads_gpu_bytes": before - base,
        "plan_weights_and_grads": n * (2 + 4),
        "optimizer_gpu_bytes": gpu,
        "plan_optimizer_gpu": n * plan.gpu,
        "optimizer_host_bytes": host_bytes(opt),
        "plan_optimizer_host": n * plan.host,
        "optimizer": type(opt).__name__,
    }
    del opt, ddp, model
    return out


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init_distributed(cfg_for({}).parallel, environ={"MASTER_PORT": "29533"})
    for name, optim in SETTINGS.items():
        try:
            print(json.dumps(run(name, optim)), flush=True)
        except Exception as exc:  # noqa: BLE001 -- a device check: report each setting, go on
            print(json.dumps({"setting": name, "error": f"{type(exc).__name__}: {exc}"[:600]}), flush=True)


if __name__ == "__main__":
    main()
