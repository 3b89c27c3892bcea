#!/usr/bin/env bash
# Copies the build dependencies that the GPU machine lacks (it has no package manager) into .deps/
# (git-ignored), from this machine's Debian packages: CLI11 and nlohmann-json headers into
# .deps/include, the googletest sources into .deps/googletest. CMake looks there when the system
# has none (MLAKV_DEPS_DIR, default <repo>/.deps). Carry .deps to the GPU machine.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEPS=${MLAKV_DEPS_DIR:-$ROOT/.deps}

for src in /usr/include/CLI /usr/include/nlohmann /usr/src/googletest; do
  if [[ ! -d $src ]]; then
    echo "error: $src missing: apt-get install libcli11-dev nlohmann-json3-dev googletest" >&2
    exit 1
  fi
done
rm -rf "$DEPS/include/CLI" "$DEPS/include/nlohmann" "$DEPS/googletest"
mkdir -p "$DEPS/include"
cp -rL /usr/include/CLI /usr/include/nlohmann "$DEPS/include/"
cp -rL /usr/src/googletest "$DEPS/googletest"
echo "vendored into $DEPS ($(du -sh "$DEPS" | cut -f1)):"
ls "$DEPS" "$DEPS/include"
