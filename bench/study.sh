#!/usr/bin/env bash
# The study: what attending over other sequences' tokens (unified cache + mask) costs against cascade and
# split per-sequence streams, and where a shared prefix stops paying. One command regenerates everything:
#
#   bench/study.sh [--quick] [--llama-cpp] [--gemma] [--threads N] OUTDIR
#
# OUTDIR/raw/    kernel sweeps (cascade-bench CSV + JSON), re-checks of the points where auto came out over
#                5% (recheck-*.json), decode runs (cascade-generate JSON), machine.txt
# OUTDIR/fig/    PNG plots (bench/study_plot.py)
# OUTDIR/summary.md, summary.json   the numbers docs/study.md quotes
#
# Default: about 25 minutes on a quiet 2-core machine (docs/study.md). --quick (CI smoke test): under 3 minutes,
# small sweeps, a short decode run, no large model. --llama-cpp (not with --quick): the same decode runs by
# llama.cpp too, in its four configurations (one KV buffer + mask or one stream per sequence, flash attention on or
# off), and the Llama 3.2 1B-shaped model in q4_K_M by both (cascade's auto, llama.cpp's two one-stream
# configurations), built from source by bench/llama-cpp.sh (OUTDIR/raw/llama-cpp-*.json; about 50 minutes more); a
# missing package or failed build is one line in the log and the study goes on without it. With --llama-cpp, Gemma 3
# 270M (models/gemma-3-270m-q4_k_m.gguf, `bash scripts/setup.sh --models`) runs beside llama.cpp too when the file is
# there (a log line when it is not): cascade --attn auto and llama.cpp's four configurations at 8 sequences x
# 2,048 tokens and 32 x 512 (about 40 minutes more). --gemma: those Gemma points alone (the file must be there),
# no sweeps and no other model. --threads N: the decode runs of both engines on N threads (default: all the
# machine's). Needs the build (scripts/test.sh or cmake --build build); CASCADE_BUILD points at another build
# folder. The random-weight Llama 3.2 1B-shaped models are written to OUTDIR and deleted after their runs (they are
# large and regenerated in seconds).
set -euo pipefail

quick=0
llama=0
gemma_only=0
threads="$(nproc 2>/dev/null || echo 2)"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --llama-cpp) llama=1 ;;
    --gemma) gemma_only=1; llama=1 ;;
    --threads)
      [ $# -ge 2 ] && [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "study.sh: --threads needs a count >= 1" >&2; exit 2; }
      threads="$2"; shift ;;
    -h|--help) sed -n 2,23p "$0"; exit 0 ;;
    -*) echo "study.sh: unknown flag '$1'" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
[ -n "$out" ] || { echo "usage: bench/study.sh [--quick] [--llama-cpp] [--gemma] [--threads N] OUTDIR" >&2; exit 2; }
[ "$quick" = 0 ] || [ "$llama" = 0 ] || { echo "study.sh: --llama-cpp and --gemma are not for --quick" >&2; exit 2; }

root="$(cd "$(dirname "$0")/.." && pwd)"
build="${CASCADE_BUILD:-$root/build}"
bench="$build/bench/cascade-bench"
gen="$build/tools/cascade-generate"
mkrandom="$build/bench/make-random-llama"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
gemma="$root/models/gemma-3-270m-q4_k_m.gguf"
prompt="$root/bench/study_prompt.txt"   # one line, 1,231 tokens with SmolLM2's tokenizer

if [ ! -x "$bench" ] || [ ! -x "$gen" ] || [ ! -x "$mkrandom" ]; then
  echo "study.sh: building cascade-bench, cascade-generate, make-random-llama in $build" >&2
  cmake -S "$root" -B "$build" $(bash "$root/scripts/generator.sh" "$build") -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$build" -j2 --target cascade-bench cascade-generate make-random-llama >/dev/null
fi
[ -f "$model" ] || { echo "study.sh: $model is missing (bash scripts/setup.sh fetches it)" >&2; exit 1; }
[ "$gemma_only" = 0 ] || [ -f "$gemma" ] ||
  { echo "study.sh: $gemma is missing (bash scripts/setup.sh --models fetches it)" >&2; exit 1; }

mkdir -p "$out/raw" "$out/fig"
out="$(cd "$out" && pwd)"
raw="$out/raw"
t_start=$(date +%s)
log() { echo "[study $(( $(date +%s) - t_start ))s, load $(cut -d" " -f1 /proc/loadavg 2>/dev/null)] $*" >&2; }

# --- the machine -------------------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cpu: $( (grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') 2>/dev/null || echo unknown)"
  echo "cores: $(nproc 2>/dev/null || echo unknown)"
  echo "memory: $( (free -g | awk '/Mem:/ {print $2 " GiB"}') 2>/dev/null || echo unknown)"
  echo "l3: $(getconf LEVEL3_CACHE_SIZE 2>/dev/null || echo unknown) bytes"
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
  echo "quick: $quick"
  echo "threads: $threads"
} > "$raw/machine.txt"

