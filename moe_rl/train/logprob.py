"""The learner's per-token log-probs (and entropy) of a microbatch, with or without Keep Sampling Mask.

Owns the choice between the full-vocabulary softmax and the kept-set renormalisation and the
matching entropy: under Keep Sampling Mask both the log-prob and the entropy are over the
rollout's kept set, so μ, π_old and π_θ all live on the same truncated support (seed 000,
"Keep Sampling Mask"). Under ``rollout.true_on_policy`` the kept-set log-prob is the server's own
kernel (``moe_rl.exact.kernels.kept_token_logprobs``), so it equals the rollout's bit for bit.
Pad tokens are passed to Megatron as ``padding_mask``. The old-log-prob pass of the optimal token
baselines asks for Σ_v π_v² of the same distribution (full vocabulary or kept set) in place of the entropy.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from moe_rl.exact.kernels import kept_token_logprobs
from moe_rl.learner.logprobs import logprobs_from_logits, sum_pi_squared_from_logits, uses_exact, whole_vocab
from moe_rl.learner.model import forward_logits
from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs, kept_mask, kept_sum_pi_squared

__all__ = ["kept_set_entropy", "make_logprob_fn"]


def kept_set_entropy(logits: torch.Tensor, targets: torch.Tensor, kept: KeptSets, temperature: float) -> torch.Tensor:
    """Entropy ``H[N]`` of ``softmax(logits[N, V] / temperature)`` renormalised over each row's kept set.

    The support of row ``i`` is its kept ids plus ``targets[i]`` (the sampled token is always kept);
    an empty kept set means the full vocabulary. Differentiable w.r.t. ``logits``.
    """
    N, V = logits.shape
    z_all = logits.float() / temperature
    out = torch.empty(N, dtype=z_all.dtype, device=logits.device)
    lengths = kept.offsets.diff().to(logits.device)
    full = lengths == 0
    if bool(full.any()):
        p = torch.log_softmax(z_all[full], dim=-1)
        out[full] = -(p.exp() * p).sum(-1)
    rows = torch.arange(N, device=logits.device)
    trunc = rows[~full]
    if trunc.numel():
        seg = torch.repeat_interleave(rows, lengths)
        keys = torch.unique(torch.cat([seg * V + kept.ids.to(logits.device).long(), trunc * V + targets[trunc]]))
        seg, ids = keys // V, keys % V
        vals = z_all[seg, ids]
        row_max = torch.full((N,), float("-inf"), dtype=vals.dtype, device=logits.device)
        row_max = row_max.scatter_reduce(0, seg, vals.detach(), reduce="amax", include_self=True)
        e = torch.exp(vals - row_max[seg])
        sums = torch.zeros(N, dtype=vals.dtype, device=logits.device).index_add(0, seg, e)
        p = e / sums[seg]
        expected = torch.zeros(N, dtype=vals.dtype, device=logits.device).index_add(0, seg, p * vals)
        out[trunc] = (torch.log(sums) + row_max - expected)[trunc]
    return out


def _tp_group():
    """Megatron's tensor-parallel group when the vocabulary is sharded over it (tp > 1), else None."""

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def make_logprob_fn(keep_sampling_mask: bool, with_entropy: bool, sum_pi_squared: bool = False):
    """``fn(model, mb, temperature) -> (logp[B, T], entropy[B, T] | None)`` for a microbatch's tensors.

    ``keep_sampling_mask`` renormalises over ``mb["kept"]`` (required then: the loop refuses records
    without kept sets before it gets here). ``sum_pi_squared``: the second output is Σ_v π_v² ``[B, T]``
    (no gradient, all-reduced over the tp shards) of the distribution ``logp`` is of, instead of the entropy.
    """

    def logprob_fn(model, mb: dict, temperature: float):
        logits = forward_logits(model, mb["input_ids"], padding_mask=mb.get("padding_mask"))
        if not keep_sampling_mask:
            logp, entropy = logprobs_from_logits(
                logits,
                mb["targets"],
                temperature=temperature,
                with_entropy=with_entropy and not sum_pi_squared,
                exact=uses_exact(model),
            )
            if sum_pi_squared:
                return logp, sum_pi_squared_from_logits(logits, temperature=temperature, tp_group=_tp_group())
            return logp, entropy
        B, T, V = logits.shape
        targets = mb["targets"].clamp(min=0).reshape(-1)  # pad targets (-1) are outside the loss mask
        flat = logits.reshape(B * T, V)
        if uses_exact(model):  # the server's kernel, over whole vocabulary rows (gathered at tp > 1)
            whole = whole_vocab(flat)
            kept = kept_mask(mb["kept"], whole.shape[-1], flat.device)
            logp = kept_token_logprobs(whole, kept, targets, temperature).view(B, T)
        else:
            logp = keep_mask_logprobs(flat, targets, mb["kept"], temperature, tp_group=_tp_group()).logp.view(B, T)
        logp = torch.where(mb["targets"] >= 0, logp, torch.zeros_like(logp))
        if sum_pi_squared:
            return logp, kept_sum_pi_squared(flat, targets, mb["kept"], temperature, tp_group=_tp_group()).view(B, T)
        entropy = kept_set_entropy(flat, targets, mb["kept"], temperature).view(B, T) if with_entropy else None
        return logp, entropy

    return logprob_fn
