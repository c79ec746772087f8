"""Teacher-forced references from the same checkpoint loaded with HF `transformers` (not SGLang code).

Used as the independent oracle for routes, log-probs and sampling masks in the rollout tests.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3MoeForCausalLM


def load_hf_model(model_dir, dtype: torch.dtype):
    return Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.no_grad()
def teacher_forced(model, token_ids: np.ndarray, moe_layer_ids) -> tuple[np.ndarray, np.ndarray]:
    """Forward `token_ids[T]`; return (router_logits float32 [T, L_moe, E], logits float32 [T, V])."""
    captured = {}
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(
            lambda _m, _inp, out, i=i: captured.__setitem__(i, out[0].float())
        )
        for i in moe_layer_ids
    ]
    try:
        logits = model(torch.as_tensor(token_ids, dtype=torch.long)[None]).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    router = torch.stack([captured[i] for i in moe_layer_ids], dim=1)
    return router.numpy(), logits.numpy()


def topk_sets(router_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted top-k expert ids [T, L, k] and the k-th minus (k+1)-th logit margin [T, L]."""
    order = np.argsort(-router_logits, axis=-1, kind="stable")
    ranked = np.take_along_axis(router_logits, order, axis=-1)
    return np.sort(order[..., :k], axis=-1), ranked[..., k - 1] - ranked[..., k]


def kept_set(logits_row: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[set[int], float]:
    """Tokens a top-k/top-p sampler keeps at one position, and the smallest decision margin.

    Semantics (shared/notes/sglang-on-cpu.md): rank < top_k and the probability mass of the tokens
    ranked above it, in the full temperature-scaled distribution, is <= top_p.
    The margin is min(|mass_above - top_p|) over candidates, so a caller can skip ambiguous rows.
    """
    z = logits_row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    keep = (np.arange(len(p)) < top_k) & (above <= top_p)
    margin = float(np.min(np.abs(above[:top_k] - top_p))) if top_k > 0 else 1.0
    return {int(t) for t in order[keep]}, margin


def routes_agree(router_logits: np.ndarray, routes: np.ndarray, k: int) -> np.ndarray:
    """bool [T, L]: the served experts `routes[T, L, k]` are a top-k set of the reference logits.

    Equal to the reference's own top-k set, or an equally valid choice when the reference has an
    exact tie at the k-th place (every served expert's logit >= the k-th largest logit).
    """
    ref, _ = topk_sets(router_logits, k)
    same = (np.sort(routes.astype(np.int64), axis=-1) == ref).all(axis=-1)
    kth = -np.sort(-router_logits, axis=-1)[..., k - 1]
    served = np.take_along_axis(router_logits, routes.astype(np.int64), axis=-1)
    return same | (served.min(axis=-1) >= kth)
