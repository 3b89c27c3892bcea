# Shared by scripts/test.sh, scripts/bench.sh and .ci/run (sourced, not run): package installation
# and the CMake configure + build steps.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
JOBS=${JOBS:-$(nproc)}
# NVIDIA's standard install puts nvcc in /usr/local/cuda/bin, often not on PATH.
if [[ -d /usr/local/cuda/bin ]]; then export PATH=$PATH:/usr/local/cuda/bin; fi

# Installs, with apt-get, the Debian packages of the given kinds that are missing. Kinds: build
# (cmake, g++, make), cli (CLI11, nlohmann-json), tests (googletest), python (python3 with venv and
# headers, for the torch extension), format (clang-format), clang (clang++ and OpenMP's header for
# it: scripts/clang_check.py).
ensure_packages() {
  local missing=()
  local kind
  for kind in "$@"; do
    case "$kind" in
      build)
        command -v cmake >/dev/null 2>&1 || missing+=(cmake)
        command -v g++ >/dev/null 2>&1 || missing+=(g++)
        command -v make >/dev/null 2>&1 || missing+=(make)
        ;;
      cli)
        [[ -f /usr/include/CLI/CLI.hpp || -f $ROOT/.deps/include/CLI/CLI.hpp ]] ||
          missing+=(libcli11-dev)
        [[ -f /usr/include/nlohmann/json.hpp || -f $ROOT/.deps/include/nlohmann/json.hpp ]] ||
          missing+=(nlohmann-json3-dev)
        ;;
      tests)
        [[ -f /usr/include/gtest/gtest.h ]] || missing+=(libgtest-dev)
        [[ -f /usr/src/googletest/CMakeLists.txt || -f $ROOT/.deps/googletest/CMakeLists.txt ]] ||
          missing+=(googletest)
        ;;
      python)
        command -v python3 >/dev/null 2>&1 || missing+=(python3)
        python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
        python3 -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
          >/dev/null 2>&1 || missing+=(python3-dev)
        ;;
      format)
        command -v clang-format >/dev/null 2>&1 || missing+=(clang-format)
        ;;
      clang)
        command -v python3 >/dev/null 2>&1 || missing+=(python3)  # scripts/clang_check.py
        command -v clang++ >/dev/null 2>&1 || missing+=(clang)
        echo '#include <omp.h>' | clang++ -fopenmp -fsyntax-only -x c++ - >/dev/null 2>&1 ||
          missing+=(libomp-dev)
        ;;
    esac
  done
  ((${#missing[@]} == 0)) && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: missing ${missing[*]} and no apt-get to install them" >&2
    exit 1
  fi
  if [[ $(id -u) != 0 ]]; then
    echo "error: missing ${missing[*]}; run as root (apt-get install) or install them first" >&2
    exit 1
  fi
  echo "== installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# configure_and_build BUILD_DIR TARGET [cmake args...]: Release unless the args say otherwise.
configure_and_build() {
  local build_dir=$1 target=$2
  shift 2
  echo "== configuring $build_dir"
  cmake -S "$ROOT" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "$@"
  echo "== building $target in $build_dir (-j$JOBS)"
  cmake --build "$build_dir" --target "$target" -j"$JOBS"
}

# -DMLAKV_CUDA=ON when a GPU is visible and nvcc is present, else OFF: a CPU-only machine with the
# CUDA toolkit (CI) does not spend its time compiling kernels it cannot run. Callers that pass
# -DMLAKV_CUDA themselves win (it comes later on the command line).
cuda_flag() {
  if command -v nvcc >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "-DMLAKV_CUDA=ON"
  else
    echo "-DMLAKV_CUDA=OFF"
  fi
}
