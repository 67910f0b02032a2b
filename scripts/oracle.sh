#!/usr/bin/env bash
# Regenerates the oracle tests' data (tests/data/oracle): the tiny random models of every architecture the
# runtime runs, and the logits llama.cpp computes for their prompts.
#
#   scripts/oracle.sh [BUILD_DIR]        (default: build, a configured CMake build folder of this repository)
#
# 1. llama.cpp from the llama-cpp-python 0.3.36 source distribution, built by bench/llama-cpp.sh (CPU only;
#    $CASCADE_LLAMA_CPP_CACHE / $CASCADE_LLAMA_CPP_SRC as there), and tests/oracle/oracle-logits.cpp against it;
# 2. make-oracle-models (tests/oracle) writes the models and cases.txt into tests/data/oracle;
# 3. oracle-logits writes NAME.logits for every case (n_tokens x n_vocab float32, little-endian), one thread;
# 4. VERSION records the llama.cpp commit the sdist vendors, the machine's CPU and the date.
# tests/test_oracle.cpp compares cascade's logits with these. Any failure: one line `oracle.sh: ...` and exit 1.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$root/build}" 2>/dev/null && pwd)" || { echo "oracle.sh: no build folder ${1:-build}" >&2; exit 1; }
data="$root/tests/data/oracle"
die() { echo "oracle.sh: $*" >&2; exit 1; }
[ -f "$build/CMakeCache.txt" ] || die "$build is not a configured CMake build folder"

client="$(bash "$root/bench/llama-cpp.sh" --build-only)" || die "building llama.cpp failed"
lbuild="$(dirname "$client")"
cache="${CASCADE_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cascade-llama-cpp}"
src="${CASCADE_LLAMA_CPP_SRC:-$cache/llama_cpp_python-0.3.36/vendor/llama.cpp}"
oracle="$lbuild/oracle-logits"
if [ ! -x "$oracle" ] || [ "$root/tests/oracle/oracle-logits.cpp" -nt "$oracle" ]; then
  c++ -O2 -std=c++17 "$root/tests/oracle/oracle-logits.cpp" -I"$src/include" -I"$src/ggml/include" -L"$lbuild/bin" \
    -lllama -lggml -lggml-base -Wl,-rpath,"$lbuild/bin" -o "$oracle" > "$lbuild/oracle-logits.log" 2>&1 ||
    die "building oracle-logits failed (see $lbuild/oracle-logits.log)"
fi

cmake --build "$build" -j2 --target make-oracle-models > "$build/make-oracle-models.log" 2>&1 ||
  die "building make-oracle-models failed (see $build/make-oracle-models.log)"
rm -f "$data"/*.gguf "$data"/*.logits "$data/cases.txt"
mkdir -p "$data"
"$build/tests/make-oracle-models" "$data" > /dev/null || die "make-oracle-models failed"

n=0
while read -r name file mode tokens; do
  case "$name" in "#"* | "") continue ;; esac
  # shellcheck disable=SC2086  # the token ids are separate arguments
  "$oracle" -m "$data/$file" -o "$data/$name.logits" --mode "$mode" -t 1 $tokens ||
    die "llama.cpp failed on case $name ($file)"
  n=$((n + 1))
done < "$data/cases.txt"

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
  echo "machine: ${cpu:-unknown}; date: $(date -u +%Y-%m-%d)"
} > "$data/VERSION"
echo "oracle.sh: $n cases in $data ($(du -sh "$data" | cut -f1)); llama.cpp $commit"
