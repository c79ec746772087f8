"""Optimizer, LR schedule and model-parallel-aware gradient clipping for the learner.

Owns: wrapping the model in Megatron's ``DistributedDataParallel`` (fp32 grad
buffers; data-parallel and expert-data-parallel reductions with Megatron's
scaling), choosing the optimizer, the LR at each step, and the global grad norm.
Megatron's optimizer is used on GPU. On CPU, Megatron 0.16's ``FP32Optimizer``
allocates its loss scale with ``device='cuda'``, so ``torch.optim.AdamW`` takes
the same ``optim`` config names instead (same update rule, no fp32 master copy
for bf16 params).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_rl.learner.device import model_device

__all__ = ["wrap_ddp", "build_optimizer", "lr_at", "set_lr", "grad_norm_and_clip", "is_expert_param"]


def wrap_ddp(model):
    """Megatron DDP around ``model`` with fp32 grad buffers and no overlap (deterministic)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(model.config, ddp_cfg, model)


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """Megatron marks expert-parallel params with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def build_optimizer(ddp_model, optim_cfg, params_dtype: torch.dtype):
    """Adam from ``cfg.optim`` over ``ddp_model``'s params: Megatron's on GPU, torch AdamW on CPU.

    ``weight_decay`` applies to matrices only (norm weights and biases excluded),
    as in Megatron's default param groups.
    """
    if optim_cfg.optimizer != "adam":
        raise ValueError(f"optim.optimizer={optim_cfg.optimizer!r}; expected 'adam'")
    if torch.cuda.is_available():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        mcfg = OptimizerConfig(
            optimizer="adam", lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
            weight_decay=optim_cfg.weight_decay, adam_beta1=optim_cfg.adam_beta1,
            adam_beta2=optim_cfg.adam_beta2, adam_eps=optim_cfg.adam_eps,
            clip_grad=optim_cfg.clip_grad, bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype, use_distributed_optimizer=False,
        )
        return get_megatron_optimizer(mcfg, [ddp_model])
    decay, no_decay = [], []
    for p in ddp_model.parameters():
        if p.requires_grad:
            (decay if p.dim() > 1 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=optim_cfg.lr, betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2),
        eps=optim_cfg.adam_eps, foreach=False,
    )


def lr_at(step: int, optim_cfg, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warmup from ``lr/warmup`` to ``lr`` over ``lr_warmup_steps``, then
    constant, linear or cosine decay to ``min_lr`` at ``total_steps``.
    """
    lr, min_lr, warm = optim_cfg.lr, optim_cfg.min_lr, optim_cfg.lr_warmup_steps
    if step < warm:
        return lr * (step + 1) / warm
    if optim_cfg.lr_decay_style == "constant":
        return lr
    span = max(total_steps - warm, 1)
    frac = min(max(step - warm, 0) / span, 1.0)
    if optim_cfg.lr_decay_style == "linear":
        return lr - (lr - min_lr) * frac
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


def set_lr(optimizer, lr: float) -> None:
    """Set ``lr`` on every param group (torch or Megatron optimizer)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` as a float64 scalar on ``device`` (where the all-reduce runs)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return sum(g.double().pow(2).sum() for g in grads).to(device)


def grad_norm_and_clip(ddp_model, max_norm: float) -> float:
    """Global L2 norm of ``main_grad`` over all model-parallel ranks; clip in place to ``max_norm``.

    Dense grads are counted once per tp shard (tp-duplicated norms skipped) and
    summed over the tp x pp group; expert grads over the ep x etp x pp group.
    Data-parallel replicas hold identical grads after DDP's reduction and are
    not summed. ``max_norm <= 0`` only measures.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dense, expert, all_grads = [], [], []
    for p in ddp_model.parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            continue
        all_grads.append(g)
        if is_expert_param(p):
            expert.append(g)
        elif param_is_not_tensor_parallel_duplicate(p):
            dense.append(g)
    # nccl reduces on the GPU, gloo on the host: keep the partial sums where the grads are.
    device = all_grads[0].device if all_grads else model_device(ddp_model)
    dense_sq, expert_sq = _sq_norm(dense, device), _sq_norm(expert, device)
    if dist.is_initialized():
        dist.all_reduce(dense_sq, group=ps.get_model_parallel_group())
        dist.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    total = math.sqrt(float(dense_sq) + float(expert_sq))
    if max_norm > 0 and total > max_norm:
        # Same rule as torch/Megatron: scale by max_norm / (norm + eps).
        coeff = max_norm / (total + 1e-6)
        for g in all_grads:
            g.mul_(coeff)
    return total
