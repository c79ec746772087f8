"""Dry-run launch plans for the cluster configs: node roles, ports, parallel sizes, world checks."""

from __future__ import annotations

import pytest
from launch_helpers import DSV3, QWEN3, flag_value, rendered_commands

from moe_rl.config import apply_overrides, load_config
from moe_rl.launch import LaunchError, build_launch_plan, render_launch


def _split(script):
    cmds = rendered_commands(script)
    rollout = [c for c in cmds if "moe_rl.rollout.sglang_entry" in c]
    learner = [c for c in cmds if "torchrun" in c]
    assert len(rollout) + len(learner) == len(cmds), cmds
    return rollout, learner


def _program(argv: list[str], first: str) -> list[str]:
    return argv[argv.index(first) :]


def _server(argv: list[str]) -> list[str]:
    """The SGLang command of a rollout step, behind its ``python -m moe_rl.launch serve ... --`` wrapper."""
    wrapper = _program(argv, "python")
    assert wrapper[:4] == ["python", "-m", "moe_rl.launch", "serve"], wrapper
    return wrapper[wrapper.index("--") + 1 :]


def test_qwen3_rollout_servers_run_on_the_first_nodes_with_config_port_and_flags(slurm_env):
    cfg = load_config(QWEN3)
    rollout, _ = _split(render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]")))
    assert [flag_value(c, "--nodelist") for c in rollout] == ["gpu001", "gpu002"]
    for argv in rollout:
        server = _server(argv)
        assert server[:3] == ["python", "-m", "moe_rl.rollout.sglang_entry"]  # keyed by default (issue 25)
        assert flag_value(server, "--port") == "30000"
        assert flag_value(argv, "--first-port") == "30000"  # serve tries 30000, 30001, ... (a busy node)
        node = flag_value(argv, "--nodelist")
        assert (
            flag_value(argv, "--port-file") == f"/checkpoint/moe_rl/qwen3_30b_a3b/launch/ports-4242/rollout-{node}.port"
        )
        assert flag_value(server, "--host") == "0.0.0.0"  # reachable from the learner nodes
        assert flag_value(server, "--tp-size") == "4"
        assert flag_value(server, "--model-path") == "/models/Qwen3-30B-A3B"
        assert "--enable-return-routed-experts" in server
        assert "--enable-deterministic-inference" not in server  # qwen3 config: deterministic: false
        assert flag_value(argv[: argv.index("python")], "--gpus-per-node") == "8"


def test_qwen3_learner_torchrun_spans_the_remaining_nodes_with_world_and_parallel_sizes(slurm_env):
    cfg = load_config(QWEN3)
    _, learner = _split(render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]", job_id="777")))
    (argv,) = learner
    srun = argv[: argv.index("torchrun")]
    torchrun = _program(argv, "torchrun")
    assert flag_value(srun, "--nodelist") == "gpu003,gpu004,gpu005,gpu006"
    assert flag_value(srun, "--nodes") == "4" and flag_value(srun, "--ntasks-per-node") == "1"
    assert flag_value(torchrun, "--nnodes") == "4"
    assert flag_value(torchrun, "--nproc-per-node") == "8"
    assert flag_value(torchrun, "--rdzv-endpoint") == "gpu003:29500"
    assert flag_value(torchrun, "--rdzv-id") == "777"
    train = torchrun[torchrun.index("-m") :]
    assert train[:3] == ["-m", "moe_rl.cli", "train"]
    for override in ("parallel.tp=4", "parallel.pp=1", "parallel.cp=1", "parallel.ep=8", "parallel.etp=1"):
        assert override in train


def test_learner_receives_every_rollout_address_as_a_parseable_override(slurm_env):
    """The learner is told the addresses the servers published (``$rollout_addresses``, built by the script's
    ``wait_port`` as ``"http://node:port",...``): with every first port free, the plan's addresses."""
    cfg = load_config(QWEN3)
    _, (argv,) = _split(render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]")))
    (override,) = [a for a in argv if a.startswith("rollout.addresses=")]
    assert override == "rollout.addresses=[$rollout_addresses]"  # expanded by bash: the line is double-quoted
    published = ",".join(f'"http://{node}:30000"' for node in ("gpu001", "gpu002"))
    tree = apply_overrides({}, [override.replace("$rollout_addresses", published)])  # the learner's own parser
    assert tree["rollout"]["addresses"] == ["http://gpu001:30000", "http://gpu002:30000"]
    plan = build_launch_plan(cfg, slurm_env("gpu[001-006]"))
    assert list(plan.rollout_addresses) == tree["rollout"]["addresses"]


def test_deepseek_plan_uses_mixed_hostlists_and_its_own_sizes(slurm_env):
    cfg = load_config(
        DSV3,
        [
            "checkpoint.init_from_hf=/models/dsv3",
            "launch.rollout_port=31000",
            "launch.master_port=29999",
            "rollout.deterministic=true",
        ],
    )
    env = slurm_env("dgx-a[1-4],dgx-b[01-16]", SLURM_JOB_NUM_NODES="20")
    rollout, (learner,) = _split(render_launch(cfg, dry_run=True, env=env))
    assert [flag_value(c, "--nodelist") for c in rollout] == ["dgx-a1", "dgx-a2", "dgx-a3", "dgx-a4"]
    for argv in rollout:
        server = _server(argv)
        assert flag_value(server, "--port") == "31000"
        assert flag_value(server, "--tp-size") == "8" and flag_value(server, "--ep-size") == "8"
        assert "--enable-deterministic-inference" in server
    torchrun = _program(learner, "torchrun")
    assert flag_value(learner, "--nodelist") == ",".join(f"dgx-b{i:02d}" for i in range(1, 17))
    assert flag_value(torchrun, "--nnodes") == "16"
    assert flag_value(torchrun, "--rdzv-endpoint") == "dgx-b01:29999"
    for override in ("parallel.tp=8", "parallel.ep=128", "parallel.etp=1", "parallel.pp=1"):
        assert override in torchrun
    plan = build_launch_plan(cfg, env)
    assert list(plan.rollout_addresses) == [f"http://dgx-a{i}:31000" for i in range(1, 5)]
    assert [flag_value(c, "--first-port") for c in rollout] == ["31000"] * 4


