"""Pipeline-parallel passes of the learner (``parallel.pp > 1``) through Megatron-Core's schedule.

Owns running one list of microbatches through ``get_forward_backward_func`` (non-interleaved 1F1B;
the config has no virtual-pipeline key, and a model built with one is refused here) and handing what the last stage computed to every
stage, so the callers (``moe_rl.train.update``, the reference policy) see exactly what a pp=1 run
sees. With pp = 1 nothing here runs: the learner keeps its own loop (bit-identical to before).

Stages: the first stage embeds ``input_ids``, every stage runs its own decoder layers (global layer
numbers, so routing replay binds its own MoE layers), the last stage scores the logits with the
caller's ``logprob_fn`` (Keep Sampling Mask included) and computes the loss. Megatron sends the
hidden states between stages; microbatches are ragged, hence ``variable_seq_lengths=True``
(``moe_rl.learner.model``).

Loss contract (Megatron, pipeline_parallel/schedules.py ``forward_step_calc_loss``): a ``loss_func``
returning ``(loss, metrics)`` has its loss multiplied by the context-parallel size and divided by the
number of microbatches before backward. The update's losses are already divided by their step-global
denominator and must be back-propagated as ``loss * loss_scale`` (as the pp = 1 loop does), so the
returned loss is ``loss * loss_scale * n / cp``; the MoE aux-loss scale Megatron sets (``cp / n``) is
the one the pp = 1 loop sets itself. Gradient finalisation (``finalize_model_grads``) stays with the
caller, once, after the schedule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_rl.learner.device import model_device
from moe_rl.learner.mcore_compat import pipeline_schedule
from moe_rl.learner.model import forward_logits

__all__ = [
    "from_last_stage",
    "is_last_stage",
    "object_from_last_stage",
    "pipeline_logprobs",
    "pipeline_size",
    "pipeline_train",
]


def pipeline_size() -> int:
    """Megatron's pipeline-parallel size (1 when Megatron is not initialised)."""

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def is_last_stage() -> bool:
    return pipeline_size() == 1 or ps.is_pipeline_last_stage()


def _last_rank_and_group():
    return ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()


def from_last_stage(t: torch.Tensor | None, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The last stage's ``t`` on every stage of this pipeline (``t`` is ignored elsewhere; pp=1: ``t``)."""
    if pipeline_size() == 1:
        return t
    src, group = _last_rank_and_group()
    if is_last_stage():
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"last pipeline stage holds a tensor of shape {tuple(t.shape)}; expected {tuple(shape)}")
        buf = t.to(dtype).contiguous()
    else:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.broadcast(buf, src=src, group=group)
    return buf


def object_from_last_stage(obj):
    """The last stage's picklable ``obj`` on every stage (pp=1: ``obj``)."""
    if pipeline_size() == 1:
        return obj
    src, group = _last_rank_and_group()
    box = [obj if is_last_stage() else None]
    # size: the caller's per-step scalars (losses and metrics of one step, a flag): a few KB, never tensors of the model
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _stage_forward(model, mb: dict) -> torch.Tensor:
    """A first / middle stage: the decoder layers it holds -> hidden states ``[S, B, H]`` for the next."""
    return forward_logits(
        model, mb["input_ids"], segment_ids=mb.get("segment_ids"), padding_mask=mb.get("padding_mask")
    )


def _run(model, microbatches: list[dict], on_last, forward_only: bool) -> None:
    """Run ``microbatches`` through the schedule; ``on_last(model, mb) -> (output, loss_func)`` on the last stage."""
    vpp = getattr(model.config, "virtual_pipeline_model_parallel_size", None)
    if vpp:
        raise NotImplementedError(
            f"virtual_pipeline_model_parallel_size={vpp}: moe_rl runs the non-interleaved "
            "pipeline schedule only; build the model without virtual stages"
        )
    last = is_last_stage()

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        if last:
            return on_last(m, mb)
        return _stage_forward(m, mb), None

    schedule = pipeline_schedule()
    # variable_seq_lengths: the stages exchange each microbatch's real shape; these are only upper bounds
    seq_length = max(mb["input_ids"].shape[1] for mb in microbatches)
    micro_batch_size = max(mb["input_ids"].shape[0] for mb in microbatches)
    schedule(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def pipeline_logprobs(model, microbatches: list[dict], logprob_fn, temperature: float, both: bool = False) -> list:
    """Forward-only: each microbatch's ``logp[B, T]`` (fp32), computed on the last stage, on every stage.
    ``both``: ``(logp, second)`` pairs with ``logprob_fn``'s second output ``[B, T]`` (fp32) as well."""
    if not microbatches:
        return []
    out: list[torch.Tensor] = []

    def on_last(m, mb):
        logp, second = logprob_fn(m, mb, temperature)
        out.append(torch.stack([logp.detach().float(), second.detach().float()]) if both else logp.detach().float())
        return logp, lambda output: (output.new_zeros(()), {})

    _run(model, microbatches, on_last, forward_only=True)
    device = model_device(model)
    if both:
        pairs = [
            from_last_stage(out[i] if out else None, (2, *mb["targets"].shape), torch.float32, device)
            for i, mb in enumerate(microbatches)
        ]
        return [(p[0], p[1]) for p in pairs]
    return [
        from_last_stage(out[i] if out else None, mb["targets"].shape, torch.float32, device)
        for i, mb in enumerate(microbatches)
    ]


def pipeline_train(
    model, microbatches: list[dict], logprob_fn, loss_fn, temperature: float, loss_scale: float
) -> tuple[list[float], list[dict]]:
    """Forward + backward of every microbatch; returns the last stage's ``(losses, metrics)`` on every stage.

    Each microbatch's gradient is that of ``loss_fn(...)[0] * loss_scale`` (see the module docstring).
    """

    n, cp = len(microbatches), ps.get_context_parallel_world_size()
    factor = float(loss_scale) * n / cp
    losses: list[float] = []
    metrics: list[dict] = []

    def on_last(m, mb):
        logp, entropy = logprob_fn(m, mb, temperature)

        def loss_func(_output):
            loss, met = loss_fn(logp, entropy, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss; got shape {tuple(loss.shape)}")
            losses.append(float(loss.detach()))
            metrics.append({k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in met.items()})
            return loss * factor, {}

        return logp, loss_func

    _run(model, microbatches, on_last, forward_only=False)
    return object_from_last_stage((losses, metrics))
