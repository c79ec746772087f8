#!/usr/bin/env bash
# One-command GPU check: install the wheel set offline into a target dir, run the GPU-capable test
# suite and the realistic-shape learner/replay benchmark, print a summary. docs/gpu.md explains it.
#
#   scripts/gpu_check.sh --wheels DIR [--wheels DIR2 ...] [--target DIR] [--out DIR] [--quick]
#
# --wheels  folder(s) of wheels (requirements/gpu-check.txt lists the set); installed with
#           pip --no-index --no-deps --target, nothing is fetched. Omit to use what $PYTHON already has.
# --target  install dir (default: a fresh temp dir); put on PYTHONPATH before the repo.
# --out     where logs go (default: a temp dir); the summary is also written to OUT/summary.txt.
# --quick   tests only, no benchmark.
# PYTHON    the interpreter that has CUDA torch (default: python3).
# GPU_CHECK_TESTS  pytest paths to run instead of the default suite (space-separated).
# Exit: 0 all passed; 1 tests or benchmark failed; 2 no CUDA GPU / no torch / missing packages.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS=()
TARGET=""
OUT=""
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS+=("$2"); shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)"; exit 2 ;;
  esac
done

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_check: '$PY' cannot import torch; set PYTHON to the interpreter with CUDA torch"; exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); run it on a machine with an NVIDIA GPU"
  exit 2
fi

OUT="${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$OUT"
if [ ${#WHEELS[@]} -gt 0 ]; then
  TARGET="${TARGET:-$(mktemp -d -t gpu_check_site.XXXXXX)}"
  files=()
  for d in "${WHEELS[@]}"; do
    [ -d "$d" ] || { echo "gpu_check: --wheels $d is not a folder"; exit 2; }
    files+=("$d"/*.whl)
  done
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
      "${files[@]}" >"$OUT/pip.log" 2>&1; then
    echo "gpu_check: installing the wheels into $TARGET failed; see $OUT/pip.log"; exit 2
  fi
fi
export PYTHONPATH="${TARGET:+$TARGET:}$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# Everything the GPU-capable suite imports that a plain CUDA torch image may lack.
missing=$("$PY" - 2>"$OUT/imports.err" <<'EOF'
import importlib.util
mods = ["megatron.core", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "pybase64",
        "safetensors", "transformers", "tokenizers", "yaml", "httpx", "hypothesis", "pytest", "pytest_timeout",
        "numpy"]
miss = []
for m in mods:
    try:
        if importlib.util.find_spec(m) is None:
            miss.append(m)
    except ModuleNotFoundError:
        miss.append(m)
print(" ".join(miss))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages: $missing (bring their wheels: requirements/gpu-check.txt)"; exit 2
fi

versions=$("$PY" - 2>"$OUT/versions.err" <<'EOF'
import importlib.util, sys, torch
from moe_rl.learner.mcore_compat import check_megatron_core_version
try:
    v = ".".join(map(str, check_megatron_core_version()))
except Exception as exc:  # one line, no traceback: the version check names the supported range
    print(str(exc).splitlines()[0])
    sys.exit(1)
te = "absent"
if importlib.util.find_spec("transformer_engine") is not None:
    from importlib import metadata
    try:
        te = metadata.version("transformer-engine")
    except metadata.PackageNotFoundError:
        te = "present"
print(f"gpu={torch.cuda.get_device_name(0)!r} torch={torch.__version__} cuda={torch.version.cuda} "
      f"megatron_core={v} te={te} gpus={torch.cuda.device_count()}")
EOF
) || { echo "gpu_check: ${versions:-version check failed; see $OUT/versions.err}"; exit 2; }

cd "$REPO"
echo "gpu_check: $versions"
echo "gpu_check: running the GPU-capable suite (log: $OUT/pytest.log)"
read -r -a SUITE <<<"${GPU_CHECK_TESTS:-tests/learner tests/replay tests/train tests/algo tests/distributed}"
"$PY" -m pytest -q -p no:cacheprovider -m "not sglang" -rfEs --timeout 600 "${SUITE[@]}" >"$OUT/pytest.log" 2>&1
tests_rc=$?
tests_line=$(grep -E "^=+ .*(passed|failed|error).* =+$|^[0-9]+ (passed|failed|error|skipped|deselected)" \
  "$OUT/pytest.log" | tail -1)

bench_rc=0
bench_line="skipped (--quick)"
if [ "$QUICK" = 0 ]; then
  fp8=""
  "$PY" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('transformer_engine') else 1)" \
    2>/dev/null && fp8="--fp8"
  echo "gpu_check: running bench/bench_gpu.py $fp8 (log: $OUT/bench.log)"
  "$PY" bench/bench_gpu.py $fp8 >"$OUT/bench.log" 2>&1
  bench_rc=$?
  bench_line=$(tail -1 "$OUT/bench.log")
fi

{
  echo "== gpu_check summary"
  echo "$versions"
  echo "tests (${SUITE[*]}, not sglang): ${tests_line:-no pytest summary; see $OUT/pytest.log} [rc=$tests_rc]"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | sed 's/^/  /' | head -40
  echo "bench: $bench_line [rc=$bench_rc]"
} | tee "$OUT/summary.txt"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ] && exit 0
exit 1
