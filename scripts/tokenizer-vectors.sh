#!/usr/bin/env bash
# Writes the llama.cpp expectations of tests/data/tokenizer that llama.cpp does not ship (README.md there): the ids
# llama.cpp 0.3.36 gives for extra.inp with every vocabulary the tests use, and for gemma-3-270m-q4_k_m.gguf.inp
# with the Gemma 3 model. llama.cpp is built by bench/llama-cpp.sh (CPU only, from the llama-cpp-python 0.3.36
# source distribution); bench/llama-cpp-tokenize.cpp is compiled against it. The Gemma 3 file comes from
# `scripts/setup.sh --models`.
#
#   scripts/tokenizer-vectors.sh
#
# It first checks that the program reproduces the .out files llama.cpp ships for its own vocabularies.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
data="$root/tests/data/tokenizer"
die() { echo "tokenizer-vectors.sh: $*" >&2; exit 1; }

client=$(bash "$root/bench/llama-cpp.sh" --build-only) || die "building llama.cpp failed"
build=$(dirname "$client")
cache=$(dirname "$build")
src="${CASCADE_LLAMA_CPP_SRC:-$cache/llama_cpp_python-0.3.36/vendor/llama.cpp}"
tool="$build/llama-cpp-tokenize"
c++ -O2 -std=c++17 "$root/bench/llama-cpp-tokenize.cpp" -I"$src/include" -I"$src/ggml/include" -L"$build/bin" \
  -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$tool" || die "compiling llama-cpp-tokenize failed"

gemma="$root/models/gemma-3-270m-q4_k_m.gguf"
[ -s "$gemma" ] || die "$gemma is missing (scripts/setup.sh --models fetches it)"

# The vocabularies: those kept here, Llama 3's from llama.cpp's source (too large to keep), Gemma 3's model.
vocabs=("$data/ggml-vocab-gpt-2.gguf" "$data/ggml-vocab-llama-spm.gguf" "$data/ggml-vocab-qwen2.gguf"
        "$data/ggml-vocab-phi-3.gguf" "$src/models/ggml-vocab-llama-bpe.gguf")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in "${vocabs[@]}"; do
  "$tool" "$v" "$v.inp" "$tmp/check.out"
  cmp -s "$tmp/check.out" "$v.out" || die "llama-cpp-tokenize does not reproduce $v.out"
done
echo "tokenizer-vectors.sh: the program reproduces llama.cpp's ${#vocabs[@]} shipped .out files" >&2

for v in "${vocabs[@]}" "$gemma"; do
  name=$(basename "$v")
  "$tool" "$v" "$data/extra.inp" "$data/$name.extra.out"
  "$tool" "$v" "$data/extra.inp" "$data/$name.extra-special.out" --special
done
"$tool" "$gemma" "$data/gemma-3-270m-q4_k_m.gguf.inp" "$data/gemma-3-270m-q4_k_m.gguf.out"
echo "tokenizer-vectors.sh: wrote the .extra.out, .extra-special.out and Gemma 3 files in $data" >&2
