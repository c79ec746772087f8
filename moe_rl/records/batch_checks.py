"""Validation of a rollout batch: every invariant its file implies, and its fit to a model.

Owns ``validate_batch`` (behind ``RolloutBatch.validate``) and ``LOGPROB_TOLERANCE``; it reads a batch,
never builds, changes or persists one (the layout and the file format are ``batch.py``'s).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from moe_rl.records.routes import RecordError, check_distinct_experts, compact_routes
from moe_rl.records.trajectory import check_trajectory, generated_mask
from moe_rl.records.versions import check_token_versions

__all__ = ["BASELINES", "LOGPROB_TOLERANCE", "reward_baselines", "validate_batch"]

# Largest log-prob accepted: the SGLang decoder's bound (sglang_meta._checked_logprobs), float rounding above 0.
LOGPROB_TOLERANCE = 1e-4
BASELINES = "reward_baselines"  # extra key: per sample, the reward of a greedy response to its prompt (ReMax)


def _sample_count(batch) -> int:
    """The number of samples most per-sample arrays agree on (so the error names the odd one out)."""

    counts = [
        len(a)
        for a in (
            batch.prompt_lens,
            batch.response_lens,
            batch.rewards,
            batch.group_ids,
            batch.weight_versions,
            batch.finish_reasons,
        )
    ]
    return Counter(counts).most_common(1)[0][0]


def reward_baselines(batch) -> np.ndarray | None:
    """``extra["reward_baselines"]`` as float64 ``[N]``, None when absent; a RecordError unless N finite numbers."""
    raw = batch.extra.get(BASELINES)
    if raw is None:
        return None
    try:
        out = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        out = None
    if out is None or out.shape != (len(batch.rewards),) or not np.isfinite(out).all():
        raise RecordError(
            f"extra.{BASELINES} must hold one finite number per sample ({len(batch.rewards)}); got {str(raw)[:80]}"
        )
    return out


def validate_batch(batch, model_cfg=None) -> None:
    """Raise ``RecordError`` naming the first inconsistent field.

    Without ``model_cfg`` it checks every invariant the file itself implies: lengths, integral
    non-negative token ids, finite log-probs <= ``LOGPROB_TOLERANCE`` (the SGLang decoder's bound),
    one route row per forwarded position of every sample, expert ids below the file's
    ``num_experts`` and distinct per token, mask offsets starting at 0 and growing by >= 1 per token.
    With ``model_cfg`` it also checks ids, lengths and route shapes against the model. A batch holding a
    share of the samples (``batch.held``) is checked on the token rows it holds.
    """
    n = _sample_count(batch)
    integer_arrays = (
        "prompt_ids",
        "prompt_lens",
        "response_ids",
        "response_lens",
        "group_ids",
        "mask_ids",
        "mask_offsets",
    )
    for name in integer_arrays:
        arr = getattr(batch, name)
        if arr is not None and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
            raise RecordError(f"{name} must be a 1-D integer array, got {arr.dtype} with shape {arr.shape}")
    for name, arr in (
        ("prompt_lens", batch.prompt_lens),
        ("response_lens", batch.response_lens),
        ("rewards", batch.rewards),
        ("group_ids", batch.group_ids),
    ):
        if len(arr) != n:
            raise RecordError(f"{name} has {len(arr)} entries; expected one per sample ({n})")
    if len(batch.weight_versions) != n or len(batch.finish_reasons) != n:
        raise RecordError(f"weight_versions/finish_reasons must have one entry per sample ({n})")
    reward_baselines(batch)  # ReMax's: one finite number per sample when present
    if (batch.response_lens < 1).any() or (batch.prompt_lens < 1).any():
        raise RecordError("every sample needs >= 1 prompt token and >= 1 response token")
    held_prompt, held_response = batch.held_lens(batch.prompt_lens), batch.held_lens(batch.response_lens)
    if len(batch.prompt_ids) != held_prompt.sum() or len(batch.response_ids) != held_response.sum():
        raise RecordError("prompt_ids/response_ids lengths disagree with prompt_lens/response_lens")
    for name in ("prompt_ids", "response_ids", "mask_ids"):
        ids = getattr(batch, name)
        if ids is not None and ids.size and ids.min() < 0:
            raise RecordError(f"{name} has a negative token id ({int(ids.min())})")
    for name in ("rollout_logp", "sampling_logp"):
        values = getattr(batch, name)
        if values is None:
            continue
        if values.shape != (int(batch.response_lens.sum()),):
            raise RecordError(f"{name} has shape {values.shape}; expected ({int(batch.response_lens.sum())},)")
        bad = ~np.isfinite(values)
        if bad.any():
            raise RecordError(
                f"{name} has {int(bad.sum())} non-finite values (first at flat token {int(np.argmax(bad))})"
            )
        bad = values > LOGPROB_TOLERANCE
        if bad.any():
            t = int(np.argmax(bad))
            value = float(values[t])
            raise RecordError(f"{name}[{t}] = {value:.6g} ({int(bad.sum())} positive); expected log-probs <= 0")
    if (batch.data_files is None) != (batch.data_rows is None):
        raise RecordError("data_files and data_rows must be stored together")
    if batch.data_rows is not None and (len(batch.data_rows) != n or len(batch.data_files) != n):
        raise RecordError(f"data_files/data_rows must have one entry per sample ({n})")
    if not np.isfinite(batch.rewards).all():
        raise RecordError("rewards must be finite")
    check_token_versions(batch)
    check_trajectory(batch)
    if batch.routes is not None:
        _check_routes(batch)
    if (batch.mask_ids is None) != (batch.mask_offsets is None):
        raise RecordError("mask_ids and mask_offsets must be stored together")
    if batch.mask_offsets is not None:
        offs = batch.mask_offsets
        if len(offs) != held_response.sum() + 1 or offs[0] != 0 or offs[-1] != len(batch.mask_ids):
            raise RecordError(
                "mask_offsets must have one entry per response token + 1, start at 0 and end at len(mask_ids)"
            )
        sizes, generated = np.diff(offs), generated_mask(batch)
        if generated is not None and batch.held is not None:  # a share holds its samples' kept sets only
            ends = np.cumsum(batch.response_lens.astype(np.int64))
            generated = np.concatenate([generated[e - n : e] for e, n in zip(ends[batch.held], held_response)])
        empty = sizes < 1 if generated is None else (sizes < 1) & generated  # environment tokens: none
        if empty.any():
            t = int(np.argmax(empty))
            raise RecordError(
                f"mask_offsets must grow by >= 1 per token (every kept set holds the sampled token); "
                f"token {t} has a kept set of size {int(sizes[t])}"
            )
    if model_cfg is not None:
        _check_against_model(batch, model_cfg)


def _check_routes(batch) -> None:
    if batch.num_experts is None:
        raise RecordError("routes are stored but num_experts is not (metadata)")
    if batch.routes.ndim != 3:
        raise RecordError(f"routes must be [rows, moe_layers, top_k], got shape {tuple(batch.routes.shape)}")
    expected = int(batch.held_lens(batch.route_lens).sum())
    if batch.routes.shape[0] != expected:
        raise RecordError(
            f"routes has {batch.routes.shape[0]} rows; expected one per forwarded position, "
            f"sum(prompt_len + response_len - 1) = {expected}"
        )
    compact_routes(batch.routes, batch.num_experts)
    check_distinct_experts(batch.routes)


def _check_against_model(batch, model_cfg) -> None:
    vocab = model_cfg.vocab_size
    for name, ids in (
        ("prompt_ids", batch.prompt_ids),
        ("response_ids", batch.response_ids),
        ("mask_ids", batch.mask_ids),
    ):
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise RecordError(f"{name} must be in [0, model.vocab_size={vocab}), got [{ids.min()}, {ids.max()}]")
    lengths = batch.prompt_lens.astype(np.int64) + batch.response_lens
    if lengths.max() > model_cfg.seq_length:
        raise RecordError(f"a sample has {lengths.max()} tokens > model.seq_length={model_cfg.seq_length}")
    if batch.routes is None:
        return
    shape, m = tuple(batch.routes.shape), model_cfg
    if shape[1] != m.num_moe_layers:
        raise RecordError(
            f"routes has shape {shape}: records were made for {shape[1]} MoE layers; the model has "
            f"{m.num_moe_layers} (model.num_layers={m.num_layers}, model.moe_layer_freq={m.moe_layer_freq}, "
            f"model.first_k_dense_layers={m.first_k_dense_layers})"
        )
    if shape[2] != m.moe_router_topk:
        raise RecordError(
            f"routes has shape {shape}: records were made with top-{shape[2]} routing; "
            f"model.moe_router_topk={m.moe_router_topk}"
        )
    if batch.num_experts != model_cfg.num_moe_experts:
        raise RecordError(
            f"records were made for {batch.num_experts} experts; model.num_moe_experts={model_cfg.num_moe_experts}"
        )
    compact_routes(batch.routes, model_cfg.num_moe_experts)
    check_distinct_experts(batch.routes)
