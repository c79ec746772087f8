"""Turn an experiment config + SLURM environment into a launch plan: who runs what, on which node.

Owns node assignment (first ``launch.rollout_nodes`` hosts serve SGLang, the next
``launch.learner_nodes`` run torchrun), the srun/sglang/torchrun argv of every step and the rollout
addresses handed to the learner. The checks it runs first (world sizes Megatron-Core would otherwise fail late
on, the allocation, the key variables) are ``checks.py``'s. It is pure (env passed in, nothing executed);
``script.py`` renders and runs the plan.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from moe_rl.config import ExperimentConfig, dump_config
from moe_rl.config.hf_model import initial_weights_dir
from moe_rl.launch.checks import (
    LaunchError,
    check_gpus_on_node,
    check_key_variables,
    check_learner_world,
    nodes_from_env,
    rollout_gpus_per_server,
)
from moe_rl.launch.serve import ROLLOUT_PORT_TRIES
from moe_rl.rollout.auth import RUN_ADMIN_KEY_ENV
from moe_rl.rollout.server_spec import ServerSpec, server_command, server_env
from moe_rl.sizing import derived_lines, job_plan, signal_lead, startup_timeout

logger = logging.getLogger(__name__)
PYTHON = "python"  # interpreter on the compute nodes: whatever `python` the job's environment puts first
# `bash -c LOG_PER_NODE LOG_DIR CMD...`: CMD's output to LOG_DIR/learner-<SLURM node name>.log
LOG_PER_NODE = 'exec "$@" >>"$0/learner-${SLURMD_NODENAME:-$(hostname -s)}.log" 2>&1'
CONFIG_HEREDOC_END = "MOE_RL_CONFIG_EOF"
_OVERRIDE = re.compile(r"^\w+(\.\w+)+=")  # a dotted config override token: one per line when rendered


@dataclass(frozen=True)
class SrunStep:
    """One ``srun`` job step: ``srun_args`` place it on ``nodes``; ``command`` is what each task runs."""

    role: str  # "rollout" | "learner"
    nodes: tuple[str, ...]
    srun_args: tuple[str, ...]
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def argv(self) -> list[str]:
        """Full argv: ``[env K=V ..., srun, *srun_args, *command]`` (``env`` only when the step sets variables)."""
        prefix = ["env", *(f"{k}={v}" for k, v in self.env)] if self.env else []
        return [*prefix, "srun", *self.srun_args, *self.command]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a multi-node run starts, in start order (rollout servers, then the learner)."""

    name: str
    job_id: str
    run_dir: str
    config_path: str  # where the script writes the resolved config the learner reads
    config_yaml: str
    rollout_steps: tuple[SrunStep, ...]
    rollout_urls: tuple[str, ...]  # servers the script waits for (empty when using rollout.addresses)
    rollout_addresses: tuple[str, ...]  # what the learner is told (rollout.addresses) if every first port is free
    learner_step: SrunStep
    startup_timeout_s: float
    sbatch_args: tuple[str, ...]
    notes: tuple[str, ...] = ()
    generated_key_env: str | None = None  # the script exports a fresh random admin key under this name
    memory: tuple[str, ...] = ()  # the job plan's lines (moe_rl.sizing): GPU, host, disk, network, derived defaults
    log_dir: str = ""  # rollout-<node>.log and learner-<node>.log (named by SLURM node name)
    init_hf: tuple[str, ...] = ()  # command writing the HF dir the servers start from (no HF checkpoint configured)
    stop_signal: str | None = None  # launch.signal: forwarded to the learner, then the job requeues itself
    rollout_port_files: tuple[str, ...] = ()  # per rollout step: the port its server got (launch.serve), once healthy


def sbatch_args(cfg: ExperimentConfig) -> list[str]:
    """``sbatch`` options that allocate the nodes ``cfg.launch`` asks for (one task per node)."""
    ln = cfg.launch
    args = [
        f"--job-name={cfg.name}",
        f"--nodes={ln.rollout_nodes + ln.learner_nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={ln.gpus_per_node}",
        "--exclusive",
        f"--time={ln.time}",
    ]
    if ln.signal:  # SLURM's warning to the batch shell before the time limit; the job then requeues itself
        args += [f"--signal=B:{ln.signal}@{_signal_lead_s(cfg)}", "--requeue"]
    if ln.partition:
        args.append(f"--partition={ln.partition}")
    return args


