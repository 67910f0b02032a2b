#!/usr/bin/env bash
# Installs what the tests need, builds everything (the Python module included) and runs the suite through
# ctest: the doctest suites and the Python module's pytest suites.
#
# The Python side runs in a virtual environment, build/venv, holding what the module builds with (nanobind,
# scikit-build-core) and what its tests need (NumPy, pytest); PyTorch's tests run where PyTorch is installed
# there (build/venv/bin/pip install torch), and skip otherwise. The venv imports the module built here
# (build/python, through a .pth file in its site-packages), so `build/venv/bin/python -c "import cascade"` works
# without PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=build/venv
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements-test.txt
cmake -S . -B build $(bash scripts/generator.sh build) -DCMAKE_BUILD_TYPE=Release -DCASCADE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PWD/$venv/bin/python" >/dev/null
cmake --build build -j2
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/build/python" >"$site/cascade-build.pth"
env -u PYTHONPATH "$venv/bin/python" -c 'import cascade' || { echo "build/venv cannot import cascade" >&2; exit 1; }
ctest --test-dir build --output-on-failure --timeout 900 -j2 "$@"
