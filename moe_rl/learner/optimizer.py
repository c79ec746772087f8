"""Optimizer, LR schedule and model-parallel-aware gradient clipping for the learner.

Owns: wrapping the model in Megatron's ``DistributedDataParallel`` (fp32 grad
buffers; data-parallel and expert-data-parallel reductions with Megatron's
scaling), choosing the optimizer, the LR at each step, and the global grad norm.
Megatron's optimizer is used on GPU, and everywhere with ``optim.use_distributed_optimizer``
(Megatron's ``DistributedOptimizer``: fp32 master and Adam state sharded over the data-parallel
ranks, over the expert-data-parallel ranks for experts; on CPU built and stepped inside
``mcore_compat.megatron_optimizer_device``). Without it on CPU, Megatron 0.16's ``FP32Optimizer``
allocates its loss scale with ``device='cuda'``, so ``torch.optim.AdamW`` takes
the same ``optim`` config names instead (same update rule, no fp32 master copy
for bf16 params).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from moe_rl.learner.device import model_device
from moe_rl.learner.fp8 import te_available
from moe_rl.learner.mcore_compat import megatron_optimizer_device

__all__ = [
    "build_optimizer",
    "grad_norm_and_clip",
    "is_expert_param",
    "lr_at",
    "megatron_step",
    "set_lr",
    "uses_megatron_optimizer",
    "wrap_ddp",
]


def wrap_ddp(model, use_distributed_optimizer: bool = False):
    """Megatron DDP around ``model`` with fp32 grad buffers and no overlap (deterministic); with the distributed
    optimizer its grad buffers are reduce-scattered and its params all-gathered after each step."""

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    _mark_replicated_experts(model)
    with megatron_optimizer_device():
        return DistributedDataParallel(model.config, ddp_cfg, model)


def _mark_replicated_experts(model) -> None:
    """Expert weights reduce over the expert-data-parallel group whenever it is not the data-parallel one.

    Megatron marks an expert weight ``allreduce=False`` (DDP's expert buffer, reduced over the expert-dp group) only
    when ep > 1 (``tensor_parallel.layers``: ``not (is_expert and expert_parallel)``). At ep = 1 with etp != tp the
    two groups differ: at tp=2, etp=1 both tp ranks hold every expert and, under sequence parallelism, each trains
    it on its own half of the tokens, so reduced over the dp group only the two replicas drift apart from the first
    step (seen: 0.012 after 2 steps at lr 3e-3). Marking them expert weights there too reduces them over the
    expert-dp group and counts them once in the grad norm (``grad_norm_and_clip``)."""

    if not dist.is_initialized():
        return
    if ps.get_expert_data_parallel_world_size() == ps.get_data_parallel_world_size(with_context_parallel=True):
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def uses_megatron_optimizer(optim_cfg) -> bool:
    """Megatron's optimizer on a GPU or with the distributed optimizer; torch AdamW otherwise (CPU)."""
    return torch.cuda.is_available() or bool(optim_cfg.use_distributed_optimizer)


def _check_options(optim_cfg) -> None:
    """Options this machine cannot run, refused by name (preflight refuses the combinations earlier)."""

    if optim_cfg.use_precision_aware_optimizer and not optim_cfg.optimizer_cpu_offload and not te_available():
        raise ValueError(
            "optim.use_precision_aware_optimizer=true needs Transformer Engine's FusedAdam (the "
            "lower-precision master and moments live in it), which this machine lacks; set it to "
            "false, or use it with optim.optimizer_cpu_offload=true on a GPU"
        )
    if optim_cfg.optimizer_cpu_offload and not torch.cuda.is_available():
        raise ValueError(
            "optim.optimizer_cpu_offload=true moves the optimizer state from the GPU to the host; "
            "this machine has no GPU (the state is on the host already): set it to false"
        )


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
    if uses_megatron_optimizer(optim_cfg):
        _check_options(optim_cfg)
        mcfg = OptimizerConfig(
            optimizer="adam",
            lr=optim_cfg.lr,
            min_lr=optim_cfg.min_lr,
            weight_decay=optim_cfg.weight_decay,
            adam_beta1=optim_cfg.adam_beta1,
            adam_beta2=optim_cfg.adam_beta2,
            adam_eps=optim_cfg.adam_eps,
            clip_grad=optim_cfg.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=optim_cfg.use_distributed_optimizer,
            optimizer_cpu_offload=optim_cfg.optimizer_cpu_offload,
            optimizer_offload_fraction=optim_cfg.optimizer_offload_fraction,
            use_precision_aware_optimizer=optim_cfg.use_precision_aware_optimizer,
        )
        with megatron_optimizer_device():
            optimizer = get_megatron_optimizer(mcfg, [ddp_model])
        # Megatron's groups carry ``wd_mult`` (0 for biases and 1-d params) but no ``weight_decay``, so torch's
        # default (optim.weight_decay) would decay every param; Megatron's own scheduler sets
        # ``weight_decay = wd * wd_mult`` each step (optimizer_param_scheduler.py ~294); moe_rl has no scheduler
        for group in optimizer.param_groups:
            group["weight_decay"] = optim_cfg.weight_decay * group.get("wd_mult", 1.0)
        return optimizer
    decay, no_decay = [], []
    for p in ddp_model.parameters():
        if p.requires_grad:
            (decay if p.dim() > 1 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups,
        lr=optim_cfg.lr,
        betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2),
        eps=optim_cfg.adam_eps,
        foreach=False,
    )


def megatron_step(optimizer) -> float:
    """``optimizer.step()`` of a Megatron optimizer (it clips to ``optim.clip_grad`` itself) -> the grad norm.

    FloatingPointError when Megatron skipped the step (inf / nan gradients).
    """
    with megatron_optimizer_device():
        ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise FloatingPointError("Megatron optimizer skipped the step (inf/nan gradients)")
    return float(grad_norm if grad_norm is not None else optimizer.get_grad_norm())


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