def _signal_lead_s(cfg: ExperimentConfig) -> int:
    """``launch.signal_lead_s``, or the plan's step + save + stop when unset (the layout must fit the world)."""
    ln = cfg.launch
    if ln.signal_lead_s is not None:
        return ln.signal_lead_s
    world = ln.learner_nodes * ln.gpus_per_node
    check_learner_world(
        cfg, world, f"launch.learner_nodes*launch.gpus_per_node = {ln.learner_nodes}*{ln.gpus_per_node}"
    )
    return int(signal_lead(cfg, world).value)


def initial_served_dir(cfg: ExperimentConfig) -> tuple[str, bool]:
    """``(dir, generated)``: the HF checkpoint the servers start from. Without ``checkpoint.init_from_hf`` /
    ``model.hf_path`` the job writes a random-init one (the model section's architecture) to
    ``<train.output_dir>/hf/initial`` first; the learner pushes its own weights before the first rollout."""

    given = initial_weights_dir(cfg)
    return (given, False) if given else (str(PurePosixPath(cfg.train.output_dir) / "hf" / "initial"), True)


def _rollout_steps(
    cfg: ExperimentConfig, nodes: list[str], log_dir: str, job_env: Mapping[str, str]
) -> tuple[list[SrunStep], list[str], list[str]]:
    """One SGLang server per rollout node, listening on all interfaces at ``launch.rollout_port``."""
    ln, notes = cfg.launch, []
    served, generated = initial_served_dir(cfg)
    if generated:
        notes.append(
            f"no HF checkpoint configured: the job writes a random-init one to {served} for the servers "
            "to start from; the learner pushes its weights before the first rollout"
        )
    per_server = rollout_gpus_per_server(cfg)
    if cfg.rollout.device == "cuda":
        if per_server > ln.gpus_per_node:
            raise LaunchError(
                f"one SGLang server needs tp*pp*dp = {per_server} GPUs (rollout.extra_server_args) but "
                f"launch.gpus_per_node={ln.gpus_per_node}; multi-node SGLang servers are not launched by moe_rl"
            )
        if per_server < ln.gpus_per_node:
            notes.append(
                f"each SGLang server uses {per_server} of {ln.gpus_per_node} GPUs per rollout node; add "
                f"'--dp-size {ln.gpus_per_node // per_server}' to rollout.extra_server_args to use them all"
            )
    # 0.0.0.0: the learner nodes connect from outside; same flags as the local launcher otherwise.
    # No admin key configured: the script draws a fresh one at run time (generated_key_env), never in a file; the
    # servers this job launches never take the API key on their admin endpoints.
    keys = {} if cfg.rollout.admin_api_key_env else {"admin_api_key_env": RUN_ADMIN_KEY_ENV}
    spec = ServerSpec.from_rollout_config(cfg.rollout, served, host="0.0.0.0", port=ln.rollout_port, **keys)
    if keys:
        notes.append(
            f"no rollout.admin_api_key_env: a fresh random admin key for this job is exported as "
            f"{RUN_ADMIN_KEY_ENV} to the servers and the learner (never written to a file)"
        )
    steps, urls = [], []
    for node in nodes:
        srun = ["--nodes=1", "--ntasks=1", f"--nodelist={node}"]
        if cfg.rollout.device == "cuda":
            srun.append(f"--gpus-per-node={ln.gpus_per_node}")
        srun += ["--kill-on-bad-exit=1", f"--output={log_dir}/rollout-{node}.log"]
        # CPU engine switch + stand-ins (ahead of the job's own PYTHONPATH, if any); PYTHONUNBUFFERED
        env = tuple(server_env(spec, base={k: v for k, v in job_env.items() if k == "PYTHONPATH"}).items())
        # the first free port from launch.rollout_port on (a busy node: another job took it), published once healthy
        serve = (
            PYTHON,
            "-m",
            "moe_rl.launch",
            "serve",
            f"--first-port={ln.rollout_port}",
            f"--port-tries={ROLLOUT_PORT_TRIES}",
            f"--port-file={rollout_port_file(log_dir, node)}",
            f"--startup-timeout={startup_timeout(cfg).value:g}",
            "--",
        )
        command = (*serve, *server_command(spec, ln.rollout_port, PYTHON))
        steps.append(SrunStep("rollout", (node,), tuple(srun), command, env))
        urls.append(f"http://{node}:{ln.rollout_port}")
    return steps, urls, notes