# --- 1. kernel sweeps: one decode step of attention, every method --------------------------------------
methods="cascade,split,unified,auto"
sweep() {  # name, then cascade-bench flags
  local name="$1"; shift
  log "kernel sweep $name"
  "$bench" "$@" --method "$methods" -o json > "$raw/kernel-$name.json" 2> "$raw/kernel-$name.log"
  python3 - "$raw/kernel-$name.json" "$raw/kernel-$name.csv" <<'EOF'
import csv, json, sys
rows = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w", newline="") as f:
    if rows:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
EOF
}
if [ "$gemma_only" = 1 ]; then
  :  # no sweeps
elif [ "$quick" = 1 ]; then
  sweep grid-smollm2-135m --shape smollm2-135m --batch 1,8,32 --prefix 16,1230 --suffix 64 --reps 2
  sweep suffix --shape smollm2-135m --batch 8 --prefix 1230 --suffix 16,512 --reps 2
  sweep dtype --shape llama3-8b --batch 8 --prefix 1230 --suffix 64 --kv-dtype f32,f16,bf16 --reps 2
else
  for shape in smollm2-135m llama3-8b; do
    sweep "grid-$shape" --shape "$shape" --batch 1,2,4,8,16,32,64 --prefix 16,64,256,1230,4096 --suffix 128 --reps 9
  done
  sweep suffix --shape smollm2-135m --batch 8 --prefix 1230 --suffix 16,128,512,1024,2320 --reps 9
  sweep suffix-llama3-8b --shape llama3-8b --batch 8 --prefix 1230 --suffix 16,128,512,1024,2320 --reps 9
  sweep dtype --shape llama3-8b --batch 8,32 --prefix 1230 --suffix 128 --kv-dtype f32,f16,bf16 --reps 9
fi

# --- 1b. re-check --------------------------------------------------------------------------------------
# Every kernel point where auto came out more than 5% over the best fixed method (or over split) is timed
# again, all four methods interleaved, with 25 repetitions each (5 with --quick). A single point of a
# fraction of a millisecond carries more run-to-run spread than the 5% being judged; summary.md reports
# both timings side by side.
recheck_reps=25
if [ "$quick" = 1 ]; then recheck_reps=5; fi
n_recheck=0
[ "$gemma_only" = 1 ] || while read -r args; do
  [ -n "$args" ] || continue
  n_recheck=$((n_recheck + 1))
  log "re-check $args"
  # shellcheck disable=SC2086  # args is a list of flags
  "$bench" $args --method "$methods" --reps "$recheck_reps" -o json \
    > "$raw/recheck-$n_recheck.json" 2> "$raw/recheck-$n_recheck.log"
done < <(python3 "$root/bench/study_plot.py" --recheck-list "$out")

# --- 2. the seed's experiment on the runtime ---------------------------------------------------------
# 8 (and 32) sequences continue one shared 1,231-token prompt; every decode step's time is recorded.
# --ignore-eos (where the tool has it) keeps every sequence decoding to -n; high-temperature sampling with
# no top-k/top-p/min-p cut keeps end-of-generation tokens rare otherwise. The plots count the sequences
# still active at every step.
# (the help is read whole first: `--help | grep -q` under pipefail fails at random when grep exits early)
gen_help=$("$gen" --help 2>&1 || true)
gen_methods="unified split cascade"
if grep -q "auto" <<<"$gen_help"; then gen_methods="$gen_methods auto"; fi
sampling=(--temp 1.5 --top-k 0 --top-p 1 --min-p 0 -s 42)
if grep -q -- "--ignore-eos" <<<"$gen_help"; then sampling+=(--ignore-eos); fi
# auto calibrates afresh in every run (where the tool keeps its profile in the user's cache, --recalibrate),
# so each run's profile is this machine's now and its calibration time is reported, as before the cache.
recalibrate=()
if grep -q -- "--recalibrate" <<<"$gen_help"; then recalibrate=(--recalibrate); fi
decode() {  # name, model, n_parallel, n_predict[, methods (default: every one)]
  local name="$1" m="$2" np="$3" n="$4" meths="${5:-$gen_methods}" attn extra
  for attn in $meths; do
    log "decode $name --attn $attn (-np $np -n $n)"
    extra=()
    if [ "$attn" = auto ]; then extra=("${recalibrate[@]}"); fi
    "$gen" -m "$m" -f "$prompt" -np "$np" -n "$n" -t "$threads" "${sampling[@]}" --attn "$attn" "${extra[@]}" --json \
      > "$raw/decode-$name-$attn.json" 2> "$raw/decode-$name-$attn.log"
  done
}
if [ "$gemma_only" = 1 ]; then
  :  # the Gemma points below
