#!/usr/bin/env bash
# Builds the mlakv command-line tool (Release) and runs `mlakv bench`: DeepSeek-V3 shapes, every
# workload checked for correctness and then timed (fused op, unfused primitives, a copy of the same
# bytes) on the best backend present (CUDA when built and a GPU is visible, else CPU). Installs
# cmake, g++ and the Debian dev packages when missing.
#
#   bash scripts/bench.sh [mlakv bench options...]   e.g. --workload decode_bf16 --tokens 1,128
#
# Environment: BUILD_DIR (default build-bench), JOBS (default nproc), CMAKE_ARGS (extra cmake
# arguments, e.g. "-DMLAKV_CUDA=OFF").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

BUILD_DIR=${BUILD_DIR:-$ROOT/build-bench}
ensure_packages build cli
read -ra cmake_args <<<"${CMAKE_ARGS:-}"  # split on spaces, no glob expansion
configure_and_build "$BUILD_DIR" mlakv_cli "$(cuda_flag)" -DMLAKV_TESTS=OFF "${cmake_args[@]}"
"$BUILD_DIR/mlakv" info
echo
exec "$BUILD_DIR/mlakv" bench "$@"
