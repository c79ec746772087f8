"""launch/local.sh and launch/slurm/submit.sh: the shell entry points check the config before starting."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from launch_helpers import DSV3, REPO


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "MOE_RL_PYTHON": sys.executable, **extra}


def test_local_launcher_refuses_a_rank_count_the_parallel_sizes_do_not_divide():
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "local.sh"), str(REPO / "configs" / "tiny_cpu.yaml"), "parallel.tp=2"],
        env=_env(NPROC="3"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "world size 3 (NPROC=3)" in result.stderr and "parallel.tp" in result.stderr


def test_submit_script_sizes_the_sbatch_allocation_from_the_launch_section(tmp_path):
    # Fake sbatch (SLURM cannot exist here): print the argv it was given.
    fake = tmp_path / "sbatch"
    fake.write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(stat.S_IRWXU)
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "slurm" / "submit.sh"), str(DSV3), "launch.partition=hpc"],
        env=_env(PATH=f"{tmp_path}:{os.environ['PATH']}", SBATCH_EXTRA_ARGS="--account=rl"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    # deepseek_v3_style: 4 rollout + 16 learner nodes, 8 GPUs each.
    for expected in ("--nodes=20", "--gpus-per-node=8", "--partition=hpc", "--account=rl", "--ntasks-per-node=1"):
        assert expected in argv
    assert argv[-3:] == [str(REPO / "launch" / "slurm" / "moe_rl.sbatch"), str(DSV3), "launch.partition=hpc"]


def test_shell_launchers_are_valid_bash_and_executable():
    for script in ("launch/local.sh", "launch/slurm/submit.sh", "launch/slurm/moe_rl.sbatch"):
        path = REPO / script
        assert os.access(path, os.X_OK), f"{script} is not executable"
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{script}: {result.stderr}"