elif [ "$quick" = 1 ]; then
  decode smollm2-135m-np8 "$model" 8 24
else
  decode smollm2-135m-np8 "$model" 8 2320
  decode smollm2-135m-np32 "$model" 32 512
  # Llama 3.2 1B's dimensions (2048 wide, 32/8 heads of 64, FFN 8192) with random Q8_0 weights. 4 of its
  # 16 layers: every layer does the same work, so the per-step times are a quarter of the full model's
  # and the share of attention in a step is the full model's.
  big="$out/llama3.2-1b-random-4layers.gguf"
  log "writing $big"
  "$mkrandom" --vocab-from "$model" --out "$big" --shape llama3.2-1b --layers 4 --type q8_0 2> "$raw/make-random-llama.log"
  decode llama3.2-1b-4l-np8 "$big" 8 320
  rm -f "$big"
fi
# Gemma 3 270M (--llama-cpp, where the file is there; --gemma): cascade's default method only, beside llama.cpp.
# Its tokenizer makes the prompt a few tokens longer or shorter than SmolLM2's (the summary gives its length).
run_gemma=0
if [ "$llama" = 1 ] && [ -f "$gemma" ]; then
  run_gemma=1
  decode gemma3-270m-np8 "$gemma" 8 2048 auto
  decode gemma3-270m-np32 "$gemma" 32 512 auto
elif [ "$llama" = 1 ]; then
  log "Gemma 3 270M skipped: $gemma is missing (bash scripts/setup.sh --models fetches it)"
fi
# --- 2b. llama.cpp beside cascade (--llama-cpp) -----------------------------------------------------------
# The same model, prompt, sampling and thread count through llama.cpp's C API (bench/llama-cpp-client.cpp):
# prompt once, copied to the other sequences, one token per sequence per step.
if [ "$llama" = 1 ]; then
  log "llama.cpp: building (bench/llama-cpp.sh)"
  if client_log=$("$root/bench/llama-cpp.sh" --build-only 2>&1); then
    llama_run() {  # name, model, n_parallel, n_predict[, configurations (default: all four)]
      local name="$1" m="$2" np="$3" n="$4" cfgs="${5:-unified unified+fa streams streams+fa}" cfg
      for cfg in $cfgs; do
        local unified=0 fa=0
        case "$cfg" in unified*) unified=1 ;; esac
        case "$cfg" in *+fa) fa=1 ;; esac
        log "llama.cpp $name $cfg (-np $np -n $n)"
        local base="$raw/llama-cpp-$name-$cfg"
        "$root/bench/llama-cpp.sh" -m "$m" -f "$prompt" -np "$np" -n "$n" -t "$threads" --temp 1.5 -s 42 \
          --kv-unified "$unified" --flash-attn "$fa" > "$base.json" 2> "$base.log" ||
          { log "llama.cpp $name $cfg failed (see $base.log)"; rm -f "$base.json"; }
      done
    }
    if [ "$gemma_only" = 0 ]; then
      llama_run smollm2-135m-np8 "$model" 8 2320
      llama_run smollm2-135m-np32 "$model" 32 512
      # The Llama 3.2 1B-shaped model in q4_K_M (the type users download most; make-random-llama mixes q4_K and
      # q6_K as llama-quantize does), all 16 layers, 8 sequences x 1,024 tokens: cascade's default (auto) and
      # llama.cpp's two fastest configurations on one stream per sequence.
      big_q4="$out/llama3.2-1b-random-q4_K_M.gguf"
      log "writing $big_q4"
      "$mkrandom" --vocab-from "$model" --out "$big_q4" --shape llama3.2-1b --type q4_K_M \
        2> "$raw/make-random-llama-q4_K_M.log"
      decode llama3.2-1b-q4_K_M-np8 "$big_q4" 8 1024 auto
      llama_run llama3.2-1b-q4_K_M-np8 "$big_q4" 8 1024 "streams streams+fa"
      rm -f "$big_q4"
    fi
    if [ "$run_gemma" = 1 ]; then
      llama_run gemma3-270m-np8 "$gemma" 8 2048
      llama_run gemma3-270m-np32 "$gemma" 32 512
    fi
  else
    log "llama.cpp skipped: $(echo "$client_log" | tail -1)"
  fi
fi
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)" >> "$raw/machine.txt"
echo "seconds: $(( $(date +%s) - t_start ))" >> "$raw/machine.txt"

# --- 3. plots and the summary ------------------------------------------------------------------------
if ! python3 -c "import matplotlib" 2>/dev/null; then
  log "installing matplotlib"
  python3 -m pip install --quiet matplotlib >&2 || true
fi
log "plots"
python3 "$root/bench/study_plot.py" "$out"
log "done: $out/summary.md, $out/fig/"
