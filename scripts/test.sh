#!/usr/bin/env bash
# Builds mlakv (Release, warnings as errors) and runs the whole test suite: ctest, then the Python
# suite when tests/python exists. Installs cmake, g++ and the Debian dev packages when missing.
#
#   bash scripts/test.sh [extra cmake args...]
#
# Environment: BUILD_DIR (default build), JOBS (default nproc), CTEST_JOBS (default 2),
# MLAKV_SKIP_PYTHON=1 to skip the Python suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

BUILD_DIR=${BUILD_DIR:-$ROOT/build}
ensure_packages build cli tests
configure_and_build "$BUILD_DIR" all "$(cuda_flag)" -DMLAKV_WERROR=ON "$@"
echo "== ctest"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"${CTEST_JOBS:-2}"

if [[ -d tests/python && "${MLAKV_SKIP_PYTHON:-0}" != 1 ]]; then
  if [[ -f scripts/test_python.sh ]]; then
    echo "== Python suite (scripts/test_python.sh)"
    [[ "${MLAKV_PY_SYSTEM:-0}" == 1 ]] || ensure_packages python
    bash scripts/test_python.sh
  else
    echo "== tests/python exists but scripts/test_python.sh does not: Python suite not run"
  fi
fi
echo "== all tests passed"
