"""Render a ``LaunchPlan`` as one bash script, and run it: the reviewed text is the executed text.

Owns the script's control flow: write the resolved config, start the rollout servers in the
background, wait for every ``/health``, run the learner in the foreground, and stop the servers on
any exit. ``moe-rl launch --dry-run`` prints this script; without ``--dry-run`` it is written to the
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

_HELPERS = """\
rollout_pids=()
cleanup() {
  for pid in "${rollout_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 143' TERM INT

wait_healthy() {  # wait_healthy URL TIMEOUT_S: poll URL/health while every rollout step is alive
  local url=$1 deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null --max-time 5 "$url/health"; do
    for pid in "${rollout_pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "moe_rl: a rollout server step exited before $url was healthy" >&2; exit 1; }
    done
    if ((SECONDS >= deadline)); then
      echo "moe_rl: $url not healthy within $2 s (rollout.startup_timeout_s)" >&2; exit 1
    fi
    sleep 2
  done
  echo "moe_rl: $url healthy"
}
"""


def render_script(plan: LaunchPlan) -> str:
    """The bash text that performs ``plan``; every command appears literally (no loops over nodes)."""
    q = shlex.quote
    launch_dir = str(Path(plan.config_path).parent)
    log_dir = _log_dir(plan)
    lines = [
        "#!/usr/bin/env bash",
        f"# moe_rl launch plan for experiment {plan.name!r}, SLURM job {plan.job_id} (rendered by `moe-rl launch`).",
        f"# submit: sbatch {' '.join(plan.sbatch_args)} launch/slurm/moe_rl.sbatch CONFIG [a.b=value ...]",
        f"# rollout nodes: {' '.join(n for s in plan.rollout_steps for n in s.nodes) or '(none: rollout.addresses)'}",
        f"# learner nodes: {' '.join(plan.learner_step.nodes)}",
        *(f"# note: {note}" for note in plan.notes),
        *(f"# {line}" for line in plan.memory),
        "set -eo pipefail",
        f"mkdir -p {q(launch_dir)} {q(log_dir)}",
        f"cat > {q(plan.config_path)} <<'{CONFIG_HEREDOC_END}'",
        plan.config_yaml.rstrip("\n"),
        CONFIG_HEREDOC_END,
        "",
        _HELPERS,
    ]
    if plan.generated_key_env:  # drawn when the job runs: in no file, on no command line
        lines += ["# a fresh random admin key for this job's rollout servers (srun --export=ALL hands it on)",
                  f"export {plan.generated_key_env}=\"$(head -c 32 /dev/urandom | od -An -tx1 -v | tr -d ' \\n')\"",
                  ""]  # fmt: skip
    for i, step in enumerate(plan.rollout_steps, 1):
        lines += [f"# rollout server {i}/{len(plan.rollout_steps)} on {step.nodes[0]}",
                  quote_argv(step.argv) + " &", "rollout_pids+=($!)", ""]  # fmt: skip
    for url in plan.rollout_urls:
        lines.append(f"wait_healthy {q(url)} {int(plan.startup_timeout_s)}")
    lines += [
        "",
        f"# learner: {len(plan.learner_step.nodes)} node(s), rendezvous at {plan.learner_step.nodes[0]}",
        quote_argv(plan.learner_step.argv),
        "",
    ]
    return "\n".join(lines)


def _log_dir(plan: LaunchPlan) -> str:
    for arg in plan.learner_step.srun_args:
        if arg.startswith("--output="):
            return str(Path(arg.removeprefix("--output=")).parent)
    raise AssertionError("learner step has no --output")  # build_launch_plan always sets it


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
