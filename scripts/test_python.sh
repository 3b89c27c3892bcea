#!/usr/bin/env bash
# The Python suite of the torch binding (tests/python): makes a venv with the pinned torch, builds
# and installs the package with pip (scikit-build-core driving the project's CMake), runs pytest.
#
#   scripts/test_python.sh [pytest args...]
#
# Environment:
#   MLAKV_VENV        venv folder (default .venv-torch in the repository root)
#   MLAKV_PY_SYSTEM=1 use the current python3 as it is (no venv, no installs): the GPU machine,
#                     whose python3 already holds torch and cannot reach a package registry
#   MLAKV_PY_CUDA=0|1 build the CUDA backend (default: 1 when nvidia-smi sees a GPU, else 0)
#   MLAKV_PY_INSTALL_ONLY=1  build and install, run no test (scripts/bench_python.sh)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_VERSION=2.11.0
# A relative MLAKV_VENV is the caller's (the script changes directory below).
if [[ -n ${MLAKV_VENV:-} ]]; then MLAKV_VENV=$(realpath -m "$MLAKV_VENV"); fi
cd "$ROOT"

# The PyPI torch wheel is a CUDA build: its CMake config (find_package(Torch) in torch/) stops
# when it finds no CUDA toolkit, even for a CPU-only extension. Without nvcc the suite cannot be
# built here: say so and skip it (before downloading torch).
if [[ "${MLAKV_PY_SYSTEM:-0}" != 1 ]] && ! command -v nvcc >/dev/null 2>&1 &&
  [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "== Python suite SKIPPED: no CUDA toolkit (nvcc) on this machine, and the PyPI torch wheel's"
  echo "   CMake config needs one to build the extension (install the CUDA toolkit to run it)"
  exit 0
fi

if [[ "${MLAKV_PY_SYSTEM:-0}" == 1 ]]; then
  PY=$(command -v python3)
else
  VENV=${MLAKV_VENV:-$ROOT/.venv-torch}
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "== creating $VENV"
    python3 -m venv "$VENV"
  fi
  PY=$VENV/bin/python
  start=$(date +%s)
  # The PyPI wheel of torch is the CUDA 13 build (it pulls the nvidia-* runtime wheels: ~3 GB to
  # download, ~5 GB installed, about a minute here); it runs on machines without a GPU. A venv
  # without it needs that room: say so before pip fails half way with ENOSPC. No pip cache: it
  # would keep another copy of the downloads.
  if ! "$PY" -m pip show -q torch >/dev/null 2>&1; then
    need_gb=9
    for dir in "$VENV" "${TMPDIR:-/tmp}"; do
      free_gb=$(df -P -BG "$dir" | awk 'NR == 2 { sub("G", "", $4); print $4 }')
      if ((free_gb < need_gb)); then
        echo "== Python suite: $free_gb GB free under $dir; installing torch $TORCH_VERSION" \
          "needs about $need_gb GB there (free some space, or set MLAKV_VENV / TMPDIR)" >&2
        exit 1
      fi
    done
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir "torch==$TORCH_VERSION" \
    numpy pytest "scikit-build-core>=0.10" ninja cmake
  echo "== python packages ready in $(( $(date +%s) - start )) s"
fi
export PATH="$(dirname "$PY"):$PATH"

if [[ -z "${MLAKV_PY_CUDA:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    MLAKV_PY_CUDA=1
  else
    MLAKV_PY_CUDA=0
  fi
fi
if [[ "$MLAKV_PY_CUDA" == 1 ]]; then cuda=ON; else cuda=OFF; fi

start=$(date +%s)
echo "== building and installing mlakv (CUDA backend: $cuda)"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
  -C "cmake.define.MLAKV_CUDA=$cuda" -C "build-dir=build-python/cuda-$cuda" .
echo "== mlakv built and installed in $(( $(date +%s) - start )) s"

if [[ "${MLAKV_PY_INSTALL_ONLY:-0}" == 1 ]]; then
  exit 0
fi

# Run from a folder outside the source tree, so that `import mlakv` takes the installed package.
cd "$ROOT/tests/python"
exec "$PY" -m pytest -q -p no:cacheprovider "$@" .
