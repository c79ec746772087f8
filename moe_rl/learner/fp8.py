"""FP8 training settings: ``precision.fp8`` -> Megatron ``TransformerConfig`` fp8 fields.

Owns the mapping and the capability check. FP8 GEMMs run through Transformer
Engine layers (the TE layer spec) on a GPU; without both, the config is rejected
up front with a message naming what is missing, not deep inside a forward pass.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["fp8_runtime_missing", "fp8_transformer_fields", "te_available"]


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension can be imported."""
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except ModuleNotFoundError:
        return False


def fp8_transformer_fields(fp8_cfg) -> dict:
    """TransformerConfig keyword arguments for ``precision.fp8`` (``{}`` when fp8 is off).

    ``format`` e4m3 | hybrid -> ``fp8``; ``recipe`` delayed | tensorwise | blockwise
    -> ``fp8_recipe``; amax history/algorithm only matter for the delayed recipe but
    are passed through so the config round-trips. ``param_gather`` -> ``fp8_param``
    (weights kept in fp8 and all-gathered in fp8). ``disable_parameter_transpose_cache`` passes through: without
    it TE keeps quantised copies of every weight across micro-batches (counted by ``moe_rl.sizing``).
    """
    if fp8_cfg is None:
        return {}
    fields = {
        "fp8": fp8_cfg.format,
        "fp8_recipe": fp8_cfg.recipe,
        "fp8_amax_history_len": int(fp8_cfg.amax_history_len),
        "fp8_amax_compute_algo": fp8_cfg.amax_compute_algo,
        "fp8_param": bool(getattr(fp8_cfg, "param_gather", False)),
        "disable_parameter_transpose_cache": bool(getattr(fp8_cfg, "disable_parameter_transpose_cache", False)),
    }
    return fields


def fp8_runtime_missing(has_te: bool | None = None, has_cuda: bool | None = None) -> list[str]:
    """What this machine lacks to train in FP8 (empty list = ready)."""
    has_te = te_available() if has_te is None else has_te
    has_cuda = torch.cuda.is_available() if has_cuda is None else has_cuda
    missing = []
    if not has_cuda:
        missing.append("a CUDA GPU (FP8 GEMMs need Hopper/Blackwell tensor cores)")
    if not has_te:
        missing.append("Transformer Engine (pip install transformer-engine[pytorch])")
    return missing
