"""One optimizer step of the learner: microbatches -> loss -> backward -> clip -> step.

Owns the ``Learner`` (DDP-wrapped Megatron model + optimizer + step counter) and
its custom training loop. The loss is a callable, so the trainer plugs in
``moe_rl.algo.compute_policy_loss`` without this module knowing any algorithm.
Megatron's own schedule (``forward_backward_no_pipelining``) sets the MoE
aux-loss gradient scale; a custom loop must do it itself, which ``train_step`` does.
With ``parallel.pp > 1`` the microbatches go through Megatron's pipeline schedule instead
(``moe_rl.learner.pipeline``: same loss scaling, results from the last stage on every stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from moe_rl.config.hf_model import initial_weights_dir, side_files_dir
from moe_rl.learner.device import model_device, to_device
from moe_rl.learner.dist import deterministic_kernels
from moe_rl.learner.hf_export import export_hf_checkpoint
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_model, unwrap
from moe_rl.learner.optimizer import (
    build_optimizer,
    grad_norm_and_clip,
    lr_at,
    megatron_step,
    set_lr,
    uses_megatron_optimizer,
    wrap_ddp,
)
from moe_rl.learner.pipeline import pipeline_logprobs, pipeline_size, pipeline_train

__all__ = ["Learner", "LogprobFn", "LossFn", "Microbatch", "StepStats", "mean"]

Microbatch = dict
"""Keys: ``input_ids[B, T]`` (long), ``targets[B, T]`` (long, -1 = padding), optional
``segment_ids[B, T]`` (packed rows), plus whatever the loss callable reads
(``mask``, ``advantages``, ``old_logp``, ``rollout_logp`` ...)."""

LossFn = Callable[[torch.Tensor, torch.Tensor | None, Microbatch], tuple[torch.Tensor, dict]]
"""``loss_fn(logp[B, T], entropy[B, T] | None, microbatch) -> (loss[], metrics)``."""

LogprobFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""``logprob_fn(model, microbatch, temperature) -> (logp[B, T], entropy[B, T] | None)``;
replaces the full-softmax ``response_logprobs`` (e.g. Keep Sampling Mask renormalisation)."""


def default_logprob_fn(model, mb: Microbatch, temperature: float):
    """Full-vocabulary log-probs and entropy of ``mb["targets"]`` (see ``response_logprobs``)."""
    return response_logprobs(
        model, mb["input_ids"], mb["targets"], segment_ids=mb.get("segment_ids"), temperature=temperature
    )


@dataclass
class StepStats:
    """What one ``train_step`` did; ``loss`` and metrics are means over microbatches."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    metrics: dict[str, float] = field(default_factory=dict)


def mean(rows: list[dict]) -> dict[str, float]:
    """Each key's mean over the rows that have it (metrics of microbatches, of minibatches), keys sorted."""
    keys = sorted({k for m in rows for k in m})
    out = {}
    for k in keys:
        vals = [float(m[k]) for m in rows if k in m]
        out[k] = sum(vals) / len(vals)
    return out


