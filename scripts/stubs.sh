#!/usr/bin/env bash
# Regenerates python/cascade/_cascade.pyi, the type stubs of the extension module, with nanobind's stubgen
# from a built module (default: build/python, built by scripts/test.sh), and the package's py.typed marker.
# The stubs are committed (generating them at build time would import the module while it is being built,
# which cross and sanitizer builds cannot do); python/tests/test_stubs.py fails when they drift from the
# module; python/stubs.pat adds what stubgen leaves out. Usage: bash scripts/stubs.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
python=${PYTHON:-$build/venv/bin/python}
PYTHONPATH="$build/python" "$python" -m nanobind.stubgen -q -m cascade._cascade -p python/stubs.pat \
  -o python/cascade/_cascade.pyi
touch python/cascade/py.typed
echo "python/cascade/_cascade.pyi: regenerated from $build/python"
