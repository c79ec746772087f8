"""``rollout.max_concurrency`` / ``rollout.server_concurrency`` (issue 53 item 2): what a config means, what the client
gets, what the dry-run prints.

``max_concurrency`` keeps its meaning (requests in flight from the client, all servers together): a config that sets
it gets exactly that. Unset, it is ``server_concurrency`` (default 16) per server x the servers: one server sees the
old default. Both set is refused naming both keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.config.loader import ConfigError
from moe_rl.launch import render_launch
from moe_rl.rollout.client import RolloutClient
from moe_rl.sizing import client_concurrency

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NODES = {"SLURM_JOB_NODELIST": "node[01-20]"}


@pytest.mark.parametrize(
    ("name", "per", "servers"), [("qwen3_30b_a3b", 256, 2), ("qwen3_235b_a22b", 128, 4), ("deepseek_v3_style", 128, 4)]
)
def test_cluster_configs_derive_the_total_from_the_per_server_value_and_print_why(name, per, servers):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    d = client_concurrency(cfg)
    assert d.derived and d.value == per * servers == 512
    assert f"rollout.server_concurrency={per} (set) per server x {servers} server(s)" in d.why
    assert RolloutClient.from_config(cfg, [f"http://h:{i}" for i in range(servers)]).max_concurrency == 512
    more = load_config(CONFIGS / f"{name}.yaml", [f"launch.rollout_nodes={servers + 2}"])
    assert client_concurrency(more).value == per * (servers + 2), "the total follows the number of servers"
    script = render_launch(cfg, dry_run=True, env=NODES)
    assert f"#   rollout.max_concurrency=512 (derived: rollout.server_concurrency={per} (set) per server" in script


def test_a_config_that_sets_max_concurrency_keeps_its_meaning():
    """Old configs: the value is the client's total, whatever the number of servers."""
    cfg = load_config(CONFIGS / "demo.yaml")
    assert cfg.rollout.max_concurrency == 128
    d = client_concurrency(cfg, 3)
    assert not d.derived and d.value == 128 and "plan's value: 48" in d.line()
    assert RolloutClient.from_config(cfg, ["http://a:1", "http://b:1", "http://c:1"]).max_concurrency == 128


def test_unset_is_16_per_server_so_one_server_sees_the_old_default():
    cfg = load_config(None, ["rollout.addresses=[http://a:1]"])
    assert cfg.rollout.max_concurrency is None and client_concurrency(cfg).value == 16
    assert "rollout.server_concurrency=16 (default) per server x 1 server(s)" in client_concurrency(cfg).why
    assert RolloutClient.from_config(cfg, ["http://a:1"]).max_concurrency == 16
    assert RolloutClient.from_config(cfg, ["http://a:1", "http://b:1"]).max_concurrency == 32, "the client's servers"


def test_both_keys_set_is_refused_naming_both(capsys):
    with pytest.raises(ConfigError, match=r"rollout\.max_concurrency=64 \(all servers together\) and "):
        load_config(None, ["rollout.max_concurrency=64", "rollout.server_concurrency=8"])
    q235 = str(CONFIGS / "qwen3_235b_a22b.yaml")
    assert main(["plan", q235, "rollout.max_concurrency=64"]) == 2, "the config sets server_concurrency"
    err = capsys.readouterr().err
    assert "rollout.server_concurrency=128 (per server) are both set; expected one of them" in err
    assert "Traceback" not in err
    assert main(["plan", q235, "rollout.max_concurrency=64", "rollout.server_concurrency=null"]) == 0
    out = capsys.readouterr().out
    assert (
        "rollout.max_concurrency=64 (set in the config; the plan's value: 64 = rollout.server_concurrency=16 (default)"
        in out
    )
