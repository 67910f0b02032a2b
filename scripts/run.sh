#!/usr/bin/env bash
# The main job: installs what is needed, fetches the default model, builds, and generates several
# continuations of one prompt with cascade attention (extra arguments go to cascade-generate).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build $(bash scripts/generator.sh build) -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 --target cascade-generate
exec build/tools/cascade-generate -m models/SmolLM2-135M-Instruct.Q4_1.gguf -np 4 -n 64 --stats-every 16 "$@"