def rollout_port_file(log_dir: str, node: str) -> str:
    """Where the rollout step on ``node`` publishes its server's port (``python -m moe_rl.launch serve``): beside
    the job's ``logs-<job>`` folder, in ``ports-<job>``."""
    logs = PurePosixPath(log_dir)
    return str(logs.with_name(logs.name.replace("logs-", "ports-", 1)) / f"rollout-{node}.port")


def _learner_step(
    cfg: ExperimentConfig,
    nodes: list[str],
    addresses: list[str],
    config_path: str,
    job_id: str,
    log_dir: str,
    key_env: str | None = None,
) -> SrunStep:
    """``torchrun`` on every learner node (c10d rendezvous at the first one) running ``moe-rl train``."""
    ln, p = cfg.launch, cfg.parallel
    srun = (
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        # parallel.backend=gloo: a CPU learner, launch.gpus_per_node is then processes per node
        *(() if p.backend == "gloo" else (f"--gpus-per-node={ln.gpus_per_node}",)),
        "--kill-on-bad-exit=1",
    )
    # Parallel sizes are repeated as overrides so the reviewed command shows the learner layout.
    addr_yaml = "[" + ",".join(f'"{a}"' for a in addresses) + "]"
    overrides = (
        f"parallel.tp={p.tp}",
        f"parallel.pp={p.pp}",
        f"parallel.cp={p.cp}",
        f"parallel.ep={p.ep}",
        f"parallel.etp={'null' if p.etp is None else p.etp}",
        f"rollout.addresses={addr_yaml}",
        *((f"rollout.admin_api_key_env={key_env}",) if key_env else ()),  # the job's generated key, by name
    )
    # torchrun passes launch.signal on to the ranks (its default set lacks USR1/USR2) and gives them
    # launch.signal_lead_s to finish the step and checkpoint before it kills them.
    signals = (
        (
            f"--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIG{ln.signal}",
            f"--shutdown-timeout={_signal_lead_s(cfg)}",
        )
        if ln.signal
        else ()
    )
    command = (
        # one log per node, named by SLURM node name (srun's %N is the host name: several slurmd share a host)
        "bash",
        "-c",
        LOG_PER_NODE,
        log_dir,
        "torchrun",
        f"--nnodes={len(nodes)}",
        f"--nproc-per-node={ln.gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={nodes[0]}:{ln.master_port}",
        f"--rdzv-id={job_id}",
        *signals,
        "-m",
        "moe_rl.cli",
        "train",
        config_path,
        *overrides,
    )
    return SrunStep("learner", tuple(nodes), srun, command)


