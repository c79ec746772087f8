"""megatron-core version range and the device-independent fixes (``moe_rl.learner.mcore_compat``)."""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe import moe_utils
from packaging.version import Version

from moe_rl.learner.mcore_compat import apply_megatron_fixes, check_megatron_core_version, need_te_general_gemm
from moe_rl.learner.model import build_model, forward_logits
from moe_rl.replay.binding import unsupported_router_options
from tests.learner.conftest import make_cfg


@pytest.mark.parametrize("version", [(0, 15, 2), (0, 16, 0), (0, 20, 0), (1, 0, 0)])
def test_versions_outside_the_supported_range_get_one_clear_error(version):
    have = ".".join(map(str, version))
    with pytest.raises(
        RuntimeError,
        match=rf"megatron-core {have} is installed; moe_rl supports megatron-core "
        r">= 0\.16\.1, < 0\.20",
    ):
        check_megatron_core_version(version)


@pytest.mark.parametrize("version", [(0, 16, 1), (0, 17, 0), (0, 19, 2)])
def test_versions_inside_the_range_pass(version):
    assert check_megatron_core_version(version) == version


def test_installed_version_is_the_imported_megatron_core():
    want = (Version(metadata.version("megatron-core")).release + (0, 0))[:3]  # the wheel that pip installed
    assert check_megatron_core_version() == want


def test_router_gemm_name_is_bound_after_build_on_any_device(megatron_world, device):
    """0.16.x without TE leaves ``te_general_gemm`` unbound (NameError mid-forward, CPU and GPU alike):
    after ``build_model`` the name exists, the probe is quiet and a forward through the router runs."""

    model = build_model(make_cfg(), seed=0)
    assert hasattr(moe_utils, "te_general_gemm") and not need_te_general_gemm()
    assert apply_megatron_fixes() == []  # idempotent
    ids = torch.randint(0, 256, (2, 5), device=device)
    assert forward_logits(model, ids).shape == (2, 5, 256)


def test_quantile_balancing_routing_of_megatron_0_19_is_refused_by_replay():
    """0.19 added a routing type whose top-k never reaches the replay hook (router.py ``routing_type``)."""

    tcfg = SimpleNamespace(
        moe_router_load_balancing_type=["aux_loss", "quantile_balancing"],
        moe_enable_routing_replay=True,
        moe_expert_capacity_factor=None,
    )
    assert unsupported_router_options(tcfg) == [
        "moe_router_load_balancing_type='quantile_balancing' (quantile_balancing routing bypasses the replay hook)"
    ]
    tcfg.moe_router_load_balancing_type = "aux_loss"
    assert unsupported_router_options(tcfg) == []
