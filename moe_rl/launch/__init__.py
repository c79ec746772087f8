"""Multi-node launch: SLURM hostlists, the launch plan of a config, and the bash script that runs it."""

from moe_rl.launch.checks import LaunchError, check_learner_world, rollout_gpus_per_server
from moe_rl.launch.hostlist import HostlistError, expand_hostlist
from moe_rl.launch.plan import LaunchPlan, SrunStep, build_launch_plan, sbatch_args
from moe_rl.launch.script import render_launch, render_script

__all__ = [
    "HostlistError",
    "LaunchError",
    "LaunchPlan",
    "SrunStep",
    "build_launch_plan",
    "check_learner_world",
    "expand_hostlist",
    "render_launch",
    "render_script",
    "rollout_gpus_per_server",
    "sbatch_args",
]
