"""What one ``/generate`` request asks for: the sampling settings, each sample's seed, and the JSON body.

Owns ``SamplingSettings`` (``rollout.temperature`` / ``top_p`` / ``top_k`` / ``max_new_tokens``), ``sample_seed`` (a
sample's ``sampling_seed``, stable across runs), the ``top_k`` a request sends when sampling masks are asked for
(``wire_top_k``) and the body itself (``generate_body``: log-probs, routed experts from ``routes_start_len``,
sampling masks, the stop ids). Which server it goes to is ``moe_rl.rollout.dispatch``'s; sending it is the client's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingSettings", "generate_body", "sample_seed", "wire_top_k"]


@dataclass(frozen=True)
class SamplingSettings:
    """Per-request sampling; `top_k=-1` means no top-k (sent as min(vocab_size, mask cap) when masks are asked for)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16

    @classmethod
    def from_rollout_config(cls, rollout) -> SamplingSettings:
        return cls(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_new_tokens)


def sample_seed(base_seed: int, step: int, group_id: int, sample_index: int) -> int:
    """The `sampling_seed` of one sample: a uint32 hash of (seed, step, group, index), stable across runs."""
    entropy = [int(base_seed), int(step), int(group_id), int(sample_index)]
    if min(entropy) < 0:
        raise ValueError(f"seed, step, group_id and sample_index must be >= 0; got {entropy}")
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])


def wire_top_k(sampling: SamplingSettings, masks: bool, cap: int, vocab_size: int) -> int:
    """The ``top_k`` sent: the config's, or with masks and no top-k, ``min(vocab_size, cap)`` (SGLang returns masks
    only for a finite top_k <= its cap); an impossible combination is a ValueError naming the keys."""
    top_k = sampling.top_k
    if not masks or top_k != -1:
        if masks and top_k > cap:
            raise ValueError(f"rollout.top_k={top_k} exceeds rollout.sampling_mask_max_tokens={cap}")
        return top_k
    # Top-p-only sampling sends top_k = cap (the nucleus, cut at the cap's most likely tokens: the mask is the set
    # really sampled from).
    if vocab_size > cap and sampling.top_p >= 1.0:
        raise ValueError(
            f"sampling masks with rollout.top_k=-1 and rollout.top_p=1 (untruncated) need "
            f"rollout.sampling_mask_max_tokens >= vocab size ({vocab_size}), got {cap}; request no masks"
        )
    return min(vocab_size, cap)


def generate_body(
    prompt_ids: Sequence[int],
    sampling: SamplingSettings,
    top_k: int,
    *,
    seed: int | None,
    routes: bool,
    masks: bool,
    stop_token_ids: Sequence[int] | None = None,
    routes_start_len: int = 0,
    max_new_tokens: int | None = None,
) -> dict:
    """JSON body of one ``/generate`` request (``max_new_tokens`` overrides the settings': an aborted sample's rest)."""
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": top_k,
        "max_new_tokens": sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens),
    }
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed  # honoured only with --enable-deterministic-inference
    return {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": params,
        "return_logprob": True,
        "return_routed_experts": routes,
        "return_sampling_mask": masks,
    } | ({"routed_experts_start_len": int(routes_start_len)} if routes_start_len else {})
