#!/usr/bin/env bash
# The PyTorch-level benchmark (python -m mlakv.bench): the fused op vs the unfused primitives vs
# torch.compile of the plain PyTorch step vs a copy of the same bytes, as a table and a PNG plot.
# Builds and installs the package the way scripts/test_python.sh does, without running the tests.
#
#   scripts/bench_python.sh [mlakv.bench options...]   e.g. --cache-format fp8_e4m3 --tokens 1,64
#
# Environment: as scripts/test_python.sh (MLAKV_VENV, MLAKV_PY_SYSTEM, MLAKV_PY_CUDA); OUT_DIR
# (default build-python/bench) receives mlakv_bench.png and mlakv_bench.json.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Relative MLAKV_VENV and OUT_DIR are the caller's (the script changes directory below).
if [[ -n ${MLAKV_VENV:-} ]]; then MLAKV_VENV=$(realpath -m "$MLAKV_VENV"); fi
OUT_DIR=$(realpath -m "${OUT_DIR:-$ROOT/build-python/bench}")
MLAKV_PY_INSTALL_ONLY=1 bash "$ROOT/scripts/test_python.sh"
if [[ "${MLAKV_PY_SYSTEM:-0}" == 1 ]]; then
  PY=$(command -v python3)
else
  PY=${MLAKV_VENV:-$ROOT/.venv-torch}/bin/python
fi
mkdir -p "$OUT_DIR"
cd "$OUT_DIR"
exec "$PY" -m mlakv.bench --plot "$OUT_DIR/mlakv_bench.png" --json "$OUT_DIR/mlakv_bench.json" "$@"
