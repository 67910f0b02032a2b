#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included): a separate build in
# build-asan, every finding fatal (-fno-sanitize-recover=all). Extra arguments go to ctest. The fuzz targets run
# here too (CASCADE_FUZZ_REPLAY, fuzz/replay.cmake): every seed, then random mutations of them for a few seconds.
#   scripts/sanitize.sh            what CI runs (.ci/run): the fuzz targets, and the suites of the core library
#                                  (ctest label test_attention) and of the model runtime below the tools (test_model:
#                                  the GGUF reader, tokenizers, linear layers, forward passes, K/V cache, sampler,
#                                  chat templates, the fuzzers' regressions)
#   scripts/sanitize.sh --all      every suite: also the server's (engine, API, HTTP through cascade-server) and the
#                                  runtime's tools end to end (test_runtime), run at each stop rather than in CI
#   CASCADE_SANITIZE_CXX=clang++ ... another compiler (default g++; clang 14 cannot build the tests: it lacks
#                                  C++20 lambda captures of structured bindings)
# CI's part (179 cases) took 423 s from a fresh clone on a Zen 3, building 330 s and testing 90 s; --all 637 s
# (370 s and 267 s, 240 cases). .ci/run has no room for the difference.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
if [[ "${1:-}" == --all ]]; then
  all=1
  shift
fi
bash scripts/setup.sh

start=$SECONDS
cxx=${CASCADE_SANITIZE_CXX:-g++}
# UBSan without its null and pointer-overflow checks: under ASan a null dereference already stops with a report
# and a stack, and an overflowed pointer that is read or written is out of its object's bounds. Those two checks
# instrument nearly every pointer use, and cost a fifth of each unit's compile time (test_attention_plan.cpp: 27 s
# against 31 s with them; generate.cpp: 23 s against 30). Alignment, signed overflow, shifts, bounds, float
# casts, enums and bools, and the rest stay.
#
# ASan without its use-after-scope checks (-fno-sanitize-address-use-after-scope): they poison and unpoison every
# local whose address is taken at the start and end of its scope, which doctest's checks and the kernels' register
# tiles do in nearly every block; the test_model group's unit took 131 s with them and 74 s without, linear_avx512.cpp
# 54 s and 27 s. Reads and writes out of bounds (heap, stack and globals), use after free, double frees and leaks
# are all still caught; what is not is a local used after its block ends while its frame lives on.
san="-fsanitize=address,undefined -fno-sanitize=null,pointer-overflow -fno-sanitize-address-use-after-scope"
san+=" -fno-sanitize-recover=all -fno-omit-frame-pointer"
# -O1: fast enough for the real-model tests, and keeps the stack traces readable. -g1: functions and line tables,
# all a sanitizer's report shows, in less build time than full debug info. CASCADE_KERNELS_ANY_HEAD_DIM: the
# attention kernels compiled for any head dim only (the head dims 64 and 128 compiled on their own are the same
# templates with a constant; the Release suite runs them): the avx2 kernels' unit in 38 s of CPU instead of 62.
cmake -S . -B build-asan $(bash scripts/generator.sh build-asan) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_CXX_FLAGS_DEBUG="" -DCMAKE_CXX_FLAGS="-O1 -g1 $san" -DCMAKE_EXE_LINKER_FLAGS="$san" \
  -DCASCADE_BUILD_BENCH=OFF -DCASCADE_CUDA=OFF -DCASCADE_FUZZ_REPLAY=ON -DCASCADE_KERNELS_ANY_HEAD_DIM=ON >/dev/null
if ((all)); then
  cmake --build build-asan -j2
else
  # The two tools test_model runs (cascade-generate's -c and RoPE factors, cascade-tokenize's output and errors).
  cmake --build build-asan -j2 --target test_attention test_model fuzz_seeds_writer \
    fuzz_replay_{gguf,tokenizer,plan,model,request} cascade-generate cascade-tokenize
