#!/usr/bin/env bash
# Single-machine run: launch/local.sh CONFIG [a.b=value ...]
# With rollout.addresses empty the trainer starts its own SGLang server (CPU or GPU per
# rollout.device), waits for /health and stops it on exit; nothing else needs starting.
# NPROC=N runs N learner ranks with torchrun --standalone (default 1: a plain python process);
# the parallel sizes are checked against N before anything starts.
# Environment: MOE_RL_PYTHON (default: python).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: [NPROC=N] $0 CONFIG [a.b=value ...]" >&2
  exit 2
fi
PY=${MOE_RL_PYTHON:-python}
NPROC=${NPROC:-1}
"$PY" -m moe_rl.launch check-world --nproc "$NPROC" "$@"
if [[ "$NPROC" == 1 ]]; then
  exec "$PY" -m moe_rl.cli train "$@"
fi
exec "$PY" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC" -m moe_rl.cli train "$@"