class Learner:
    """The Megatron-Core policy being trained: model, optimizer, LR schedule, step.

    ``init_distributed(cfg.parallel)`` must have run. Without ``model`` it builds
    one from ``cfg`` and imports ``checkpoint.init_from_hf`` (else ``model.hf_path``) when set. ``total_steps`` is the
    number of optimizer steps the LR schedule spans.
    """

    def __init__(self, cfg, total_steps: int | None = None, model=None):
        self.cfg = cfg
        deterministic_kernels(cfg.precision.deterministic)  # before the model's first CUDA kernel
        if model is None:
            model = build_model(cfg)
            if initial_weights_dir(cfg):  # checkpoint.init_from_hf, else model.hf_path
                load_hf_weights(model, initial_weights_dir(cfg), cfg.model)
        self.model = wrap_ddp(model, cfg.optim.use_distributed_optimizer)
        self.config = unwrap(self.model).config
        self.optimizer = build_optimizer(self.model, cfg.optim, self.config.params_dtype)
        self.total_steps = total_steps or cfg.train.steps * cfg.train.minibatches_per_step * cfg.train.epochs_per_step
        self.step = 0

    @property
    def module(self):
        """The bare ``GPTModel`` (for HF export, router replay, log-prob passes)."""
        return unwrap(self.model)

    def export_hf(self, out_dir, template_dir=None):
        """Write the current weights as an HF checkpoint dir (collective; the owning ranks write, bucket by bucket).

        ``template_dir`` (default ``model.hf_path``, else ``checkpoint.init_from_hf``) supplies config/tokenizer files.
        """
        template = template_dir if template_dir is not None else side_files_dir(self.cfg)
        return export_hf_checkpoint(
            self.model,
            self.cfg.model,
            out_dir,
            template_dir=template,
            bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20,
        )

    def _set_aux_loss_scale(self, num_microbatches: int) -> None:

        # Megatron's schedule divides each microbatch loss by num_microbatches and
        # scales the aux-loss gradient to match (x cp size: the main loss is
        # averaged over cp ranks by DDP, the aux loss is not).
        cp = ps.get_context_parallel_world_size()
        device = next(self.model.parameters()).device
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(cp / num_microbatches, device=device))

    def forward_logprobs(
        self, microbatches: Sequence[Microbatch], logprob_fn: LogprobFn, temperature: float, both: bool = False
    ) -> list:
        """Each microbatch's ``logp[B, T]`` from one forward of the current weights (no backward; the
        caller picks the mode and ``no_grad``). Under pp > 1: Megatron's schedule, on every stage.
        ``both``: ``(logp, second)`` pairs, ``second[B, T]`` being ``logprob_fn``'s second output (e.g. Σπ²)."""
        if pipeline_size() > 1:
            return pipeline_logprobs(self.model, list(microbatches), logprob_fn, temperature, both=both)
        if both:
            return [tuple(logprob_fn(self.model, mb, temperature)) for mb in microbatches]
        return [logprob_fn(self.model, mb, temperature)[0] for mb in microbatches]

    def train_step(
        self,
        microbatches: Sequence[Microbatch],
        loss_fn: LossFn,
        temperature: float = 1.0,
        logprob_fn: LogprobFn | None = None,
        loss_scale: float | None = None,
        lr_scale: float = 1.0,
    ) -> StepStats:
        """Accumulate gradients over ``microbatches``, finalise them as Megatron does, clip, step.

        Each microbatch contributes ``loss * loss_scale`` (default ``1 / len(microbatches)``: a
        mean over microbatches). A loss already divided by a step-global denominator passes
        ``loss_scale = dp_size``: Megatron's DDP averages gradients over data-parallel ranks, so
        the reduced gradient is then the gradient of the sum over every microbatch of every rank.
        Gradient finalisation is Megatron's ``finalize_model_grads``: dp / expert-dp reduction,
        sequence-parallel norm grads over tp, and the expert-bias update from the token counts.
        """
        if not microbatches:
            raise ValueError("train_step needs at least one microbatch; got 0")
        n = len(microbatches)
        scale = 1.0 / n if loss_scale is None else float(loss_scale)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        device = model_device(self.model)
        if pipeline_size() > 1:  # the schedule sets the aux-loss scale itself (a [1] tensor: keep its shape)
            losses, metrics = pipeline_train(
                self.model,
                [to_device(mb, device) for mb in microbatches],
                logprob_fn or default_logprob_fn,
                loss_fn,
                temperature,
                scale,
            )
        else:
            self._set_aux_loss_scale(n)
            losses, metrics = self._accumulate(microbatches, loss_fn, temperature, logprob_fn, scale, device)

        finalize_model_grads([self.model])
        lr = lr_at(self.step, self.cfg.optim, self.total_steps) * float(lr_scale)  # lr_scale: e.g. VCPO's ESS rule
        set_lr(self.optimizer, lr)
        grad_norm = self._clip_and_step()
        self.step += 1
        return StepStats(self.step, sum(losses) / n, grad_norm, lr, mean(metrics))

    def _accumulate(self, microbatches, loss_fn, temperature, logprob_fn, scale, device):
        """pp = 1: forward, loss and backward of each microbatch in turn -> (losses, metrics)."""
        losses, metrics = [], []
        for mb in microbatches:
            mb = to_device(mb, device)  # callers may hand host tensors; the model's device is the one
            if logprob_fn is not None:
                logp, entropy = logprob_fn(self.model, mb, temperature)
            else:
                logp, entropy = response_logprobs(
                    self.model,
                    mb["input_ids"],
                    mb["targets"],
                    segment_ids=mb.get("segment_ids"),
                    temperature=temperature,
                )
            loss, m = loss_fn(logp, entropy, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss; got shape {tuple(loss.shape)}")
            (loss * scale).backward()
            losses.append(float(loss.detach()))
            metrics.append({k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in m.items()})
        return losses, metrics

    def _clip_and_step(self) -> float:
        if uses_megatron_optimizer(self.cfg.optim):  # it clips with cfg.optim.clip_grad itself
            return megatron_step(self.optimizer)
        grad_norm = grad_norm_and_clip(self.model, self.cfg.optim.clip_grad)
        if not torch.isfinite(torch.tensor(grad_norm)):
            raise FloatingPointError(f"gradient norm is {grad_norm}; refusing to step")
        for p in self.model.parameters():
            g = getattr(p, "main_grad", None)
            if g is not None:
                p.grad = g.to(p.dtype)
        self.optimizer.step()
        return grad_norm