fi

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Excluded, all still run by scripts/test.sh:
#  - consumer_find_package builds the README example in an outside project with the default compiler and no
#    sanitizer: nothing of ours runs instrumented there.
#  - "generate: greedy continuations are identical ..." decodes the real model four times over on its f32 path:
#    ~300 s under ASan (one at a time), more than the rest of the suite together. The other generate: tests still run the real model (prefill,
#    decode, sampling, chat) under the sanitizers.
#  - "server_http: shared_prompt" prefills a 1,000-token prompt and serves 16 clients: past its 2-minute waits under
#    ASan. The other server_http: cases run the instrumented server (streams, disconnects, shutdown, bad input).
#  - "server engine: greedy texts equal generate()'s ..." and "server engine: a seeded request writes the same
#    text ..." compare whole texts token for token over several runs of the real model: 143 s and 105 s under
#    ASan. The other server engine: cases (cached prefixes, cancellation, eviction under a budget,
#    stop strings, the queue, draining) run the instrumented engine.
excluded='consumer_find_package|generate: greedy continuations are identical|server_http: shared_prompt'
#  - "generate: a sequence samples the same text whatever the method ... (f32 path)" and "generate: a prefill in
#    small chunks gives the same text as one pass (f32 path)" decode the real model on its f32 path several times
#    for a token-for-token comparison: 26 s and 22 s under ASan. The instrumented runtime still samples, prefills
#    in chunks and decodes with every method in the other generate: and server engine: cases.
excluded+='|generate: a sequence samples the same text whatever the method.*f32 path'
excluded+='|generate: a prefill in small chunks gives the same text as one pass .f32 path.'
excluded+='|server engine: greedy texts equal|server engine: a seeded request writes the same text'
#  - "server_http: max_tokens" asks the instrumented server for a 1,024-token chat (58 s under ASan), and "server
#    engine: under a small K/V budget ..." decodes six prompts twice per K/V type (42 s): the other server_http: and
#    server engine: cases run the same code paths instrumented.
excluded+='|server_http: max_tokens|server engine: under a small K/V budget'
#  - Four cases of 23-56 s each under ASan, each the longest of its suite, whose code runs instrumented in a
#    lighter case: "llama: q8_0 cache against the reference ... on each products path" (test_attention runs q8_0
#    K/V on every products path against the reference); "linear: a row's output is the same bits alone ..."
#    (linear: every path, every type ... runs every tile path and tier); "profile cache: cascade-generate
#    calibrates once ..." and "profile cache: cascade-generate with an unusable cache folder ..." (four runs of
#    the tool, each calibrating: the other profile cache: cases calibrate, write and read profiles, and refuse
#    unusable folders, in-process).
excluded+='|llama: q8_0 cache against the reference'
excluded+="|linear: a row's output is the same bits alone|profile cache: cascade-generate calibrates once"
excluded+='|profile cache: cascade-generate with an unusable cache folder'
#  - "terminal: on a terminal, stderr shows ..." and "terminal: with -np 1 on a terminal ..." run cascade-generate
#    on a pseudo-terminal to check what it writes where (14 s and 8 s), and "generate: -t above the hardware
#    threads ..." runs it for its note (12 s): the instrumented tool runs in the other generate: cases, and the
#    terminal code in the other terminal: cases.
excluded+='|terminal: on a terminal, stderr shows|terminal: with -np 1 on a terminal|generate: -t above the hardware'
#  - "generate: on the default path a prompt's tokens are the same alone or beside others ..." decodes the real model
#    token for token under every method, -np and -b (96 s under ASan, a third of the stage's tests): the batch-
#    invariant attention it relies on runs instrumented in test_attention_invariance, the runtime in the other
#    generate: cases.
excluded+="|generate: on the default path a prompt's tokens are the same"
#  - "server_http: openai", "server_http: logprobs" and "server_http: penalties" drive the instrumented server with
#    the official client through completions, chats, streams, log-probabilities and penalties (42 s, 30 s and 24 s
#    under ASan): the same requests run instrumented in-process in the server api: and server engine: cases, and
#    the HTTP layer in the other server_http: cases (bad input, auth, overload, disconnects, shutdown, exhaustion).
excluded+='|server_http: openai|server_http: logprobs|server_http: penalties'
labels=()
((all)) || labels=(-L '^(test_attention|test_model|fuzz_replay)$')
ctest --test-dir build-asan --output-on-failure --timeout 600 -j2 "${labels[@]}" -E "^($excluded)" "$@"
echo "sanitize: passed in $((SECONDS - start)) s"
