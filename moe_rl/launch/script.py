"""Render a ``LaunchPlan`` as one bash script, and run it: the reviewed text is the executed text.

Owns the script's control flow: write the resolved config (and, with no HF checkpoint configured, the
one the servers start from), start the rollout servers in the background (each on the first free port from
``launch.rollout_port``, ``serve.py``), wait for every server's published port and ``/health``,
run the learner while watching the servers (one that exits stops the job, naming its node), pass
SLURM's warning (``launch.signal``) to the learner and requeue the job once it has checkpointed, and
stop the servers on any exit. ``moe-rl launch --dry-run`` prints this script; without ``--dry-run`` it is written to the
run directory and ``exec``-ed, so SLURM's signals reach the script's cleanup trap directly.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from moe_rl.config import ExperimentConfig
from moe_rl.launch.plan import CONFIG_HEREDOC_END, LaunchPlan, build_launch_plan, quote_argv
from moe_rl.launch.serve import ROLLOUT_PORT_TRIES
from moe_rl.sizing.defaults import STOP_S

_HELPERS = """\
rollout_pids=() rollout_nodes=() learner_pid="" stop_signal=""
cleanup() {
  trap - TERM INT USR1 USR2
  # the servers first, with SIGUSR2, which srun forwards as it is (on SIGTERM srun SIGKILLs its tasks, and a killed
  # `moe_rl.launch serve` cannot stop its server's processes or remove their /dev/shm files); then what is left
  for pid in "${rollout_pids[@]}"; do kill -USR2 "$pid" 2>/dev/null || true; done
  local deadline=$((SECONDS + STOP_S))
  while ((SECONDS < deadline)) && rollout_running; do sleep 0.5; done
  for pid in "${rollout_pids[@]}" $learner_pid; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
rollout_running() {  # a rollout step's srun still runs (bash reaps its exited children at once)
  local pid
  for pid in "${rollout_pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}
trap cleanup EXIT
trap 'exit 143' TERM INT

rollout_addresses=""
wait_port() {  # wait_port NODE PORT_FILE TIMEOUT_S: the port NODE's server published once healthy (launch serve)
  local node=$1 file=$2 deadline=$((SECONDS + $3)) url
  until [[ -s $file ]]; do
    for pid in "${rollout_pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "moe_rl: a rollout server step exited before $node was healthy" >&2; exit 1; }
    done
    if ((SECONDS >= deadline)); then
      echo "moe_rl: $node not healthy within $3 s (rollout.startup_timeout_s per port tried)" >&2; exit 1
    fi
    sleep 2
  done
  url="http://$node:$(<"$file")"
  curl -sf -o /dev/null --max-time 5 "$url/health" || { echo "moe_rl: $url (from $file) does not answer" >&2; exit 1; }
  echo "moe_rl: $url healthy"
  rollout_addresses+="${rollout_addresses:+,}\"$url\""
}
"""

# launch.signal: SLURM's warning reaches this shell only (sbatch --signal=B:...). It is passed to the
# learner step (srun forwards it to torchrun, which forwards it to the ranks); the learner finishes its
# step, checkpoints and exits; then the servers stop and the job requeues itself. A warning that comes
# before the learner started requeues at once (nothing to save).
_STOP_HELPERS = """\
on_stop() {
  stop_signal=$1
  echo "moe_rl: got SIG$1 (launch.signal): the learner finishes its step and checkpoints; then the job requeues" >&2
  if [[ -n $learner_pid ]]; then kill -"$1" "$learner_pid" 2>/dev/null || true; else requeue_now; fi
}
requeue_now() {
  cleanup
  echo "moe_rl: requeueing job JOB_ID (scontrol requeue); it resumes from the last checkpoint" >&2
  scontrol requeue JOB_ID
  exit 0
}
"""

# Wait for the learner while watching the servers; the learner's exit code is the script's.
_WAIT_LEARNER = """\
learner_rc=""
while [[ -z $learner_rc ]]; do
  wait -n -p done_pid "$learner_pid" "${rollout_pids[@]}" && rc=0 || rc=$?
  if [[ -z ${done_pid:-} ]]; then continue; fi  # a trapped signal interrupted the wait
  if [[ $done_pid == "$learner_pid" ]]; then learner_rc=$rc; break; fi
  for i in "${!rollout_pids[@]}"; do
    if [[ ${rollout_pids[$i]} == "$done_pid" ]]; then
      echo "moe_rl: the rollout server on ${rollout_nodes[$i]} exited (code $rc) while the learner ran; stopping the job" \\
        "(servers on other nodes are not restarted by the learner; log: LOG_DIR/rollout-${rollout_nodes[$i]}.log)" >&2
      exit 1
    fi
  done
  done_pid=""
done
"""


def _helpers() -> str:
    """The shell helpers; the servers' stop deadline is the plan's stop term (``moe_rl.sizing.defaults.STOP_S``)."""
    return _HELPERS.replace("STOP_S", str(STOP_S))


def render_script(plan: LaunchPlan) -> str:
    """The bash text that performs ``plan``; every command appears literally (no loops over nodes)."""
    q = shlex.quote
    launch_dir = str(Path(plan.config_path).parent)
    lines = [
        "#!/usr/bin/env bash",
        f"# moe_rl launch plan for experiment {plan.name!r}, SLURM job {plan.job_id} (rendered by `moe-rl launch`).",
        f"# submit: sbatch {' '.join(plan.sbatch_args)} launch/slurm/moe_rl.sbatch CONFIG [a.b=value ...]",
        f"# rollout nodes: {' '.join(n for s in plan.rollout_steps for n in s.nodes) or '(none: rollout.addresses)'}",
        f"# learner nodes: {' '.join(plan.learner_step.nodes)}",
        *(f"# note: {note}" for note in plan.notes),
        *(f"# {line}" for line in plan.memory),
        "set -eo pipefail",
        f"mkdir -p {q(launch_dir)} {q(plan.log_dir)}",
        *(
            [f"rm -rf {q(str(Path(plan.rollout_port_files[0]).parent))}  # a requeued job's servers publish anew"]
            if plan.rollout_port_files
            else []
        ),
        f"cat > {q(plan.config_path)} <<'{CONFIG_HEREDOC_END}'",
        plan.config_yaml.rstrip("\n"),
        CONFIG_HEREDOC_END,
        "",
        _helpers(),
    ]
    if plan.stop_signal:
        lines += [
            _STOP_HELPERS.replace("JOB_ID", q(plan.job_id)),
            f"trap 'on_stop {plan.stop_signal}' {plan.stop_signal}",
            "",
        ]
    if plan.generated_key_env:  # drawn when the job runs: in no file, on no command line
        lines += [
            "# a fresh random admin key for this job's rollout servers (srun --export=ALL hands it on)",
            f"export {plan.generated_key_env}=\"$(head -c 32 /dev/urandom | od -An -tx1 -v | tr -d ' \\n')\"",
            "",
        ]
    if plan.init_hf:
        lines += [
            "# the HF checkpoint the servers start from (random init of the model section; kept on requeue)",
            quote_argv(list(plan.init_hf)),
            "",
        ]
    for i, step in enumerate(plan.rollout_steps, 1):
        lines += [
            f"# rollout server {i}/{len(plan.rollout_steps)} on {step.nodes[0]}",
            quote_argv(step.argv) + " &",
            f"rollout_pids+=($!) rollout_nodes+=({q(step.nodes[0])})",
            "",
        ]
    wait_s = int(plan.startup_timeout_s) * ROLLOUT_PORT_TRIES
    for step, port_file in zip(plan.rollout_steps, plan.rollout_port_files, strict=True):
        lines.append(f"wait_port {q(step.nodes[0])} {q(port_file)} {wait_s}")
    lines += [
        "",
        (
            f"# learner: {len(plan.learner_step.nodes)} node(s), rendezvous at {plan.learner_step.nodes[0]}, "
            f"logs {plan.log_dir}/learner-<node>.log"
        ),
        _learner_command(plan) + " &",
        "learner_pid=$!",
        _WAIT_LEARNER.replace("LOG_DIR", plan.log_dir),
    ]
    if plan.stop_signal:
        lines += ["if [[ -n $stop_signal ]]; then requeue_now; fi"]
    lines += [
        "if ((learner_rc != 0)); then",
        f'  echo "moe_rl: the learner step failed with exit code $learner_rc; its logs: {plan.log_dir}/learner-*.log" >&2',
        "fi",
        "exit $learner_rc",
        "",
    ]
    return "\n".join(lines)


def _learner_command(plan: LaunchPlan) -> str:
    """The learner step's shell text; with servers started by this job, its ``rollout.addresses`` are the ones the
    servers published (``$rollout_addresses``, built by ``wait_port``), not the first-choice ports of the plan."""
    text = quote_argv(plan.learner_step.argv)
    if not plan.rollout_port_files:
        return text
    (given,) = [a for a in plan.learner_step.argv if a.startswith("rollout.addresses=")]
    return text.replace(shlex.quote(given), '"rollout.addresses=[$rollout_addresses]"')


def _write_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def render_launch(cfg: ExperimentConfig, dry_run: bool, env: Mapping[str, str] | None = None) -> str:
    """Dry run: the launch script for ``cfg`` in the allocation ``env`` (default ``os.environ``).

    Not a dry run: print the same script, write it to ``<train.output_dir>/launch/launch-<job>.sh``
    and replace this process with ``bash`` running it (the call does not return).
    """
    env = os.environ if env is None else env
    plan = build_launch_plan(cfg, env)
    text = render_script(plan)
    if dry_run:
        return text
    path = _write_atomic(Path(plan.config_path).parent / f"launch-{plan.job_id}.sh", text)
    print(text, flush=True)
    print(f"# moe_rl: running {path}", file=sys.stderr, flush=True)
    os.execvp("bash", ["bash", str(path)])
    raise AssertionError("unreachable: execvp returned")
