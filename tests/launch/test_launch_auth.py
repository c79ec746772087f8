"""Issue 16, item 1 (cluster side): the SLURM plan names the key variables, never the keys, and warns without one."""

from __future__ import annotations

import logging

import pytest
from launch_helpers import QWEN3, flag_value, rendered_commands

from moe_rl.config import load_config
from moe_rl.launch import LaunchError, render_launch

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


def test_plan_without_a_key_warns_that_anyone_can_replace_the_weights(slurm_env, caplog):
    with caplog.at_level(logging.WARNING):
        script = render_launch(load_config(QWEN3), dry_run=True, env=slurm_env("gpu[001-006]"))
    assert "# note: WARNING: the SGLang servers listen on 0.0.0.0 without an API key" in script
    assert "rollout.api_key_env" in caplog.text


def test_plan_refuses_a_key_variable_that_is_not_set(slurm_env):
    cfg = load_config(QWEN3, ["rollout.api_key_env=MOE_RL_ROLLOUT_KEY"])
    with pytest.raises(LaunchError, match="rollout.api_key_env='MOE_RL_ROLLOUT_KEY' but MOE_RL_ROLLOUT_KEY is not set"):
        render_launch(cfg, dry_run=True, env=slurm_env("gpu[001-006]"))


def test_config_holds_a_variable_name_not_a_key():
    from moe_rl.config import ConfigError

    with pytest.raises(ConfigError, match="api_key_env"):
        load_config(None, [f"rollout.api_key_env=sk-{SECRET}!"])
