#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang, ASan + UBSan) in build-fuzz and runs each for a while:
#   scripts/fuzz.sh [SECONDS_PER_TARGET]     (default 60)
# Seeds are written fresh from valid inputs (fuzz_seeds); what the fuzzers find worth keeping accumulates in
# build-fuzz/corpus/TARGET across runs. Prints per target the executions run and the crashes found, and exits
# non-zero on any crash, keeping the crashing input in build-fuzz/crashes/ (replay: build-fuzz/fuzz/fuzz_TARGET FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
[[ "$secs" =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET]" >&2; exit 2; }
bash scripts/setup.sh --no-model

start=$SECONDS
cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCASCADE_FUZZ=ON \
  -DCASCADE_BUILD_TESTS=OFF -DCASCADE_BUILD_TOOLS=OFF -DCASCADE_BUILD_BENCH=OFF -DCASCADE_CUDA=OFF >/dev/null
targets=(gguf tokenizer plan)
cmake --build build-fuzz -j2 --target fuzz_seeds "${targets[@]/#/fuzz_}"
build_s=$((SECONDS - start))

out=build-fuzz
rm -rf "$out/seeds"
"$out/fuzz/fuzz_seeds" "$out/seeds"
mkdir -p "$out/crashes" "$out/logs"

failed=0
summary=()
for t in "${targets[@]}"; do
  mkdir -p "$out/corpus/$t"
  dict=()
  [[ -f fuzz/$t.dict ]] && dict=(-dict="fuzz/$t.dict")
  log="$out/logs/$t.log"
  before=$(find "$out/crashes" -name "$t-*" | wc -l)
  t0=$SECONDS
  rc=0
  # -timeout: one input running longer than that counts as a crash; -rss_limit_mb: so does using more memory.
  "$out/fuzz/fuzz_$t" "$out/corpus/$t" "$out/seeds/$t" "${dict[@]}" -max_total_time="$secs" -timeout=30 \
    -rss_limit_mb=2560 -print_final_stats=1 -artifact_prefix="$out/crashes/$t-" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  crashes=$(($(find "$out/crashes" -name "$t-*" | wc -l) - before))
  if ((rc != 0 && crashes == 0)); then crashes=1; fi  # died without writing an input (e.g. in its setup)
  summary+=("$(printf '%-16s %12s %8d %6ds' "fuzz_$t" "${execs:-?}" "$crashes" $((SECONDS - t0)))")
  if ((crashes > 0)); then
    failed=1
    echo "fuzz: fuzz_$t failed (exit $rc); the end of $log:" >&2
    grep -v -e '^#' -e 'NEW_FUNC' "$log" | tail -25 >&2
    find "$out/crashes" -name "$t-*" -newer "$out/seeds" | sed 's/^/fuzz: crashing input kept: /' >&2
  fi
done

printf '%-16s %12s %8s %7s\n' target executions crashes time
printf '%s\n' "${summary[@]}"
echo "fuzz: build ${build_s} s, total $((SECONDS - start)) s"
exit $failed
