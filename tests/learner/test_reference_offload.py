"""An offloaded reference policy moves to the device once per pass over microbatches, not once per microbatch.

The module below stands in for a GPU (this machine may have none): its ``to`` records the device
it is sent to instead of copying, and everything else is ``ReferencePolicy``'s real code.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.learner.reference import ReferencePolicy


class _GpuStandIn(torch.nn.Linear):
    """A real module whose moves are recorded, not performed (the fake is only the GPU)."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves: list[str] = []

    def to(self, device, *args, **kwargs):
        self.moves.append(str(device))
        return self


def _logprob_fn(model, mb, temperature):
    model.seen_moves = len(model.moves)  # moves made before this microbatch's forward
    return torch.zeros_like(mb["targets"], dtype=torch.float32), None


def _policy():
    model = _GpuStandIn()
    ref = ReferencePolicy(model, offload=True, device=torch.device("cuda", 0))
    assert model.moves == ["cpu"]  # offloaded at construction
    model.moves.clear()
    return ref, model


def test_one_move_there_and_back_per_pass():
    ref, model = _policy()
    mb = {"targets": torch.zeros(2, 3, dtype=torch.long)}
    with ref.on_device():
        for _ in range(4):
            ref.logprobs(mb, logprob_fn=_logprob_fn)
            assert model.seen_moves == 1  # resident: the forward ran on the device, nothing moved again
    assert model.moves == ["cuda:0", "cpu"]
    model.moves.clear()
    ref.logprobs(mb, logprob_fn=_logprob_fn)  # a call outside a pass moves for itself
    assert model.moves == ["cuda:0", "cpu"]


def test_the_weights_go_back_to_the_cpu_when_the_pass_fails():
    ref, model = _policy()
    with pytest.raises(RuntimeError, match="boom"), ref.on_device():
        raise RuntimeError("boom")
    assert model.moves == ["cuda:0", "cpu"]
    with ref.on_device():  # and the next pass moves again
        pass
    assert model.moves == ["cuda:0", "cpu", "cuda:0", "cpu"]


def test_no_moves_without_offload_or_on_a_cpu_device():
    for offload, device in ((False, torch.device("cuda", 0)), (True, torch.device("cpu"))):
        model = _GpuStandIn()
        ref = ReferencePolicy(model, offload=offload, device=device)
        model.moves.clear()
        with ref.on_device():
            ref.logprobs({"targets": torch.zeros(1, 1, dtype=torch.long)}, logprob_fn=_logprob_fn)
        assert model.moves == [], (offload, device)
