"""``rollout.weight_sync: distributed`` in the config: the keys, the preflight's messages, what WeightSync gets."""

from __future__ import annotations

import socket

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.preflight import config_problems, environment_problems
from moe_rl.sync.group import group_options, master_address_for, port_is_free, stage_group_options
from moe_rl.sync.transport import WeightSyncError


def test_distributed_resolves_gloo_for_cpu_servers_and_nccl_for_gpu_servers():
    cfg = load_config(overrides=["rollout.weight_sync=distributed", "rollout.weight_sync_master_port=29555"])
    assert config_problems(cfg).problems == []
    assert group_options(cfg.rollout) == {
        "backend": "gloo",
        "master_address": None,
        "master_port": 29555,
        "stage_addresses": None,
    }
    assert group_options(load_config(overrides=["rollout.device=cuda"]).rollout)["backend"] == "nccl"
    assert master_address_for(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"
    assert master_address_for(["http://10.0.0.7:30000"], "10.0.0.1") == "10.0.0.1"


def test_nccl_with_cpu_servers_is_refused_by_the_config_rules():
    cfg = load_config(overrides=["rollout.weight_sync=distributed", "rollout.weight_sync_backend=nccl"])
    assert config_problems(cfg).problems == [
        (
            "rollout.weight_sync_backend='nccl' with rollout.device='cpu': a CPU SGLang server receives weights over "
            "gloo only; expected rollout.weight_sync_backend='gloo' (or 'auto')"
        )
    ]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--dp-size", "2"], "--dp-size 2"),
        (["--data-parallel-size=4"], "--data-parallel-size 4"),
        (["--pp-size", "2"], "--pp-size 2"),
        (["--enable-dp-attention"], "--enable-dp-attention"),
        (["--attn-dp-size", "2"], "--attn-dp-size 2"),
    ],
)
def test_server_options_the_group_update_cannot_serve_are_refused_naming_the_option(args, named):
    """SGLang 0.5.23's init_weights_update_group asserts dp_size == 1 and ranks processes as rank_offset + tp_rank."""
    cfg = load_config(overrides=["rollout.weight_sync=distributed", f"rollout.extra_server_args={args}"])
    (problem,) = config_problems(cfg).problems
    assert problem.startswith(f"rollout.extra_server_args {named} with rollout.weight_sync='distributed': ")
    assert (
        config_problems(
            load_config(overrides=["rollout.weight_sync=disk", f"rollout.extra_server_args={args}"])
        ).problems
        == []
    )
    ok = ["--dp-size", "1", "--tp-size", "2", "--pp-size=1"]
    assert (
        config_problems(
            load_config(overrides=["rollout.weight_sync=distributed", f"rollout.extra_server_args={ok}"])
        ).problems
        == []
    )


def test_a_rendezvous_port_in_use_is_refused_by_the_environment_rules():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = load_config(overrides=["rollout.weight_sync=distributed", f"rollout.weight_sync_master_port={port}"])
        assert not port_is_free(port)
        assert environment_problems(cfg, {"WORLD_SIZE": "1"}).problems == [
            (
                f"rollout.weight_sync_master_port={port} is in use on this host; rank 0 listens there for the "
                "weight-update group's rendezvous: expected a free port (or null: pick one)"
            )
        ]
        assert environment_problems(cfg, {"WORLD_SIZE": "2", "RANK": "1"}).problems == []  # rank 0 listens
    assert port_is_free(port)


@pytest.mark.parametrize("key", ["rollout.weight_sync=nccl", "rollout.weight_sync_backend=mpi"])
def test_unknown_values_name_the_key(key):
    with pytest.raises(ConfigError, match=key.split("=")[0]):
        load_config(overrides=[key])


def test_each_pipeline_stage_gets_its_own_address_and_port():
    """Plumbing only (one host here): the per-stage list reaches each stage's source rank's group options."""
    cfg = load_config(
        overrides=[
            "rollout.weight_sync=distributed",
            "rollout.weight_sync_master_port=29555",
            "parallel.pp=2",
            "rollout.weight_sync_stage_addresses=[127.0.0.1,127.0.0.2]",
        ]
    )
    options = group_options(cfg.rollout)
    assert stage_group_options(options, 0) == {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 29555}
    assert stage_group_options(options, 1) == {"backend": "gloo", "master_address": "127.0.0.2", "master_port": 29556}
    with pytest.raises(WeightSyncError, match="names 2 address"):
        stage_group_options(options, 2)
    one = group_options(load_config(overrides=["rollout.weight_sync_master_address=10.0.0.1"]).rollout)
    assert stage_group_options(one, 1)["master_address"] == "10.0.0.1"  # one address serves every stage


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["parallel.pp=2", "rollout.weight_sync_stage_addresses=[127.0.0.1]"], "one address per pipeline stage"),
        (
            ["rollout.weight_sync_stage_addresses=[127.0.0.1]", "rollout.weight_sync_master_address=10.0.0.1"],
            "are both set",
        ),
    ],
)
def test_a_stage_address_list_that_does_not_fit_is_one_clear_error(overrides, named):
    with pytest.raises(ConfigError, match=named) as err:
        load_config(overrides=overrides)
    assert "rollout.weight_sync_stage_addresses" in str(err.value)
