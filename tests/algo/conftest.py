"""Algorithm tests run on the session device: tensors the tests (and the device-agnostic algo code)
create without naming a device land on ``cuda:0`` when a GPU is present, on the CPU otherwise.

The older algo tests build inputs with plain ``torch.tensor`` / ``torch.randn`` and never convert to
numpy, so a per-test default device sweeps them without touching each call. A test that takes the
``device`` fixture itself places its tensors explicitly (CPU generators, then ``.to(device)``) and is
left alone: a CPU generator cannot drive a factory whose default device is CUDA.

``verl091``: verl 0.9.1's own functions for the differential tests, generated from the pinned PyPI
wheel at test time (tests/algo/verl_wheel.py); a wheel that cannot be obtained fails the tests with
one line saying how to provide it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.algo import verl_wheel


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


@pytest.fixture(scope="session")
def verl091():
    """The ``verl091`` package: verl 0.9.1's functions, verbatim from the sha256-pinned wheel."""
    try:
        return verl_wheel.load()
    except verl_wheel.WheelUnavailable as exc:
        problem = str(exc)
    pytest.fail(problem, pytrace=False)  # outside the except: one line, no chained traceback
