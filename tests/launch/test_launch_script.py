"""The rendered launch script: valid bash, carries the resolved config, and runs its steps in order."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import yaml
from launch_helpers import QWEN3, rendered_commands

from moe_rl import cli
from moe_rl.config import apply_overrides, load_config, validate_tree
from moe_rl.launch import render_launch
from moe_rl.sizing import signal_lead

FAKE_SRUN = r"""#!/usr/bin/env bash
# Fake srun (SLURM cannot exist here): log the argv, play a server or a learner.
line=$(printf '%s\x1f' "$@"); printf '%s\n' "$line" >> "$FAKE_LOG"  # one append write per call
node=""
for a in "$@"; do [[ $a == --nodelist=* ]] && node=${a#--nodelist=}; done
keyvar="" prev="" port_file="" first_port=""
for a in "$@"; do [[ $prev == --admin-api-key-env ]] && keyvar=$a; prev=$a; done
for a in "$@"; do [[ $a == --port-file=* ]] && port_file=${a#--port-file=}; [[ $a == --first-port=* ]] && first_port=${a#--first-port=}; done
for a in "$@"; do
  if [[ $a == sglang.launch_server || $a == moe_rl.rollout.sglang_entry ]]; then
    [[ -n "${FAKE_SERVER_DIES:-}" ]] && exit 3
    [[ -z $keyvar || -n ${!keyvar:-} ]] || exit 4
    echo "$$ $node" >> "$FAKE_PIDS"
    # launch serve publishes the port once healthy (the fake curl answers for every running fake server)
    [[ -z $port_file || -n "${FAKE_UNHEALTHY:-}" ]] || { mkdir -p "${port_file%/*}"; echo "$first_port" > "$port_file"; }
    exec sleep 120
  fi
done
# the learner step (and any server) must find the generated key it is handed by name in its environment
for a in "$@"; do [[ $a == rollout.admin_api_key_env=* ]] && keyvar=${a#rollout.admin_api_key_env=}; done
[[ -z $keyvar || -n ${!keyvar:-} ]] || exit 4
if [[ -n "${FAKE_LEARNER_RUNS:-}" ]]; then  # a learner that runs until the forwarded warning, then stops
  trap 'echo "learner got USR1" >> "$FAKE_LOG.signals"; exit 75' USR1
  touch "$FAKE_LOG.learner"
  while :; do sleep 0.1; done
fi
exit "${FAKE_LEARNER_RC:-0}"
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_LOG.signals"
"""
# Fake curl: /health answers once the fake server step on that host is running.
FAKE_CURL = r"""#!/usr/bin/env bash
[[ -z "${FAKE_UNHEALTHY:-}" ]] || exit 7
host=$(sed -E 's#^https?://([^:/]+).*#\1#' <<<"${!#}")
grep -qs " $host\$" "$FAKE_PIDS"
"""


def _bin(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("curl", FAKE_CURL), ("scontrol", FAKE_SCONTROL)):
        (d / name).write_text(text)
        (d / name).chmod(stat.S_IRWXU)
    return d


def _script(tmp_path: Path, *overrides: str) -> str:
    cfg = load_config(QWEN3, [f"train.output_dir={tmp_path / 'run'}", *overrides])
    return render_launch(cfg, dry_run=True, env={"SLURM_JOB_NODELIST": "gpu[001-006]", "SLURM_JOB_ID": "55"})


def _run(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "launch.sh"
    path.write_text(script)
    full_env = {
        **os.environ,
        "PATH": f"{_bin(tmp_path)}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "srun.log"),
        "FAKE_PIDS": str(tmp_path / "pids"),
        **env,
    }
    return subprocess.run(["bash", str(path)], env=full_env, capture_output=True, text=True, timeout=60, check=False)


def _logged(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "srun.log"
    return [line.split("\x1f")[:-1] for line in log.read_text().splitlines()] if log.exists() else []


def test_rendered_script_is_valid_bash(tmp_path):
    path = tmp_path / "launch.sh"
    path.write_text(_script(tmp_path))
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_script_writes_the_resolved_config_the_learner_is_pointed_at(tmp_path):
    script = _script(tmp_path, "optim.lr=3e-7")
    m = re.search(r"cat > (\S+) <<'MOE_RL_CONFIG_EOF'\n(.*?)\nMOE_RL_CONFIG_EOF\n", script, re.DOTALL)
    assert m, "no config heredoc in the script"
    reloaded = validate_tree(yaml.safe_load(m.group(2)))
    assert reloaded.optim.lr == 3e-7 and reloaded.parallel.tp == 4
    (learner,) = [c for c in rendered_commands(script) if "torchrun" in c]
    assert learner[learner.index("train") + 1] == m.group(1)


def test_script_with_fake_srun_starts_servers_then_learner_and_stops_the_servers(tmp_path):
    result = _run(tmp_path, _script(tmp_path))
    assert result.returncode == 0, result.stderr
    calls = _logged(tmp_path)
    assert [("moe_rl.rollout.sglang_entry" in c, "torchrun" in c) for c in calls] == [(True, False)] * 2 + [
        (False, True)
    ]
    assert (tmp_path / "run" / "launch" / "config-55.yaml").exists()
    assert "http://gpu002:30000 healthy" in result.stdout
    (override,) = [a for a in calls[-1] if a.startswith("rollout.addresses=")]  # as bash expanded it
    assert apply_overrides({}, [override])["rollout"]["addresses"] == ["http://gpu001:30000", "http://gpu002:30000"]
    for pid in (int(line.split()[0]) for line in (tmp_path / "pids").read_text().splitlines()):
        assert not Path(f"/proc/{pid}").exists(), f"rollout server step {pid} outlived the script"


def test_script_propagates_the_learner_exit_code(tmp_path):
    result = _run(tmp_path, _script(tmp_path), FAKE_LEARNER_RC="7")
    assert result.returncode == 7
    assert (
        f"the learner step failed with exit code 7; its logs: {tmp_path}/run/launch/logs-55/learner-*.log"
        in result.stderr
    )


def test_script_never_starts_the_learner_when_a_server_dies_during_startup(tmp_path):
    result = _run(tmp_path, _script(tmp_path), FAKE_SERVER_DIES="1", FAKE_UNHEALTHY="1")
    assert result.returncode == 1
    assert "a rollout server step exited before gpu001 was healthy" in result.stderr
    assert not any("torchrun" in c for c in _logged(tmp_path))


def test_cli_dry_run_prints_the_plan_and_reports_config_errors(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[001-006]")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    assert cli.main(["launch", str(QWEN3), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert sum(1 for c in rendered_commands(out) if "torchrun" in c) == 1
    assert cli.main(["launch", str(QWEN3), "launch.learner_nodes=1", "launch.gpus_per_node=2", "--dry-run"]) == 2
    assert "parallel.tp*parallel.pp*parallel.cp" in capsys.readouterr().err


def _run_until_the_learner_starts(script: str, tmp_path: Path) -> subprocess.Popen:
    """Run the rendered script with the fake srun/scontrol of ``_bin``; return once its learner step started."""
    path = tmp_path / "launch.sh"
    path.write_text(script)
    env = {
        **os.environ,
        "PATH": f"{_bin(tmp_path)}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "srun.log"),
        "FAKE_PIDS": str(tmp_path / "pids"),
        "FAKE_LEARNER_RUNS": "1",
    }
    proc = subprocess.Popen(["bash", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.log.learner").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return proc


def test_warning_signal_reaches_the_learner_then_the_job_requeues_itself(tmp_path):
    """Issue 39: SLURM's USR1 (--signal=B:USR1@s) goes to the learner step; after it exits, servers stop and
    the script runs `scontrol requeue <job>` (not while the learner still runs) and exits 0."""
    script = _script(tmp_path)
    lead = signal_lead(load_config(QWEN3)).value  # launch.signal_lead_s unset: the plan's step + save + stop
    assert f"--signal=B:USR1@{lead} --requeue" in script
    (learner,) = [c for c in rendered_commands(script) if "torchrun" in c]
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in learner
    assert f"--shutdown-timeout={lead}" in learner
    set_lead = _script(tmp_path, "launch.signal_lead_s=9000")
    assert "--signal=B:USR1@9000 --requeue" in set_lead and "--shutdown-timeout=9000" in set_lead
    proc = _run_until_the_learner_starts(script, tmp_path)
    assert not (tmp_path / "srun.log.signals").exists()
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "srun.log.signals").read_text().splitlines() == ["learner got USR1", "scontrol requeue 55"]
    assert "requeueing job 55" in err
    for pid in (int(line.split()[0]) for line in (tmp_path / "pids").read_text().splitlines()):
        assert not Path(f"/proc/{pid}").exists(), f"rollout server step {pid} outlived the script"


def test_a_server_that_dies_while_the_learner_runs_stops_the_job_naming_its_node(tmp_path):
    script = _script(tmp_path)
    proc = _run_until_the_learner_starts(script, tmp_path)
    pid, node = (tmp_path / "pids").read_text().splitlines()[1].split()
    os.kill(int(pid), signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"the rollout server on {node} exited (code 137) while the learner ran" in err
    assert not (tmp_path / "srun.log.signals").exists()  # no requeue: a failure, not a warning