def test_a_cluster_run_without_a_checkpoint_writes_the_dir_its_servers_serve_first(slurm_env):
    """Issue 39: no HF checkpoint configured -> the job writes a random-init one before any server starts."""
    cfg = load_config(DSV3, ["checkpoint.init_from_hf=null", "train.output_dir=/shared/run"])
    script = render_launch(cfg, dry_run=True, env=slurm_env("node[01-20]"))
    rollout, _ = _split(script)
    assert {flag_value(argv, "--model-path") for argv in rollout} == {"/shared/run/hf/initial"}
    init = "python -m moe_rl.launch init-hf /shared/run/launch/config-4242.yaml /shared/run/hf/initial"
    assert init in script and script.index(init) < script.index("moe_rl.rollout.sglang_entry")
    plan = build_launch_plan(load_config(DSV3), slurm_env("node[01-20]"))  # a configured checkpoint: served as is
    assert plan.init_hf == () and "init-hf" not in render_launch(load_config(DSV3), True, slurm_env("node[01-20]"))


def test_dense_world_not_divisible_by_tp_pp_cp_names_the_keys(slurm_env):
    # 1 learner node x 2 GPUs = world 2; tp 4 * pp 1 * cp 1 = 4 does not divide 2.
    cfg = load_config(QWEN3, ["launch.learner_nodes=1", "launch.gpus_per_node=2", "rollout.extra_server_args=[]"])
    with pytest.raises(LaunchError, match=r"world size 2 .*parallel\.tp\*parallel\.pp\*parallel\.cp = 4\*1\*1 = 4"):
        build_launch_plan(cfg, slurm_env("n[1-3]"))


def test_expert_world_not_divisible_by_etp_ep_pp_names_the_keys(slurm_env):
    # world 1 x 8 = 8: tp*pp*cp = 4 divides, but etp 1 * ep 16 * pp 1 = 16 does not.
    cfg = load_config(QWEN3, ["launch.learner_nodes=1", "parallel.ep=16"])
    with pytest.raises(LaunchError, match=r"world size 8 .*parallel\.etp\*parallel\.ep\*parallel\.pp = 1\*16\*1 = 16"):
        build_launch_plan(cfg, slurm_env("n[1-3]"))


def test_etp_unset_counts_as_tp_in_the_expert_world_check(slurm_env):
    # etp=null -> etp = tp = 4; 4 * ep 8 * pp 1 = 32 does not divide world 8 (with etp=1 it would).
    cfg = load_config(QWEN3, ["launch.learner_nodes=1", "parallel.etp=null"])
    with pytest.raises(LaunchError, match=r"= 4\*8\*1 = 32"):
        build_launch_plan(cfg, slurm_env("n[1-3]"))


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_NODELIST": "gpu[001-005]"}, r"5 nodes .* = 6"),
        ({"SLURM_JOB_NODELIST": "gpu[001-006]", "SLURM_JOB_NUM_NODES": "7"}, "SLURM_JOB_NUM_NODES=7"),
        ({"SLURM_JOB_NODELIST": "gpu[006-001]"}, "SLURM_JOB_NODELIST: descending"),
        ({"SLURM_JOB_NODELIST": "gpu[001-006]", "SLURM_GPUS_ON_NODE": "4"}, "launch.gpus_per_node=8"),
    ],
)
def test_unusable_slurm_environment_is_refused_naming_the_variable(env, needle):
    with pytest.raises(LaunchError, match=needle):
        build_launch_plan(load_config(QWEN3), env)


def test_sglang_server_larger_than_a_node_is_refused(slurm_env):
    cfg = load_config(QWEN3, ["rollout.extra_server_args=[--tp-size, '4', --dp-size=4]"])
    with pytest.raises(LaunchError, match=r"tp\*pp\*dp = 16 GPUs .*launch.gpus_per_node=8"):
        build_launch_plan(cfg, slurm_env("gpu[001-006]"))


def test_server_flag_owned_by_the_launcher_is_refused_in_extra_args(slurm_env):
    cfg = load_config(QWEN3, ["rollout.extra_server_args=[--port, '9']"])
    with pytest.raises(LaunchError, match="rollout.extra_server_args sets --port"):
        build_launch_plan(cfg, slurm_env("gpu[001-006]"))


def test_external_rollout_addresses_with_no_rollout_nodes_go_straight_to_the_learner(slurm_env):
    cfg = load_config(QWEN3, ["launch.rollout_nodes=0", "rollout.addresses=['http://infer:8000']"])
    rollout, (learner,) = _split(render_launch(cfg, dry_run=True, env=slurm_env("gpu[1-4]")))
    assert rollout == []
    assert flag_value(learner, "--nodelist") == "gpu1,gpu2,gpu3,gpu4"
    (addr,) = [a for a in learner if a.startswith("rollout.addresses=")]
    assert apply_overrides({}, [addr])["rollout"]["addresses"] == ["http://infer:8000"]


def test_addresses_and_rollout_nodes_together_are_ambiguous(slurm_env):
    cfg = load_config(QWEN3, ["rollout.addresses=['http://infer:8000']"])
    with pytest.raises(LaunchError, match="launch.rollout_nodes=0 or rollout.addresses=\\[\\]"):
        build_launch_plan(cfg, slurm_env("gpu[001-006]"))
