"""The checks a multi-node launch must pass before anything is rendered: the config against the SLURM allocation.

Owns ``LaunchError``, Megatron-Core's world-size divisibility rules, the GPUs one SGLang server takes (and the
server flags ``rollout.extra_server_args`` may not set), the allocation's nodes and GPUs per node, and the key
variables the job must export. Pure (env passed in); it builds no command: that is ``plan.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from moe_rl.config import ConfigError, ExperimentConfig
from moe_rl.launch.hostlist import HostlistError, expand_hostlist

# Flags the launcher sets from the config; a copy in rollout.extra_server_args would silently win.
_OWNED_SERVER_FLAGS = ("--model-path", "--model", "--host", "--port", "--nnodes", "--node-rank", "--dist-init-addr")


class LaunchError(ConfigError):
    """A config or SLURM environment that cannot be launched; the message names the key or variable."""


def check_learner_world(cfg: ExperimentConfig, world_size: int, where: str) -> tuple[int, int]:
    """Megatron-Core's divisibility rules for ``world_size`` ranks -> ``(dp, expert_dp)``.

    ``tp*pp*cp`` must divide the world (dense data parallel) and ``etp*ep*pp`` too (expert data
    parallel; ``etp`` defaults to ``tp``). ``where`` names the keys that set ``world_size``.
    """
    p = cfg.parallel
    etp = p.etp if p.etp is not None else p.tp
    model = p.tp * p.pp * p.cp
    if world_size % model:
        raise LaunchError(
            f"learner world size {world_size} ({where}) is not divisible by parallel.tp*parallel.pp*parallel.cp "
            f"= {p.tp}*{p.pp}*{p.cp} = {model}"
        )
    expert = etp * p.ep * p.pp
    if world_size % expert:
        raise LaunchError(
            f"learner world size {world_size} ({where}) is not divisible by parallel.etp*parallel.ep*parallel.pp "
            f"= {etp}*{p.ep}*{p.pp} = {expert} (parallel.etp=null means parallel.tp)"
        )
    return world_size // model, world_size // expert


def _server_flag_int(args: list[str], *names: str, default: int = 1) -> int:
    """Integer value of an SGLang flag in ``args`` (``--tp-size 4`` or ``--tp-size=4``)."""
    value = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in names:
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
            else:
                raise LaunchError(f"rollout.extra_server_args: {flag} has no value")
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"rollout.extra_server_args: {names[0]} expects an integer, got {value!r}") from None


def rollout_gpus_per_server(cfg: ExperimentConfig) -> int:
    """GPUs one SGLang server occupies: tp*pp, times dp unless DP attention shares the TP GPUs."""
    args = list(cfg.rollout.extra_server_args)
    for arg in args:
        if arg.partition("=")[0] in _OWNED_SERVER_FLAGS:
            raise LaunchError(
                f"rollout.extra_server_args sets {arg.partition('=')[0]}, which the launcher sets itself "
                "(model from model.hf_path / checkpoint.init_from_hf, port from launch.rollout_port, one server per node)"
            )
    tp = _server_flag_int(args, "--tp-size", "--tensor-parallel-size")
    pp = _server_flag_int(args, "--pp-size", "--pipeline-parallel-size")
    dp = _server_flag_int(args, "--dp-size", "--data-parallel-size")
    return tp * pp * (1 if "--enable-dp-attention" in args else dp)


def nodes_from_env(env: Mapping[str, str], needed: int) -> list[str]:
    raw = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not raw:
        raise LaunchError(
            "SLURM_JOB_NODELIST is not set: run inside an allocation (launch/slurm/submit.sh) or, to review "
            f"the commands, set it by hand, e.g. SLURM_JOB_NODELIST='node[01-{needed:02d}]' moe-rl launch ... --dry-run"
        )
    try:
        nodes = expand_hostlist(raw)
    except HostlistError as exc:
        raise LaunchError(f"SLURM_JOB_NODELIST: {exc}") from None
    count = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if count and count.isdigit() and int(count) != len(nodes):
        raise LaunchError(f"SLURM_JOB_NODELIST={raw!r} expands to {len(nodes)} hosts but SLURM_JOB_NUM_NODES={count}")
    if len(nodes) < needed:
        raise LaunchError(
            f"the allocation has {len(nodes)} nodes ({raw}) but launch.rollout_nodes + launch.learner_nodes = {needed}"
        )
    return nodes


def check_gpus_on_node(cfg: ExperimentConfig, env: Mapping[str, str]) -> None:
    gpus = env.get("SLURM_GPUS_ON_NODE")
    if gpus and gpus.isdigit() and int(gpus) < cfg.launch.gpus_per_node:
        raise LaunchError(
            f"launch.gpus_per_node={cfg.launch.gpus_per_node} but SLURM_GPUS_ON_NODE={gpus}; "
            "allocate more GPUs per node or lower launch.gpus_per_node"
        )


def check_key_variables(cfg: ExperimentConfig, env: Mapping[str, str]) -> tuple[str, ...]:
    """Names of the key variables (exported to every step by srun --export=ALL); LaunchError if one is unset."""
    names = tuple(n for n in (cfg.rollout.api_key_env, cfg.rollout.admin_api_key_env) if n)
    r = cfg.rollout
    for key, name in (("rollout.api_key_env", r.api_key_env), ("rollout.admin_api_key_env", r.admin_api_key_env)):
        if name and not env.get(name):
            raise LaunchError(
                f"{key}={name!r} but {name} is not set in the job's environment; export it before sbatch "
                "(srun passes it to the rollout and learner steps; the plan names only the variable)"
            )
    return names
