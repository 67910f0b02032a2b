#!/usr/bin/env bash
# Prints the CMake generator argument for a build folder the scripts configure (build, build-asan, build-tsan):
# `-G Ninja` where Ninja is installed (scripts/setup.sh installs it); nothing where the folder was configured before
# with another generator (CMake refuses to reuse a cache under a new one) or Ninja is missing. Ninja builds the
# targets asked for together in parallel, where make builds one after another, each ending with units on one core
# alone.
#   cmake -S . -B DIR $(bash scripts/generator.sh DIR) ...
set -euo pipefail
dir=${1:?usage: scripts/generator.sh BUILD_DIR}
previous=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$dir/CMakeCache.txt" 2>/dev/null || true)
if [[ -z "$previous" || "$previous" == Ninja ]] && command -v ninja >/dev/null 2>&1; then
  echo "-G Ninja"
fi
