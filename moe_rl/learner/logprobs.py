"""Per-token log-probs, entropy and Σ_v π_v² from (possibly vocab-sharded) learner logits.

Owns the fp32, temperature-scaled log-softmax over the *global* vocabulary when
the logits are split across tensor-parallel ranks (``logits[B, T, V/tp]``), and
the forward-then-score convenience used by the trainer and router replay.
Convention (see ``moe_rl.records.batch``): the learner input is ``tokens[:-1]``
and ``targets = tokens[1:]``, so ``logp[b, t] = log p(targets[b, t] | tokens[b, :t+1])``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from moe_rl.exact.kernels import token_logprobs
from moe_rl.learner.model import forward_logits, unwrap

__all__ = ["logprobs_from_logits", "response_logprobs", "sum_pi_squared_from_logits", "uses_exact", "whole_vocab"]


def uses_exact(model) -> bool:
    """Whether ``model`` was built for ``rollout.true_on_policy`` (its log-probs use ``kernels.token_logprobs``)."""
    return bool(getattr(unwrap(model), "moe_rl_exact", False))


def _tp_group():
    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum over ``group``: backward is the identity on each rank's shard."""
    if group is None:
        return t

    return reduce_from_tensor_model_parallel_region(t, group=group)


def whole_vocab(logits: torch.Tensor, group="auto") -> torch.Tensor:
    """``logits[..., V/tp]`` gathered into whole vocabulary rows ``[..., V]`` (a copy of each shard; backward:
    each rank keeps its shard's gradient): the exact mode normalises over a whole row in one kernel call, as the
    server does. Unsharded logits (tp = 1) are returned as they are."""
    group = _tp_group() if group == "auto" else group
    if group is None:
        return logits
    return gather_from_tensor_model_parallel_region(logits, group=group)


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    tp_group="auto",
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits[B, T, V/tp]``, ``targets[B, T]`` -> ``(logp[B, T], entropy[B, T] | None)``, fp32.

    ``logits / temperature`` is normalised over the full vocabulary (all tp
    shards). ``targets`` may be on another device (moved to ``logits.device``).
    ``targets < 0`` (padding) give ``logp = 0``. Both outputs carry
    gradients. ``tp_group="auto"`` uses Megatron's tensor-parallel group when
    tp > 1; pass ``None`` for unsharded logits.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits[B, T, V] and targets[B, T]; got logits {tuple(logits.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    group = _tp_group() if tp_group == "auto" else tp_group
    targets = targets.to(logits.device)
    if exact:  # rollout.true_on_policy: SGLang's deterministic-sampler log-softmax, bit for bit
        logits = whole_vocab(logits, group)
        lsm = token_logprobs(logits, temperature)
        picked = lsm.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logp = torch.where(targets >= 0, picked, torch.zeros_like(picked))
        entropy = -(lsm.exp() * lsm).sum(-1) if with_entropy else None
        return logp, entropy
    # One fp32 upcast shared by log-probs and entropy: bf16 log-softmax loses ~1e-2 nats.
    z = logits.float() / temperature
    local_v = z.shape[-1]
    v_start = dist.get_rank(group) * local_v if group is not None else 0

    # Global max for stability; it cancels analytically, so no gradient flows through it.
    z_max = z.detach().amax(dim=-1, keepdim=True)
    if group is not None:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    shifted = z - z_max
    exp = shifted.exp()
    sum_exp = _all_reduce_sum(exp.sum(dim=-1), group)
    log_z = sum_exp.log()  # [B, T], log-partition of the shifted logits

    local_t = targets - v_start
    in_shard = (local_t >= 0) & (local_t < local_v) & (targets >= 0)
    picked = shifted.gather(-1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _all_reduce_sum(torch.where(in_shard, picked, torch.zeros_like(picked)), group)
    logp = torch.where(targets >= 0, target_logit - log_z, torch.zeros_like(log_z))

    entropy = None
    if with_entropy:
        # H = log Z - E_p[z]  (shifted logits; the shift cancels).
        expected = _all_reduce_sum((exp * shifted).sum(dim=-1), group) / sum_exp
        entropy = log_z - expected
    return logp, entropy


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, *, temperature: float = 1.0, tp_group="auto") -> torch.Tensor:
    """``logits[B, T, V/tp]`` -> Σ_v π_v² ``[B, T]`` of softmax(logits / temperature) over the full vocabulary.

    The optimal token baselines' input (``moe_rl.algo.token_baselines``: w_t = 1 − 2π_t + Σ_v π_v²) and the
    exact form of ``logit_grad_sq_norm``. Max-shifted: with e = exp(z − max z), Σπ² = Σe² / (Σe)², both sums
    all-reduced over the tp shards in one call; verl's ``calculate_sum_pi_squared_from_logits`` (exp(lse(2z) −
    2 lse(z))) on whole logits. No gradient; at least fp32 (fp64 logits stay fp64). Called by the step's
    old-log-prob pass when the estimator reads it (``moe_rl.train.logprob.make_logprob_fn``).
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits[B, T, V]; got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    group = _tp_group() if tp_group == "auto" else tp_group
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    z_max = z.amax(dim=-1, keepdim=True)
    if group is not None:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    e = (z - z_max).exp()
    sums = torch.stack([e.sum(dim=-1), (e * e).sum(dim=-1)])  # one all-reduce for Σe and Σe²
    if group is not None:
        dist.all_reduce(sums, group=group)
    return sums[1] / (sums[0] * sums[0])


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward ``input_ids[B, T]`` and score ``targets[B, T]``: ``(logp[B, T], entropy[B, T] | None)``.

    Padded batch: right-pad ``input_ids`` with any id and ``targets`` with -1.
    Packed batch: concatenate samples along T and pass ``segment_ids[B, T]``; the
    last input of each sample has its own next token as target, so no target
    crosses a sample boundary. Select response tokens with the caller's mask. Inputs may be on any
    device; outputs are on the model's device.
    """

    logits = forward_logits(model, input_ids, segment_ids=segment_ids, padding_mask=padding_mask)
    return logprobs_from_logits(
        logits, targets, temperature=temperature, with_entropy=with_entropy, exact=uses_exact(model)
    )
