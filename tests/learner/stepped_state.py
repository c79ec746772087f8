"""One optimizer step on constant gradients, so a learner's Adam state exists to be counted (the memory-plan tests).

Shared by ``tests/learner/test_memory_plan_real.py`` (1 rank) and ``tests/distributed/memory_plan_worker.py``
(torchrun ranks); it computes nothing the tests expect, it only makes the real objects whose bytes they count.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from moe_rl.learner.train_step import Learner


def stepped_learner(cfg):
    """(learner, its trainable parameters, its optimizer's state tensors) after one ``optimizer.step()``."""

    RouterReplay.clear_global_router_replay_instances()
    learner = Learner(cfg)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    for p in params:
        p.main_grad.fill_(1e-3)
        p.grad = p.main_grad.to(p.dtype)
    learner.optimizer.step()
    opt_state = learner.optimizer.state  # a dict, or Megatron's ProxyDict (keys only) when the optimizer is chained
    state = [t for key in opt_state for t in opt_state[key].values() if torch.is_tensor(t) and t.dim() > 0]
    return learner, params, state
