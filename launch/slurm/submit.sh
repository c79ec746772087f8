#!/usr/bin/env bash
# Submit CONFIG as a SLURM job sized by its launch section (nodes = rollout + learner, GPUs per
# node, partition, time): launch/slurm/submit.sh CONFIG [a.b=value ...]
# Extra sbatch options go in SBATCH_EXTRA_ARGS (e.g. "--account=abc --qos=high").
# Review the commands first: SLURM_JOB_NODELIST='node[01-06]' moe-rl launch CONFIG --dry-run
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG [a.b=value ...]" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${MOE_RL_PYTHON:-python}
sbatch_line=$("$PY" -m moe_rl.launch sbatch-args "$@")
read -r -a sbatch_opts <<<"$sbatch_line"
# shellcheck disable=SC2086  # SBATCH_EXTRA_ARGS is a user-supplied option list
exec sbatch "${sbatch_opts[@]}" ${SBATCH_EXTRA_ARGS:-} "$here/moe_rl.sbatch" "$@"
