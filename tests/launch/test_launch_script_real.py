"""The rendered SLURM launch script run for real on this machine: real SGLang server, torchrun, trainer.

SLURM itself cannot exist here, so ``srun`` is a local stand-in that drops its options and runs the
step's command on this host; the two "nodes" are ``127.0.0.1`` (rollout) and ``localhost`` (learner).
Everything else is what a cluster job executes: the config heredoc, the server command line, the
``/health`` wait, torchrun's c10d rendezvous, ``moe-rl train`` with ``rollout.addresses``, teardown.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import REPO

from moe_rl.config import load_config
from moe_rl.launch import render_launch
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.ports import free_port
from moe_rl.rollout.shm import held_inodes, shm_entries

LOCAL_SRUN = r"""#!/usr/bin/env bash
# Local stand-in for srun: drop the srun options, honour --output, run the command on this host. Signals as the real
# srun treats them (seen on the local SLURM cluster): SIGTERM kills every process of the step with SIGKILL ("srun:
# forcing job termination"; slurmstepd tracks the step's processes whatever their session); SIGUSR1/SIGUSR2 are
# forwarded to the task as they are.
out=/dev/stdout
while [[ $# -gt 0 && $1 == --* ]]; do
  [[ $1 == --output=* ]] && out=${1#--output=}
  [[ $1 == --nodelist=* ]] && { n=${1#--nodelist=}; export SLURMD_NODENAME=${n%%,*}; }  # as srun does per task
  shift
done
echo "$@" >> "$SRUN_CALLS"
"$@" >"${out//%N/local}" 2>&1 &
task=$!
tree() { echo "$1"; local c; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
trap 'kill -KILL $(tree $task) 2>/dev/null' TERM
trap 'kill -USR1 $task 2>/dev/null' USR1
trap 'kill -USR2 $task 2>/dev/null' USR2
rc=0
while kill -0 $task 2>/dev/null; do wait $task; rc=$?; done  # a trapped signal interrupts the wait
exit $rc
"""


@pytest.mark.sglang
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rendered_script_trains_one_step_with_a_local_srun_stand_in(tmp_path):
    """Also issue 57 (5): another process holds ``launch.rollout_port`` on the rollout node (a busy shared node), so
    the step's server comes up on the next port, publishes it, and the learner is told that one. And issue 57 (6):
    the job's end leaves nothing in /dev/shm. Break tried: the script's cleanup sending SIGTERM to the rollout srun
    (as it did) SIGKILLs the serve wrapper, and the server's ``sglang_loads_*.shm`` stays behind."""

    before = shm_entries()

    run_dir = tmp_path / "run"
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("0.0.0.0", port := free_port()))
    squatter.listen()
    overrides = [
        "launch.rollout_nodes=1",
        "launch.learner_nodes=1",
        "launch.gpus_per_node=1",
        "parallel.backend=gloo",
        f"launch.rollout_port={port}",
        f"launch.master_port={free_port()}",
        f"train.output_dir={run_dir}",
        "train.steps=1",
        "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "train.minibatches_per_step=1",
        "rollout.max_new_tokens=4",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", overrides)
    hf = write_random_hf_checkpoint(cfg.model, tmp_path / "hf", seed=0)
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [*overrides, f"checkpoint.init_from_hf={hf}"])
    script = tmp_path / "launch.sh"
    script.write_text(
        render_launch(cfg, dry_run=True, env={"SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_JOB_ID": "77"})
    )
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "srun").write_text(LOCAL_SRUN)
    (shim / "srun").chmod(stat.S_IRWXU)
    env = {
        **os.environ,
        "SRUN_CALLS": str(tmp_path / "calls"),
        "PATH": os.pathsep.join([str(shim), str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    try:
        result = subprocess.run(
            ["bash", str(script)], env=env, capture_output=True, text=True, timeout=540, check=False
        )
    finally:
        squatter.close()
    logs = run_dir / "launch" / "logs-77"
    learner_log = (
        (logs / "learner-localhost.log").read_text()[-3000:] if (logs / "learner-localhost.log").exists() else ""
    )
    assert result.returncode == 0, f"{result.stderr}\n--- learner log tail ---\n{learner_log}"

    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and calls[0].split()[:4] == ["python", "-m", "moe_rl.launch", "serve"], calls
    assert calls[1].split()[:3] == ["bash", "-c", "exec"] and "moe_rl.rollout.sglang_entry" in calls[0]
    assert "torchrun --nnodes=1 --nproc-per-node=1" in calls[1]  # writing learner-<node>.log (issue 39)
    assert learner_log, "no learner-localhost.log: the learner step's output is not named by node"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert "reward/mean" in records[0] and "replay/rollout_vs_natural/response/flip_rate" in records[0]
    server_log = (logs / "rollout-127.0.0.1.log").read_text()
    assert f"port {port} (or one of the server's auxiliary ports) was taken by another process" in server_log
    assert f"healthy on port {port + 1}" in server_log and f"http://127.0.0.1:{port + 1} healthy" in result.stdout
    # 2 prompts x 4 samples went to the srun-started server, which also got the learner's weights.
    assert server_log.count("POST /generate") >= 8, "the learner did not generate on the server from rollout.addresses"
    assert "POST /update_weights_from_disk" in server_log
    ps = subprocess.run(["pgrep", "-f", f"--model-path {hf}"], capture_output=True, text=True, check=False)
    assert ps.stdout.strip() == "", "the rollout server outlived the launch script"
    assert (
        "server's process group is stopped" not in server_log or "/dev/shm files of the server left" not in server_log
    )
    held = held_inodes()
    left = [p.name for p, i in shm_entries().items() if p not in before and i not in held and "sglang" in p.name]
    assert left == [], f"the job left /dev/shm entries: {left}"
