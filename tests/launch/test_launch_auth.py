"""Issue 16, item 1 (cluster side): the SLURM plan names the key variables, never the keys, and warns without one."""

from __future__ import annotations

import subprocess

import pytest
from launch_helpers import QWEN3, flag_value, rendered_commands

from moe_rl.config import ConfigError, load_config
from moe_rl.launch import LaunchError, render_launch
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV

SECRET = "s3cr3t-rollout-key-0123456789"


def test_plan_passes_the_key_by_variable_name_to_rollout_and_learner_nodes(slurm_env):
    cfg = load_config(QWEN3, ["rollout.api_key_env=MOE_RL_ROLLOUT_KEY"])
    script = render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]", MOE_RL_ROLLOUT_KEY=SECRET))
    assert SECRET not in script
    cmds = rendered_commands(script)
    servers = [c for c in cmds if "moe_rl.rollout.sglang_entry" in c]
    learner = [c for c in cmds if "torchrun" in c]
    assert len(servers) == 2 and len(learner) == 1
    for argv in servers:
        assert flag_value(argv, "--api-key-env") == "MOE_RL_ROLLOUT_KEY" and "--api-key" not in argv
        assert "--export=ALL" in argv
    assert "--export=ALL" in learner[0]
    assert "WARNING" not in script


def test_plan_without_a_key_gives_its_servers_a_fresh_admin_key_at_run_time(slurm_env, tmp_path):
    """Secure by default (issue 25): no key configured -> the script draws one when it runs (in no file) and
    hands it by name to the servers (--admin-api-key-env) and the learner (rollout.admin_api_key_env)."""

    script = render_launch(load_config(QWEN3), dry_run=True, env=slurm_env("gpu[001-006]"))
    assert "WARNING" not in script
    export = [line for line in script.splitlines() if line.startswith(f"export {RUN_ADMIN_KEY_ENV}=")]
    assert len(export) == 1 and "/dev/urandom" in export[0]
    cmds = rendered_commands(script)
    servers = [c for c in cmds if "moe_rl.rollout.sglang_entry" in c]
    learner = [c for c in cmds if "torchrun" in c]
    assert len(servers) == 2 and len(learner) == 1
    for argv in servers:
        assert flag_value(argv, "--admin-api-key-env") == RUN_ADMIN_KEY_ENV and "--export=ALL" in argv
    assert f"rollout.admin_api_key_env={RUN_ADMIN_KEY_ENV}" in learner[0] and "--export=ALL" in learner[0]
    assert script.index(export[0]) < script.index("moe_rl.rollout.sglang_entry")  # set before any server starts
    # the line draws a different 64-hex-digit key each time it runs
    keys = {
        subprocess.run(
            ["bash", "-c", f"{export[0]}; echo ${RUN_ADMIN_KEY_ENV}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(keys) == 2 and all(len(k) == 64 and int(k, 16) >= 0 for k in keys)


def test_plan_with_only_an_api_key_gives_its_servers_an_admin_key_of_their_own(slurm_env):
    """Issue 57 (3): the job's servers take the configured API key for generation and a fresh admin key, drawn when
    the script runs, for weight updates; the learner is handed both variables by name."""
    cfg = load_config(QWEN3, ["rollout.api_key_env=MOE_RL_ROLLOUT_KEY"])
    script = render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]", MOE_RL_ROLLOUT_KEY=SECRET))
    assert SECRET not in script
    assert len([line for line in script.splitlines() if line.startswith(f"export {RUN_ADMIN_KEY_ENV}=")]) == 1
    cmds = rendered_commands(script)
    for argv in (c for c in cmds if "moe_rl.rollout.sglang_entry" in c):
        assert flag_value(argv, "--api-key-env") == "MOE_RL_ROLLOUT_KEY"
        assert flag_value(argv, "--admin-api-key-env") == RUN_ADMIN_KEY_ENV
    (learner,) = [c for c in cmds if "torchrun" in c]
    assert f"rollout.admin_api_key_env={RUN_ADMIN_KEY_ENV}" in learner


def test_plan_with_external_servers_keeps_the_configured_rules(slurm_env):
    cfg = load_config(QWEN3, ["launch.rollout_nodes=0", 'rollout.addresses=["http://srv:30000"]'])
    script = render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-004]"))
    assert RUN_ADMIN_KEY_ENV not in script and "--export=ALL" not in script


def test_plan_refuses_a_key_variable_that_is_not_set(slurm_env):
    cfg = load_config(QWEN3, ["rollout.api_key_env=MOE_RL_ROLLOUT_KEY"])
    with pytest.raises(LaunchError, match="rollout.api_key_env='MOE_RL_ROLLOUT_KEY' but MOE_RL_ROLLOUT_KEY is not set"):
        render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]"))


def test_config_holds_a_variable_name_not_a_key():
    with pytest.raises(ConfigError, match="api_key_env"):
        load_config(None, [f"rollout.api_key_env=sk-{SECRET}!"])
