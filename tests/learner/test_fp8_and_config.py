"""Config -> Megatron mapping: FP8 fields, architecture switches, launcher environments."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig

import moe_rl.learner.dist as dist_mod
import moe_rl.learner.model as model_mod
from moe_rl.config import ExperimentConfig, FP8Config, ParallelConfig
from moe_rl.learner.dist import LaunchEnv, _local_gpu, init_distributed, launch_env
from moe_rl.learner.fp8 import fp8_runtime_missing, fp8_transformer_fields, te_available
from moe_rl.learner.model import build_model, forward_logits, moe_routers, transformer_config_from
from tests.learner.conftest import make_cfg


def test_fp8_config_maps_onto_megatron_field_names():
    fp8 = FP8Config(format="hybrid", recipe="delayed", amax_history_len=16, amax_compute_algo="max")
    assert fp8_transformer_fields(fp8) == {
        "fp8": "hybrid",
        "fp8_recipe": "delayed",
        "fp8_amax_history_len": 16,
        "fp8_amax_compute_algo": "max",
        "fp8_param": False,
        "disable_parameter_transpose_cache": False,
    }
    assert fp8_transformer_fields(None) == {}


def test_fp8_without_gpu_or_te_fails_at_config_time_naming_what_is_missing():
    missing = fp8_runtime_missing()
    if not missing:
        pytest.skip("this machine has a CUDA GPU and Transformer Engine: FP8 is allowed here")
    cfg = make_cfg()
    cfg.precision.fp8 = {"format": "e4m3", "recipe": "blockwise"}
    # CPU: "needs a CUDA GPU ... and Transformer Engine"; a GPU without TE: "needs Transformer Engine"
    want = r"precision.fp8=.*needs " + r".* and ".join(m.split(" (")[0] for m in missing)
    with pytest.raises(ValueError, match=want):
        transformer_config_from(cfg)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_fp8_fields_reach_transformer_config_kwargs_with_faked_gpu_capability(monkeypatch, recipe):
    """FAKED: pretends TE + a GPU exist (the capability check only); Megatron's own
    ``TransformerConfig.__post_init__`` needs TE for fp8, so the kwargs are checked
    against its dataclass fields instead of being instantiated."""

    monkeypatch.setattr(model_mod, "fp8_runtime_missing", list)
    cfg = make_cfg()
    cfg.precision.params_dtype = "bfloat16"
    cfg.precision.fp8 = {
        "format": "hybrid",
        "recipe": recipe,
        "amax_history_len": 32,
        "amax_compute_algo": "most_recent",
    }
    kw = model_mod.transformer_config_kwargs(cfg)
    assert (kw["fp8"], kw["fp8_recipe"], kw["fp8_amax_history_len"], kw["fp8_amax_compute_algo"]) == (
        "hybrid",
        recipe,
        32,
        "most_recent",
    )
    assert kw["bf16"] and kw["params_dtype"] == torch.bfloat16
    unknown = set(kw) - {f.name for f in dataclasses.fields(TransformerConfig)}
    assert not unknown, f"not TransformerConfig fields: {sorted(unknown)}"


def test_fp8_missing_lists_what_this_machine_lacks():
    assert fp8_runtime_missing(has_te=True, has_cuda=True) == []
    assert len(fp8_runtime_missing(has_te=False, has_cuda=True)) == 1
    assert "Transformer Engine" in fp8_runtime_missing(has_te=False, has_cuda=True)[0]


def test_deepseek_v3_router_options_reach_megatron(megatron_world, device):
    """Sigmoid scores + expert bias + grouped top-k build and route within the allowed groups."""

    cfg = make_cfg(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3,
        num_moe_experts=8,
        moe_router_topk=4,
    )
    t = transformer_config_from(cfg)
    assert (
        t.moe_router_score_function,
        t.moe_router_enable_expert_bias,
        t.moe_router_num_groups,
        t.moe_router_group_topk,
        t.moe_router_topk_scaling_factor,
    ) == ("sigmoid", True, 4, 2, 2.5)
    model = build_model(cfg)
    routers = moe_routers(model)
    assert all(r.expert_bias is not None for r in routers)
    maps = []
    hook = routers[0].register_forward_hook(lambda m, i, o: maps.append(o[1]))
    forward_logits(model, torch.randint(0, 256, (2, 16), device=device))
    hook.remove()
    chosen_groups = (maps[0].view(-1, 4, 2).any(-1)).sum(-1)  # experts 0-1 group 0, 2-3 group 1, ...
    # top-4 of 8 experts inside the best 2 of 4 groups (2 experts each) fills exactly 2 groups;
    # ungrouped top-4 would usually touch 3 or 4.
    assert (chosen_groups == 2).all(), f"grouped top-k used {chosen_groups.tolist()} groups, expected 2"


def test_first_dense_layers_and_router_list_skip_dense(megatron_world):
    cfg = make_cfg(num_layers=3, first_k_dense_layers=1)
    model = build_model(cfg)
    assert not hasattr(model.decoder.layers[0].mlp, "router")
    assert [r.layer_number for r in moe_routers(model)] == [2, 3]


def test_routing_replay_is_attached_to_every_router(megatron_world):
    model = build_model(make_cfg())
    assert all(getattr(r, "router_replay", None) is not None for r in moe_routers(model))


@pytest.mark.skipif(te_available() and torch.cuda.is_available(), reason="TE on a GPU supports tp > 1")
def test_tensor_parallel_without_te_is_rejected_at_config_time():
    cfg = ExperimentConfig.model_validate({"parallel": {"tp": 2}})
    with pytest.raises(ValueError, match=r"parallel.tp=2 needs Transformer Engine on a GPU"):
        transformer_config_from(cfg)


def test_mtp_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="model.mtp_num_layers=1"):
        transformer_config_from(make_cfg(mtp_num_layers=1))


@pytest.mark.parametrize(
    "environ,expected",
    [
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"},
            (3, 8, 1, "n0", 1234, "torchrun"),
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "16",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_ID": "20007",
                "SLURM_JOB_NODELIST": "gpu[03-05,07],cpu1",
            },
            (5, 16, 1, "gpu03", 20007, "slurm"),
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node7", "MASTER_PORT": "999"},
            (0, 2, 0, "node7", 999, "slurm"),
        ),
        # srun torchrun: torchrun's per-process variables win over SLURM's per-task ones.
        (
            {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            (1, 2, 0, "127.0.0.1", 29500, "torchrun"),
        ),
    ],
)
def test_launch_env_reads_torchrun_and_slurm(environ, expected):
    e = launch_env(environ)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == expected


def test_parallel_sizes_that_do_not_divide_the_world_are_refused():
    with pytest.raises(ValueError, match=r"do not divide world_size=1"):
        init_distributed(ParallelConfig(ep=2), environ={})


def test_single_world_uses_gloo_on_cpu_nccl_on_gpu_and_megatron_groups_of_size_one(megatron_world):
    assert megatron_world.launcher == "single"
    assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
    ) == (1, 1, 1)


def test_a_rank_without_its_own_gpu_gets_one_clear_error():
    """One GPU per rank: local_rank must name a visible device (two ranks on a one-GPU node ask for cuda:1)."""

    count = torch.cuda.device_count()
    env = LaunchEnv(
        rank=count, world_size=count + 1, local_rank=count, master_addr="127.0.0.1", master_port=1, launcher="torchrun"
    )
    with pytest.raises(ValueError, match=rf"local_rank={count} \(torchrun\) but this node shows {count} CUDA GPU"):
        _local_gpu(env)
    if count:
        assert _local_gpu(LaunchEnv(0, 1, count - 1, "127.0.0.1", 1, "torchrun")) == count - 1


def test_precision_deterministic_reaches_megatron_and_te_on_cuda_only(monkeypatch):
    """FAKED: ``torch.cuda.is_available`` (the only CUDA check on this path) is forced either way.
    ``precision.deterministic`` on CUDA turns on Megatron's ``deterministic_mode`` and sets what it requires of
    Transformer Engine (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``: with TE attention Megatron refuses to build
    otherwise) beside PyTorch's deterministic algorithms and the cuBLAS workspace, keeping values an operator set;
    on CPU neither changes."""

    calls = []
    monkeypatch.setattr(
        torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append((on, warn_only))
    )
    monkeypatch.setattr(os, "environ", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    cfg = make_cfg()
    cfg.precision.deterministic = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_mod.transformer_config_kwargs(cfg)["deterministic_mode"] is False  # CPU: the learner is already
    dist_mod.deterministic_kernels(True)
    assert (calls, os.environ) == ([], {"CUBLAS_WORKSPACE_CONFIG": ":16:8"})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model_mod.transformer_config_kwargs(cfg)["deterministic_mode"] is True
    dist_mod.deterministic_kernels(True)
    assert calls == [(True, True)]
    assert os.environ == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    cfg.precision.deterministic = False
    assert model_mod.transformer_config_kwargs(cfg)["deterministic_mode"] is False
