#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang, ASan + UBSan) in build-fuzz and runs them.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]
#       Every target for that long (default 60). What the fuzzers find worth keeping accumulates in
#       build-fuzz/corpus/TARGET across runs. The attention kernels are built without ASan and UBSan here (about
#       half of the build time; scripts/sanitize.sh runs them instrumented), with them for a campaign.
#   scripts/fuzz.sh --campaign [--runs N] [--time SECONDS] [--corpus DIR] [--instance K] [TARGET...]
#       A campaign: each TARGET (default: all) until N executions (default 1000000) or SECONDS (default: no
#       limit), whichever comes first, one target after another. The corpus is kept in DIR/TARGET (default
#       build-fuzz/campaign; any folder outside git) and grows from run to run; each run adds one line to
#       DIR/TARGET.runs (date, commit, executions, coverage, features, corpus, crashes, seconds), and the summary
#       shows this run and the total of all runs in DIR. Campaigns take hours of CPU: run them under nice -n 19.
#       SIGINT to the fuzzer process (not to this script) ends its run early, and the run counts what it executed.
#       --instance K: another campaign of the same targets side by side (one per core), with its own log
#       (build-fuzz/logs/TARGET.K.log); the two share DIR, each taking up what the other adds to the corpus.
#
# Seeds are written fresh from valid inputs (fuzz_seeds) every time. Printed per target: executions, coverage
# (cov: edges of the instrumented code reached by the corpus, as libFuzzer counts them; ft: its finer features),
# corpus size, crashes. Exits non-zero on any crash, keeping the crashing input in build-fuzz/crashes/ (replay:
# build-fuzz/fuzz/fuzz_TARGET FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
all_targets=(gguf tokenizer plan model request)
usage() {
  echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET]" >&2
  echo "       scripts/fuzz.sh --campaign [--runs N] [--time SECONDS] [--corpus DIR] [--instance K] [TARGET...]" >&2
  echo "       targets: ${all_targets[*]}" >&2
  exit 2
}

campaign=0
secs=60
runs=-1
corpus_root=build-fuzz/corpus
instance=
targets=()
if [[ "${1:-}" == "--campaign" ]]; then
  campaign=1
  shift
  secs=0
  runs=1000000
  corpus_root=build-fuzz/campaign
  while (($#)); do
    case "$1" in
      --runs) [[ "${2:-}" =~ ^[0-9]+$ ]] || usage; runs=$2; shift 2 ;;
      --time) [[ "${2:-}" =~ ^[0-9]+$ ]] || usage; secs=$2; shift 2 ;;
      --corpus) [[ -n "${2:-}" ]] || usage; corpus_root=$2; shift 2 ;;
      --instance) [[ "${2:-}" =~ ^[0-9A-Za-z_-]+$ ]] || usage; instance=.$2; shift 2 ;;
      -*) usage ;;
      *)
        [[ " ${all_targets[*]} " == *" $1 "* ]] || { echo "fuzz: unknown target '$1'" >&2; usage; }
        targets+=("$1")
        shift
        ;;
    esac
  done
