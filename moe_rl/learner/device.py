"""Device placement for the learner and router replay: where the model lives, and moving inputs there.

Owns the rule that every tensor the library builds or receives and then hands to Megatron sits on
the device of the model's parameters (``cuda:<local rank>`` on a GPU, ``cpu`` otherwise), so a user
of ``Learner``, ``RoutingReplay``, ``response_logprobs`` or ``keep_mask_logprobs`` never moves
tensors. Host-side bookkeeping (metrics counters, checkpoint shards, record packing) stays on the CPU
by design and says so where it is built.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["model_device", "to_device"]


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of ``model``'s first parameter (wrappers such as Megatron DDP included).

    Raises ``ValueError`` for a model without parameters: there is then no device to match.
    """
    for p in model.parameters():
        return p.device
    raise ValueError(f"{type(model).__name__} has no parameters; cannot tell which device its inputs belong on")


def to_device(obj, device: torch.device | str, non_blocking: bool = False):
    """``obj`` with every tensor in it on ``device``: tensors, and dicts / lists / tuples of them.

    Mappings come back as plain dicts. Anything else (numbers, strings, numpy arrays, None) is
    returned as is. A tensor already on ``device`` is returned unchanged (no copy). ``non_blocking`` only helps from pinned memory.
    """
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj
