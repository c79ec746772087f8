"""The optimizer layouts the cluster configs ship, buildable on a CPU: ``DistributedOptimizer`` +
``HybridDeviceOptimizer`` (``optim.optimizer_cpu_offload``, with or without ``use_precision_aware_optimizer``)
with GPU stand-ins, each named, for the calls that need Transformer Engine or a GPU. Shared by
``tests/learner/test_optimizer_layouts.py`` (1 rank) and ``distopt_worker.py`` (2 ranks).

Every parameter is bf16, as under Transformer Engine on a GPU: the CPU local spec keeps its norm weights fp32,
and HDO refuses fp32 shards, which are views of the parameters (``can't optimize a non-leaf Tensor``).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from megatron.core.optimizer import optimizer_config
from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

from moe_rl.config import ExperimentConfig
from moe_rl.learner import optimizer as learner_optimizer
from moe_rl.learner.fp8 import te_available
from moe_rl.learner.model import build_model
from moe_rl.learner.train_step import Learner
from tests.distributed.distopt_data import MODEL

LAYOUTS = {
    "offload+precision_aware": {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True},
    "offload": {"optimizer_cpu_offload": True},
}


class _GpuStandInStream:
    """GPU stand-in for ``torch.cuda.current_stream()`` / ``torch.cuda.Stream`` (HDO waits on and records the
    host<->device copy streams, hybrid_optimizer.py ~164/217): on the host every copy is done when it returns."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self):
        return self

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


_REAL_SPLIT = hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups


def _params_on_gpu_stand_in(self, offload_fraction):
    """GPU stand-in for HDO's split of its params: it offloads ``param.is_cuda`` params into pinned host copies
    (hybrid_optimizer.py ~292); here HDO's own params report ``is_cuda`` and pinning is a no-op (both need a GPU)."""
    on_gpu = {id(p) for g in self.param_groups for p in g["params"]}
    self.pin_cpu_grads = False
    with (
        mock.patch.object(torch.Tensor, "is_cuda", property(lambda t: id(t) in on_gpu)),
        mock.patch.object(torch.Tensor, "pin_memory", lambda t, *a, **k: t),
    ):
        return _REAL_SPLIT(self, offload_fraction)


@contextlib.contextmanager
def gpu_stand_ins(device: torch.device):
    """The calls that need Transformer Engine (without TE) or a GPU (on the host), faked; on a GPU with TE none:
    there the test runs HDO's real host<->device copies (``make gpu-check`` runs tests/learner)."""
    with contextlib.ExitStack() as stack:
        if not te_available():  # TE stand-in: OptimizerConfig.__post_init__ asks is_te_min_version (TypeError)
            stack.enter_context(mock.patch.object(optimizer_config, "is_te_min_version", lambda version: False))
        if device.type != "cuda":
            stack.enter_context(
                mock.patch.object(torch.cuda, "current_stream", lambda device=None: _GpuStandInStream())
            )
            stack.enter_context(
                mock.patch.object(
                    hybrid_optimizer.HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", _params_on_gpu_stand_in
                )
            )
            # moe_rl's own refusal of offload without CUDA (there is no device state to move)
            stack.enter_context(mock.patch.object(learner_optimizer, "_check_options", lambda optim_cfg: None))
        yield


def offload_cfg(optim: dict) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "model": {**MODEL, "moe_token_dispatcher_type": "alltoall"},
            "precision": {"params_dtype": "bfloat16", "deterministic": True},  # CUDA: bitwise resume; CPU: no-op
            "optim": {"lr": 1e-3, "clip_grad": 1.0, "weight_decay": 0.01, "use_distributed_optimizer": True, **optim},
            "train": {"seed": 3},
        }
    )


def offload_learner(optim: dict, seed: int = 3) -> Learner:
    cfg = offload_cfg(optim)
    return Learner(cfg, total_steps=4, model=build_model(cfg, seed=seed).bfloat16())