elif (($#)); then
  [[ "$1" =~ ^[0-9]+$ && $# -eq 1 ]] || usage
  secs=$1
fi
((${#targets[@]})) || targets=("${all_targets[@]}")
bash scripts/setup.sh --no-model --fuzz

start=$SECONDS
# Campaigns of different targets may run side by side (one per core) on this one build: its build and the seeds are
# made under a lock.
mkdir -p build-fuzz
exec 9>build-fuzz/.lock
flock 9
# Line tables only: a crash's stack trace names files and lines, at a fraction of full debug info's build time.
sanitize_kernels=OFF
((campaign)) && sanitize_kernels=ON
cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCASCADE_FUZZ=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" -DCASCADE_FUZZ_SANITIZE_KERNELS=$sanitize_kernels \
  -DCASCADE_BUILD_TESTS=OFF -DCASCADE_BUILD_TOOLS=OFF -DCASCADE_BUILD_BENCH=OFF -DCASCADE_CUDA=OFF >/dev/null
cmake --build build-fuzz -j2 --target fuzz_seeds "${targets[@]/#/fuzz_}"
build_s=$((SECONDS - start))

out=build-fuzz
rm -rf "$out/seeds"
"$out/fuzz/fuzz_seeds" "$out/seeds"
flock -u 9
mkdir -p "$out/crashes" "$out/logs" "$corpus_root"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

failed=0
summary=()
for t in "${targets[@]}"; do
  corpus="$corpus_root/$t"
  mkdir -p "$corpus"
  dict=()
  [[ -f fuzz/$t.dict ]] && dict=(-dict="fuzz/$t.dict")
  limits=(-runs="$runs")
  ((secs > 0)) && limits+=(-max_total_time="$secs")
  log="$out/logs/$t$instance.log"
  # Slow units (an input over 10 s, kept as $t-slow-unit-*) are not crashes; -timeout is.
  before=$(find "$out/crashes" -name "$t-*" ! -name "$t-slow-unit-*" | wc -l)
  t0=$SECONDS
  rc=0
  # -timeout: one input running longer than that counts as a crash; -rss_limit_mb: so does using more memory
  # (and one allocation larger than it: -malloc_limit_mb defaults to the same).
  "$out/fuzz/fuzz_$t" "$corpus" "$out/seeds/$t" "${dict[@]}" "${limits[@]}" -timeout=30 \
    -rss_limit_mb=2560 -print_final_stats=1 -artifact_prefix="$out/crashes/$t-" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  n_corpus=$(find "$corpus" -type f | wc -l)
  crashes=$(($(find "$out/crashes" -name "$t-*" ! -name "$t-slow-unit-*" | wc -l) - before))
  # Interrupted (SIGINT to the fuzzer, e.g. to free the machine for a measurement): libFuzzer exits 72 after its
  # final stats; the run counts what it executed. (Do not pause a campaign with SIGSTOP: libFuzzer's -timeout is
  # wall-clock, so the input running at the time would be reported as a timeout.)
  interrupted=0
  if ((rc == 72)) && grep -q 'libFuzzer: run interrupted' "$log"; then interrupted=1; fi
  if ((rc != 0 && crashes == 0 && !interrupted)); then crashes=1; fi  # died without writing an input (its setup)
  took=$((SECONDS - t0))
  line=$(printf '%-16s %12s %7s %7s %7s %8d %6ds' "fuzz_$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$n_corpus" \
    "$crashes" "$took")
  ((interrupted)) && echo "fuzz: fuzz_$t was interrupted after ${execs:-?} executions" >&2
  if ((campaign)); then
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $commit ${execs:-0} ${cov:-0} ${ft:-0} $n_corpus $crashes $took" \
      >>"$corpus_root/$t.runs"
    total=$(awk '{ n += $3 } END { print n + 0 }' "$corpus_root/$t.runs")
    n_runs=$(wc -l <"$corpus_root/$t.runs")
    line+=$(printf ' %14s %5s' "$total" "$n_runs")
  fi
  summary+=("$line")
  if ((crashes > 0)); then
    failed=1
    echo "fuzz: fuzz_$t failed (exit $rc); the end of $log:" >&2
    grep -v -e '^#' -e 'NEW_FUNC' "$log" | tail -25 >&2
    find "$out/crashes" -name "$t-*" ! -name "$t-slow-unit-*" -newer "$out/seeds" | sed 's/^/fuzz: crashing input kept: /' >&2
  fi
done

header=$(printf '%-16s %12s %7s %7s %7s %8s %7s' target executions cov ft corpus crashes time)
((campaign)) && header+=$(printf ' %14s %5s' all_runs_execs runs)
echo "$header"
printf '%s\n' "${summary[@]}"
((campaign)) && echo "fuzz: campaign corpus in $corpus_root (per-run log: $corpus_root/TARGET.runs)"
echo "fuzz: build ${build_s} s, total $((SECONDS - start)) s"
exit $failed
