"""Megatron-Core MoE learner: model build, CPU support, log-probs, train step, HF conversion, checkpoints.

Typical use::

    init_distributed(cfg.parallel)             # gloo on CPU, nccl on GPU; torchrun / SLURM env
    learner = Learner(cfg)                      # GPTModel (+ HF import if checkpoint.init_from_hf)
    stats = learner.train_step(microbatches, loss_fn)
    learner.export_hf(out_dir)                  # for SGLang update_weights_from_disk
    save_checkpoint(learner, ckpt_dir); load_checkpoint(learner, ckpt_dir)

Modules import Megatron lazily where they can; importing this package pulls in torch only.
"""

from moe_rl.learner.checkpoint import latest_step, load_checkpoint, save_checkpoint
from moe_rl.learner.cpu_shims import apply_cpu_shims
from moe_rl.learner.dist import destroy_distributed, init_distributed, launch_env
from moe_rl.learner.hf_export import export_hf_checkpoint
from moe_rl.learner.hf_import import load_hf_weights
from moe_rl.learner.logprobs import logprobs_from_logits, response_logprobs
from moe_rl.learner.model import build_model, forward_logits, moe_routers, transformer_config_from
from moe_rl.learner.train_step import Learner, StepStats

__all__ = [
    "Learner",
    "StepStats",
    "apply_cpu_shims",
    "build_model",
    "destroy_distributed",
    "export_hf_checkpoint",
    "forward_logits",
    "init_distributed",
    "latest_step",
    "launch_env",
    "load_checkpoint",
    "load_hf_weights",
    "logprobs_from_logits",
    "moe_routers",
    "response_logprobs",
    "save_checkpoint",
    "transformer_config_from",
]
