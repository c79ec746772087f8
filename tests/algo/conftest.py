"""Algorithm tests run on the session device: tensors the tests (and the device-agnostic algo code)
create without naming a device land on ``cuda:0`` when a GPU is present, on the CPU otherwise.

The older algo tests build inputs with plain ``torch.tensor`` / ``torch.randn`` and never convert to
numpy, so a per-test default device sweeps them without touching each call. A test that takes the
``device`` fixture itself places its tensors explicitly (CPU generators, then ``.to(device)``) and is
left alone: a CPU generator cannot drive a factory whose default device is CUDA.
"""

from __future__ import annotations

import inspect

import pytest
import torch


@pytest.fixture(autouse=True)
def _algo_tensors_on_session_device(request, device):
    if "device" in inspect.signature(request.function).parameters:
        yield
        return
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)
