"""Defaults derived from the job plan (moe_rl.sizing.defaults) on the three cluster configs: values, refusals, wiring.

Expected figures are written out by hand from the model cards' shapes (the plan's parameter counts are checked
against built models elsewhere): Qwen3-30B-A3B has 30.53B parameters (3.35B active), Qwen3-235B-A22B 235.09B
(22.19B active), the DeepSeek-style config 674.84B; a bf16 HF checkpoint is 2 B per parameter; GB = 1e9 B; the
bandwidths are the documented defaults (launch.fs_bandwidth_gb_s=2, launch.network_bandwidth_gb_s=25).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.launch import render_launch
from moe_rl.launch.checks import LaunchError
from moe_rl.launch.plan import sbatch_args
from moe_rl.preflight import config_problems
from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from moe_rl.sizing import request_timeout, signal_lead, startup_timeout

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
Q30, Q235, DSV3 = (CONFIGS / f"{n}.yaml" for n in ("qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3_style"))
NODES = {"SLURM_JOB_NODELIST": "node[01-20]"}
DISK = ["rollout.weight_sync=auto"]  # the cluster configs ship weight_sync: distributed; auto picks disk there

# rollout.startup_timeout_s: 180 s + whole model in bf16 at 2 GB/s, rounded up
STARTUP = {Q30: 180 + 31, Q235: 180 + 236, DSV3: 180 + 675}  # 61.1 / 470.2 / 1349.7 GB: 30.5 / 235.1 / 674.8 s


@pytest.mark.parametrize("path", [Q30, Q235, DSV3], ids=lambda p: p.stem)
def test_server_start_timeout_is_the_base_plus_the_bytes_each_server_loads(path):
    d = startup_timeout(load_config(path))
    assert d.derived and d.value == STARTUP[path]
    assert "of bf16 HF weights each server loads at launch.fs_bandwidth_gb_s=2" in d.why
    set_ = startup_timeout(load_config(path, ["rollout.startup_timeout_s=900"]))
    assert not set_.derived and set_.value == 900 and f"plan's value: {STARTUP[path]}" in set_.line()


def test_server_start_timeout_follows_the_fs_bandwidth_and_reaches_the_launch_script():
    """235B at 4 GB/s: 470.2 GB in 118 s. The launch's serve step and the script's wait use the derived value."""
    assert startup_timeout(load_config(Q235, ["launch.fs_bandwidth_gb_s=4"])).value == 180 + 118
    script = render_launch(load_config(Q235), dry_run=True, env=NODES)
    assert script.count("--startup-timeout=416") == 4  # one per rollout node
    assert "#   rollout.startup_timeout_s=416 (derived: 180 s + 470.2 GB of bf16 HF weights" in script


def test_a_server_spec_without_a_start_timeout_is_refused_before_anything_starts(tmp_path):
    """A spec from a rollout section whose timeout is unset (derived from the whole config) cannot start."""
    spec = ServerSpec.from_rollout_config(load_config(Q30).rollout, tmp_path / "no-model")
    assert spec.startup_timeout_s is None
    server = SGLangServer(spec, tmp_path / "server.log")
    with pytest.raises(ValueError, match=r"rollout\.startup_timeout_s is unset"):
        server.start()
    assert server.process is None and not (tmp_path / "server.log").exists()


@pytest.mark.parametrize(("tokens", "bound"), [(8192, 120 + 820), (4, 120 + 1), (16384, 120 + 1639)])
def test_request_bound_scales_with_max_new_tokens_and_is_the_clients(tokens, bound):
    """120 s + max_new_tokens at 10 tokens/s (rounded up): a whole generation fits in it (past it: continued)."""
    cfg = load_config(Q235, [f"rollout.max_new_tokens={tokens}"])
    assert request_timeout(cfg).value == bound and request_timeout(cfg).derived
    assert RolloutClient.from_config(cfg, ["http://h:1"]).request_timeout_s == bound
    fixed = load_config(Q235, [f"rollout.max_new_tokens={tokens}", "rollout.request_timeout_s=50"])
    assert RolloutClient.from_config(fixed, ["http://h:1"]).request_timeout_s == 50


def test_235b_signal_lead_is_step_plus_save_plus_stop_by_hand():
    """64 x 8 = 512 requests, 512 at a time (rollout.max_concurrency): 1 wave of 8192 tokens at 30 tokens/s; training 10 x 22.19B active x
    512 x 32768 tokens on 64 GPUs at 2e14 FLOP/s (6 + 2 recompute=full + 2 old-log-prob pass); save 411.7 GB per
    node at 2 GB/s; stop 30 s. Weight sync as shipped (distributed): 470.2 GB to each server at 25 GB/s; with
    rollout.weight_sync=auto (disk, the servers are on other hosts): 470.2 GB written by 8 learner nodes + read by
    each server at 2 GB/s."""
    generation = 1 * 8192 / 30
    training = 10 * 22.19076352e9 * 512 * 32768 / (64 * 2e14)
    save = 411.7e9 / 2e9
    network = 470.2e9 / 25e9
    lead = signal_lead(load_config(Q235))
    assert lead.derived and lead.value == math.ceil(generation + training + network + save + 30) == 819
    for words in ("generation 273 s", "training 291 s", "weight sync 19 s", "save 206 s (411.7 GB per node"):
        assert words in lead.why
    disk = 470.2e9 / (8 * 2e9) + 470.2e9 / 2e9
    lead = signal_lead(load_config(Q235, DISK))
    assert lead.derived and lead.value == math.ceil(generation + training + disk + save + 30) == 1065
    assert "weight sync 264 s" in lead.why


@pytest.mark.parametrize(("path", "lead", "save"), [(Q30, 360, 53), (Q235, 819, 206), (DSV3, 1472, 296)])
def test_a_signal_lead_under_the_plan_is_refused_naming_the_save_time_and_the_key(path, lead, save):
    assert signal_lead(load_config(path)).value == lead
    assert not [p for p in config_problems(load_config(path)).problems if "signal_lead" in p]
    problems = config_problems(load_config(path, [f"launch.signal_lead_s={lead - 1}"])).problems
    (msg,) = [p for p in problems if "signal_lead" in p]
    assert msg.startswith(f"launch.signal_lead_s={lead - 1} is shorter than the plan's step + save + stop, {lead} s")
    assert f"the checkpoint save alone takes {save} s" in msg and "launch.signal=null sends no warning" in msg
    assert not config_problems(load_config(path, [f"launch.signal_lead_s={lead}"])).problems


def test_plan_cli_refuses_a_60_s_lead_on_235b_and_says_what_signal_null_does(capsys):
    assert main(["plan", str(Q235), "launch.signal_lead_s=60"]) == 2
    err = capsys.readouterr().err
    assert "launch.signal_lead_s=60 is shorter" in err and "the checkpoint save alone takes 206 s" in err
    assert main(["plan", str(Q235), "launch.signal_lead_s=60", "launch.signal=null"]) == 0
    out = capsys.readouterr().out
    assert "launch.signal=null: no warning before the time limit" in out and "checkpoint.save_interval=20" in out


def test_dry_run_shows_every_derived_value_and_the_disk_sync_warning():
    script = render_launch(load_config(Q235, DISK), dry_run=True, env=NODES)
    for words in (
        "# derived defaults (unset keys take the plan's values",
        "#   rollout.startup_timeout_s=416 (derived: 180 s + 470.2 GB",
        "#   rollout.request_timeout_s=940 (derived: 120 s + rollout.max_new_tokens=8192 at 10 tokens/s",
        "a request still running at the bound is aborted on its server and continued from the tokens it generated",
        "#   launch.signal_lead_s=1065 (derived: step ~828 s",
        "--signal=B:USR1@1065 --requeue",
        "--shutdown-timeout=1065",
        (
            "# warning: rollout.weight_sync=auto syncs through the shared filesystem (disk) at every step: 470.2 GB "
            "written + 1880.7 GB read (4 servers), ~264 s per step at launch.fs_bandwidth_gb_s=2"
        ),
    ):
        assert words in script, words
    shipped = render_launch(load_config(Q235), dry_run=True, env=NODES)  # weight_sync: distributed
    assert "weight sync 19 s" in shipped and "# warning: rollout.weight_sync" not in shipped
    assert "--signal=B:USR1@819 --requeue" in shipped


@pytest.mark.parametrize(
    ("path", "disk"),
    [
        (Q30, "61.1 GB written + 122.1 GB read (2 servers), ~38 s"),
        (DSV3, "1349.7 GB written + 5398.7 GB read (4 servers)"),
    ],
    ids=["qwen3_30b_a3b", "deepseek_v3_style"],
)
def test_dry_run_of_the_other_cluster_configs_shows_their_derived_values(path, disk):
    script = render_launch(load_config(path, DISK), dry_run=True, env=NODES)
    for key, value in (("startup_timeout_s", STARTUP[path]), ("request_timeout_s", 940)):
        assert f"#   rollout.{key}={value} (derived: " in script
    assert f"#   launch.signal_lead_s={signal_lead(load_config(path, DISK)).value} (derived: step ~" in script
    assert disk in script
    assert "# warning: rollout.weight_sync" not in render_launch(load_config(path), dry_run=True, env=NODES)


def test_a_small_model_gets_no_disk_sync_warning(capsys):
    assert main(["plan", str(CONFIGS / "tiny_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "rollout.startup_timeout_s=181 (derived" in out and "warning: rollout.weight_sync" not in out


def test_sbatch_args_carry_the_derived_lead_and_name_the_keys_when_the_world_cannot_size_it():
    """``python -m moe_rl.launch sbatch-args`` (launch/slurm/submit.sh): the plan's lead; a set one as it is."""
    assert "--signal=B:USR1@819" in sbatch_args(load_config(Q235))
    odd = load_config(Q235, ["launch.learner_nodes=3"])  # 24 ranks: not a multiple of etp*ep*pp = 32
    with pytest.raises(LaunchError, match=r"launch\.learner_nodes\*launch\.gpus_per_node = 3\*8"):
        sbatch_args(odd)
    assert "--signal=B:USR1@400" in sbatch_args(
        load_config(Q235, ["launch.learner_nodes=3", "launch.signal_lead_s=400"])
    )