def build_launch_plan(cfg: ExperimentConfig, env: Mapping[str, str]) -> LaunchPlan:
    """The plan for ``cfg`` inside the SLURM allocation described by ``env`` (``SLURM_*`` variables)."""
    ln = cfg.launch
    world = ln.learner_nodes * ln.gpus_per_node
    where = f"launch.learner_nodes*launch.gpus_per_node = {ln.learner_nodes}*{ln.gpus_per_node}"
    dp, edp = check_learner_world(cfg, world, where)
    if ln.rollout_nodes and cfg.rollout.addresses:
        raise LaunchError(
            f"rollout.addresses={cfg.rollout.addresses} points at running servers but launch.rollout_nodes="
            f"{ln.rollout_nodes} would start new ones; set launch.rollout_nodes=0 or rollout.addresses=[]"
        )
    if not ln.rollout_nodes and not cfg.rollout.addresses:
        raise LaunchError("launch.rollout_nodes=0 needs rollout.addresses (http://host:port of running SGLang servers)")
    check_gpus_on_node(cfg, env)
    key_vars = check_key_variables(cfg, env)
    needed = ln.rollout_nodes + ln.learner_nodes
    nodes = nodes_from_env(env, needed)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "manual"
    run_dir = cfg.train.output_dir
    log_dir = str(PurePosixPath(run_dir) / "launch" / f"logs-{job_id}")
    config_path = str(PurePosixPath(run_dir) / "launch" / f"config-{job_id}.yaml")
    notes = [
        (
            f"learner world {world} = {ln.learner_nodes} nodes x {ln.gpus_per_node} GPUs: "
            f"dp {dp} (tp*pp*cp = {world // dp}), expert dp {edp} (etp*ep*pp = {world // edp})"
        )
    ]
    if len(nodes) > needed:
        notes.append(f"{len(nodes) - needed} allocated node(s) stay idle: {' '.join(nodes[needed:])}")
    rollout_nodes, learner_nodes = nodes[: ln.rollout_nodes], nodes[ln.rollout_nodes : needed]
    rollout_steps, urls, rollout_notes = (
        _rollout_steps(cfg, rollout_nodes, log_dir, env) if ln.rollout_nodes else ([], [], [])
    )
    addresses = urls or list(cfg.rollout.addresses)
    generated = RUN_ADMIN_KEY_ENV if rollout_steps and not cfg.rollout.admin_api_key_env else None
    key_vars = (*key_vars, generated) if generated else key_vars
    if key_vars:  # explicit: the rollout and learner steps inherit the variables holding the keys
        rollout_steps = [dataclasses.replace(st, srun_args=(*st.srun_args, "--export=ALL")) for st in rollout_steps]
    if CONFIG_HEREDOC_END in (yaml_text := dump_config(cfg)):
        raise LaunchError(f"the config text contains the heredoc terminator {CONFIG_HEREDOC_END!r}")
    return LaunchPlan(
        name=cfg.name,
        job_id=job_id,
        run_dir=run_dir,
        config_path=config_path,
        config_yaml=yaml_text,
        rollout_steps=tuple(rollout_steps),
        rollout_urls=tuple(urls),
        rollout_addresses=tuple(addresses),
        rollout_port_files=tuple(rollout_port_file(log_dir, st.nodes[0]) for st in rollout_steps),
        learner_step=_with_export(
            _learner_step(cfg, learner_nodes, addresses, config_path, job_id, log_dir, generated), key_vars
        ),
        startup_timeout_s=startup_timeout(cfg).value,
        sbatch_args=tuple(sbatch_args(cfg)),
        notes=tuple(notes + rollout_notes),
        generated_key_env=generated,
        memory=(*job_plan(cfg).lines(), *derived_lines(cfg)),  # world = launch.learner_nodes * launch.gpus_per_node
        log_dir=log_dir,
        init_hf=(PYTHON, "-m", "moe_rl.launch", "init-hf", config_path, initial_served_dir(cfg)[0])
        if rollout_steps and initial_served_dir(cfg)[1]
        else (),
        stop_signal=ln.signal,
    )


def _with_export(step: SrunStep, key_vars: tuple[str, ...]) -> SrunStep:
    return dataclasses.replace(step, srun_args=(*step.srun_args, "--export=ALL")) if key_vars else step


def quote_argv(argv: list[str]) -> str:
    """Shell text of ``argv`` with one flag per continuation line (bash-equivalent to ``shlex.join``)."""
    lines, current = [], []
    for tok in argv:
        starts_group = tok.startswith("--") or tok in ("srun", "torchrun", PYTHON) or _OVERRIDE.match(tok)
        if current and (starts_group or (tok == "-m" and current != [PYTHON])):
            lines.append(" ".join(current))
            current = []
        current.append(shlex.quote(tok))
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)
