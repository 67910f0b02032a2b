#!/usr/bin/env bash
# Regenerates the real-model greedy test's data (tests/data/gemma3): llama.cpp's token ids, greedy continuation and
# top-2 logit margins for the prompts in prompts.txt, on Gemma 3 270M (Q4_K_M).
#
#   scripts/greedy-oracle.sh
#
# 1. llama.cpp from the llama-cpp-python 0.3.36 source distribution, built by bench/llama-cpp.sh (CPU only;
#    $CASCADE_LLAMA_CPP_CACHE / $CASCADE_LLAMA_CPP_SRC as there), and tests/oracle/oracle-greedy.cpp against it;
# 2. oracle-greedy writes gemma-3-270m-q4_k_m.greedy (its header says how), 32 tokens per prompt, two threads;
# 3. VERSION records the llama.cpp commit the sdist vendors, the machine's CPU and the date.
# The model is models/gemma-3-270m-q4_k_m.gguf (scripts/setup.sh --models). tests/test_gemma3.cpp compares
# cascade's continuations with these. Any failure: one line `greedy-oracle.sh: ...` and exit 1.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
data="$root/tests/data/gemma3"
model="$root/models/gemma-3-270m-q4_k_m.gguf"
die() { echo "greedy-oracle.sh: $*" >&2; exit 1; }
[ -f "$model" ] || die "$model is missing (bash scripts/setup.sh --models fetches it)"

client="$(bash "$root/bench/llama-cpp.sh" --build-only)" || die "building llama.cpp failed"
lbuild="$(dirname "$client")"
cache="${CASCADE_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cascade-llama-cpp}"
src="${CASCADE_LLAMA_CPP_SRC:-$cache/llama_cpp_python-0.3.36/vendor/llama.cpp}"
oracle="$lbuild/oracle-greedy"
if [ ! -x "$oracle" ] || [ "$root/tests/oracle/oracle-greedy.cpp" -nt "$oracle" ]; then
  c++ -O2 -std=c++17 "$root/tests/oracle/oracle-greedy.cpp" -I"$src/include" -I"$src/ggml/include" -L"$lbuild/bin" \
    -lllama -lggml -lggml-base -Wl,-rpath,"$lbuild/bin" -o "$oracle" > "$lbuild/oracle-greedy.log" 2>&1 ||
    die "building oracle-greedy failed (see $lbuild/oracle-greedy.log)"
fi

"$oracle" -m "$model" -f "$data/prompts.txt" -o "$data/gemma-3-270m-q4_k_m.greedy" -n 32 -t 2 ||
  die "llama.cpp failed on $model"

# The sdist keeps the vendored commit in its own git metadata; a source tree of llama.cpp in its checkout's.
head="$(dirname "$(dirname "$src")")/.git/modules/vendor/llama.cpp/HEAD"
if [ -f "$head" ]; then
  commit="$(cat "$head")"
else
  commit="$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)"
fi
cpu="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ *//')"
{
  echo "llama.cpp $commit (vendored by llama-cpp-python 0.3.36), CPU backend built by bench/llama-cpp.sh"
  echo "model: gemma-3-270m-q4_k_m.gguf, sha256 $(sha256sum "$model" | cut -d' ' -f1)"
  echo "machine: ${cpu:-unknown}; date: $(date -u +%Y-%m-%d)"
} > "$data/VERSION"
echo "greedy-oracle.sh: $(grep -c ' greedy ' "$data/gemma-3-270m-q4_k_m.greedy") prompts in $data; llama.cpp $commit"
