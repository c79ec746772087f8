"""Input validation and masked reductions shared by every ``moe_rl.algo`` module.

Owns the tensor contract (``[B, T]`` log-probs with a response mask), the log-space
safety bound, and masked sums/means. It must not contain any algorithm.
"""

from __future__ import annotations

import torch

# exp(20) ~ 4.85e8: ratios are clamped to this in log space before exp so that
# neither a product of token ratios nor a single wild token can overflow
# (seed 000, section "Importance sampling correction").
LOG_RATIO_BOUND = 20.0

Metrics = dict[str, torch.Tensor]  # flat ``group/name`` -> detached 0-d tensor


def check_logp(name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate ``x[B, T]`` against ``mask[B, T]`` and return it in a compute dtype.

    Only positions inside the mask must be finite: padding may hold anything
    (zeros, -inf, NaN); non-finite padding is replaced by 0 so it can never leak.
    Half precision is upcast to float32 because ratios of bf16 log-probs lose
    the very differences the corrections measure.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor [B, T], got {type(x).__name__}")
    if x.shape != mask.shape:
        raise ValueError(f"{name}: expected shape {tuple(mask.shape)} (same as mask[B, T]), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating tensor of log-probs, got dtype {x.dtype}")
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    # Fast path, one pass: any NaN/inf anywhere makes the sum non-finite. Finite padding is
    # left as is — every reduction in moe_rl.algo selects with the mask, never multiplies.
    if bool(torch.isfinite(x.detach().sum())):
        return x
    bad = ~torch.isfinite(x) & mask
    if bool(bad.any()):
        idx = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}: expected finite values at every masked-in position, got {x[idx].item()} at {idx}")
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def check_mask(mask: torch.Tensor, *, allow_empty: bool = False) -> torch.Tensor:
    """Validate ``mask[B, T]`` (bool, or float holding only 0/1) and return it as bool."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected a torch.Tensor [B, T], got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"mask: expected 2 dims [B, T], got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if not mask.is_floating_point():
            raise TypeError(f"mask: expected dtype bool or a float 0/1 tensor, got {mask.dtype}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask: a float mask must hold only 0.0 and 1.0")
        mask = mask.bool()
    if not allow_empty and not bool(mask.any()):
        raise ValueError(f"mask: expected at least one valid (True) token, got all False, shape {tuple(mask.shape)}")
    return mask


def check_seq_or_token(name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate ``x[B]`` or ``x[B, T]`` and broadcast it to ``[B, T]`` (padding zeroed)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor [B] or [B, T], got {type(x).__name__}")
    if x.dim() == 1:
        if x.shape[0] != mask.shape[0]:
            raise ValueError(f"{name}: expected shape ({mask.shape[0]},) or {tuple(mask.shape)}, got {tuple(x.shape)}")
        x = x[:, None].expand_as(mask)
    return check_logp(name, x, mask)


def check_positive(name: str, value: float, *, upper_exclusive: float | None = None) -> float:
    """Return ``value`` as float if it is a finite number > 0 (and < ``upper_exclusive``)."""
    v = float(value)
    if not (v > 0 and v != float("inf")) or (upper_exclusive is not None and v >= upper_exclusive):
        bound = f" and < {upper_exclusive}" if upper_exclusive is not None else ""
        raise ValueError(f"{name}: expected a finite number > 0{bound}, got {value!r}")
    return v


def check_nonneg(name: str, value: float) -> float:
    """Return ``value`` as float if it is a finite number ≥ 0."""
    v = float(value)
    if not (v >= 0 and v != float("inf")):
        raise ValueError(f"{name}: expected a finite number ≥ 0, got {value!r}")
    return v


def log_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``clamp(num - den, ±20)`` elementwise: a log-ratio that is safe to exponentiate."""
    return (num - den).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x[B, T]`` over ``mask[B, T]`` (all, or along ``dim``)."""
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x[B, T]`` over ``mask[B, T]``; an empty row/batch gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Max of ``x[B, T]`` over ``mask[B, T]``; an empty row gives -inf."""
    x = torch.where(mask, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device))
    return x.max() if dim is None else x.max(dim).values


def masked_min(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Min of ``x[B, T]`` over ``mask[B, T]``; an empty row gives +inf."""
    x = torch.where(mask, x, torch.full((), float("inf"), dtype=x.dtype, device=x.device))
    return x.min() if dim is None else x.min(dim).values


def seq_valid(mask: torch.Tensor) -> torch.Tensor:
    """``valid[B]``: sequences with at least one token in ``mask[B, T]``."""
    return mask.any(dim=1)


def metric(x: torch.Tensor | float) -> torch.Tensor:
    """A detached float32 0-d tensor for the metrics dict (no host sync here)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float32).reshape(())
    return torch.tensor(float(x), dtype=torch.float32)


def metrics_to_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert a metrics dict to Python floats with a single device sync."""
    keys = list(metrics)
    if not keys:
        return {}
    values = [metric(metrics[k]) for k in keys]
    device = values[0].device
    return dict(zip(keys, torch.stack([v.to(device) for v in values]).tolist()))
