#!/usr/bin/env bash
# One install path for users, the README commands and CI.
#   bash scripts/install.sh            -> ./.venv with torch 2.13.0 (CPU), megatron-core 0.16.1,
#                                         moe_rl (editable) + test tools, and SGLang's CPU engine.
# Env: MOE_RL_VENV=<dir> (default .venv), MOE_RL_SKIP_SGLANG=1 to skip the rollout engine.
# Dependencies are installed once per hash of the lock inputs (pyproject.toml, requirements/,
# scripts/constraints.txt, patches/); later runs only re-point the editable install: seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${MOE_RL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
CONSTRAINTS=$ROOT/scripts/constraints.txt

lock_hash() {
  cat pyproject.toml scripts/constraints.txt scripts/install.sh \
      $(find requirements patches scripts/install_sglang.sh -type f 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -c1-16
}
HASH=$(lock_hash)
STAMP=$VENV/.moe_rl-install-$HASH

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ ! -f "$STAMP" ]; then
  echo "[install] dependencies into $VENV (lock hash $HASH)"
  "${PIP[@]}" install -q --upgrade pip
  # torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" torch==2.13.0
  # The SGLang pins (transformers, tokenizers, numpy) apply from the start, so nothing is installed twice.
  EXTRA_C=(); [ -f requirements/sglang-constraints.txt ] && EXTRA_C=(-c requirements/sglang-constraints.txt)
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "${EXTRA_C[@]}" -e ".[test]"
  if [ "${MOE_RL_SKIP_SGLANG:-0}" != "1" ] && [ -f scripts/install_sglang.sh ]; then
    bash scripts/install_sglang.sh "$VENV"
  fi
  rm -f "$VENV"/.moe_rl-install-*
  touch "$STAMP"
else
  echo "[install] dependencies up to date in $VENV (lock hash $HASH)"
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e . >/dev/null
fi

"$VENV/bin/python" -W ignore - <<'PY'
import torch, megatron.core
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, found {torch.__version__}"
print(f"[install] ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}")
PY
