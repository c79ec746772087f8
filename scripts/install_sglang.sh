#!/usr/bin/env bash
# Install the pinned SGLang rollout engine into a venv and apply moe_rl's source patches.
#
#   scripts/install_sglang.sh [VENV]        (default: <repo>/.venv)
#   MOE_RL_SGLANG_DEVICE=cpu|cuda           (default: cuda when nvidia-smi sees a GPU, else cpu)
#
# CPU: the sglang wheel hard-pins torch==2.14.1 and CUDA-only packages, so its CPU-fine dependencies
# (requirements/sglang-cpu.txt) are installed under the torch==2.13.0 CPU pin, then sglang itself with
# --no-deps. The two import-only GPU packages (sgl_kernel, torchvision) are NOT installed: stand-ins in
# patches/stubs go on the server process's path only (moe_rl/rollout/server_spec.py).
# CUDA: the normal `sglang` package with its own dependencies; no stand-ins.
# Both: patches/apply.py patches the installed package (idempotent; refuses other versions).
# Idempotent and fast when already done: a stamp in the venv records what was installed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv}"
PY="$VENV/bin/python"
SGLANG_VERSION="0.5.23"
TORCH_CPU_VERSION="2.13.0"
STAMP="$VENV/.moe_rl_sglang_stamp"

die() { echo "install_sglang.sh: error: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no python at $PY (create the venv first: scripts/install.sh)"

DEVICE="${MOE_RL_SGLANG_DEVICE:-}"
if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in cpu|cuda) ;; *) die "MOE_RL_SGLANG_DEVICE=$DEVICE; expected cpu or cuda" ;; esac

# What an installation depends on: the version, the device, the dependency lists and the patch texts.
WANT="$(cat "$REPO/requirements/sglang-cpu.txt" "$REPO/requirements/sglang-constraints.txt" \
  "$REPO/scripts/constraints.txt" "$REPO/patches/sglang/$SGLANG_VERSION"/*.patch | sha256sum | cut -c1-16) \
sglang==$SGLANG_VERSION device=$DEVICE"

installed_version() { "$PY" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true; }

if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$WANT" ] && [ "$(installed_version)" = "$SGLANG_VERSION" ]; then
  echo "install_sglang.sh: sglang $SGLANG_VERSION ($DEVICE) already installed in $VENV"
else
  PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
  if [ "$(installed_version)" = "$SGLANG_VERSION" ]; then
    # Installed and patched with other patch texts: patches apply to the wheel's own files only, so
    # put those back first (a changed patch would otherwise apply neither way and fail the install).
    echo "install_sglang.sh: the patches changed; reinstalling sglang $SGLANG_VERSION's files before patching"
    "${PIP[@]}" --no-deps --force-reinstall -c "$REPO/requirements/sglang-constraints.txt" "sglang==$SGLANG_VERSION"
  fi
  if [ "$DEVICE" = cpu ]; then
    "${PIP[@]}" -c "$REPO/scripts/constraints.txt" -c "$REPO/requirements/sglang-constraints.txt" \
      -r "$REPO/requirements/sglang-cpu.txt"
    "${PIP[@]}" --no-deps -c "$REPO/scripts/constraints.txt" -c "$REPO/requirements/sglang-constraints.txt" \
      "sglang==$SGLANG_VERSION"
  else
    # GPU: sglang brings its own CUDA torch pin; only the shared-library pins apply.
    "${PIP[@]}" -c "$REPO/requirements/sglang-constraints.txt" "sglang==$SGLANG_VERSION"
  fi
  [ "$(installed_version)" = "$SGLANG_VERSION" ] || die "sglang $SGLANG_VERSION did not install into $VENV"
fi

# The learner shares this venv: a moved torch is a broken install, not a warning.
if [ "$DEVICE" = cpu ]; then
  TORCH="$("$PY" -c "import torch; print(torch.__version__)")" || die "torch does not import in $VENV"
  [ "${TORCH%%+*}" = "$TORCH_CPU_VERSION" ] || die "torch is $TORCH after the sglang install; expected $TORCH_CPU_VERSION (CPU)"
fi

"$PY" "$REPO/patches/apply.py" || die "patching sglang $SGLANG_VERSION failed (see above)"
echo "$WANT" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
echo "install_sglang.sh: sglang $SGLANG_VERSION ($DEVICE) ready in $VENV"
