"""``generate_checked``'s foreign-weights rule: re-sync at most ``rollout.max_foreign_syncs`` times in a row, then stop.

The server side (a real server serving another model under the run's label) is tested in
``test_server_secrets.py`` and end to end in ``tests/train/test_foreign_weights_e2e.py``; here the counting,
the one log line and the stop, with the served-weights check standing in as a callable.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from moe_rl.rollout.replies import RolloutError
from moe_rl.sync.integrity import ForeignWeightsError, ForeignWeightsStop, generate_checked
from moe_rl.sync.served_weights import PushedWeights, digest, tensor_digest, tensor_digests

LABEL = "step-3-0a1b2c3d"


def _checked(foreign_batches: int, max_syncs: int, caplog):
    served, resyncs = {"foreign": foreign_batches}, []

    def check_served():
        if served["foreign"] > 0:
            served["foreign"] -= 1
            raise ForeignWeightsError(
                f"foreign weights on http://h:1 (rank 0): label {LABEL!r} serves fingerprint "
                "aaaa, the trainer pushed bbbb"
            )

    with caplog.at_level(logging.WARNING):
        samples = generate_checked(
            lambda: [SimpleNamespace(weight_version=LABEL)],
            LABEL,
            lambda: resyncs.append(1),
            check_served=check_served,
            max_foreign_syncs=max_syncs,
        )
    return samples, len(resyncs)


def test_foreign_batches_are_resynced_up_to_the_limit_then_the_run_stops(caplog):
    samples, resyncs = _checked(2, 2, caplog)
    assert resyncs == 2 and len(samples) == 1
    lines = [r.getMessage() for r in caplog.records if "foreign weights" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in m and "(1/2)" in lines[0] and "re-syncing" in m for m in lines), lines
    caplog.clear()
    with pytest.raises(ForeignWeightsStop, match=r"foreign weights .* 2 times in a row \(rollout.max_foreign_syncs\)"):
        _checked(3, 2, caplog)
    with pytest.raises(ForeignWeightsStop, match="foreign weights"):  # max_foreign_syncs=0: the first one stops
        _checked(1, 0, caplog)


def test_a_digest_names_dtype_shape_and_bytes_and_every_tensor_is_kept(device):
    expert = torch.randn(8, 64, device=device)
    d = tensor_digest(expert)
    assert d.startswith("float32:8x64:") and len(d.rsplit(":", 1)[1]) == 32
    assert tensor_digest(expert.t().contiguous().t()) == d  # the C-order bytes, whatever the layout
    assert tensor_digest(expert.to(torch.bfloat16)).startswith("bfloat16:8x64:")  # the dtype as sent
    assert tensor_digest(expert.reshape(64, 8)) != d and tensor_digest(expert + 1e-6) != d
    assert tensor_digest(torch.tensor(1.0)).startswith("float32::")
    pushed = PushedWeights()
    named = {"model.norm.weight": torch.ones(4), "model.layers.0.mlp.experts.0.up_proj.weight": expert}
    pushed.remember(LABEL, tensor_digests(named))
    assert sorted(pushed.by_label[LABEL]) == sorted(named)  # every tensor, the experts too
    assert digest({"a": "x"}) != digest({"a": "y"})


def test_a_generation_that_fails_under_foreign_weights_resyncs_instead_of_restarting_the_server(caplog):
    """Issue 38's walk-through: a foreign update aborts the batch in flight. The failure is the weights, not the server:
    a re-sync (counted like any foreign batch), never a restart (which spent the restart budget before)."""

    calls, resyncs, restarts = {"generate": 0, "check": 0}, [], []

    def generate():
        calls["generate"] += 1
        if calls["generate"] == 1:
            raise RolloutError("http://h:1: generation aborted")
        return [SimpleNamespace(weight_version=LABEL)]

    def check_served():
        calls["check"] += 1
        if calls["check"] == 1:  # asked right after the failure: the server holds another model
            raise ForeignWeightsError(
                f"foreign weights on http://h:1 (rank 0): label {LABEL!r} serves fingerprint "
                "aaaa, the trainer pushed bbbb"
            )

    with caplog.at_level(logging.WARNING):
        samples = generate_checked(
            generate,
            LABEL,
            lambda: resyncs.append(1),
            restart=lambda urls: restarts.append(urls) or ["http://h:1"],
            check_served=check_served,
            max_foreign_syncs=2,
        )
    assert len(samples) == 1 and resyncs == [1] and restarts == []
    assert any("foreign weights" in r.getMessage() and "(1/2)" in r.getMessage() for r in caplog.records)
