#!/usr/bin/env bash
# The serving benchmark: cascade-server with each attention method, and llama.cpp's own server (llama-server) with
# the same model and slots, under the same load (bench/serve_bench.py): N clients sharing a system prompt of P
# tokens, each request adding a short question and asking for T tokens, streamed.
#
#   bench/serving.sh [--quick] [--llama-server PATH] [--llama-variants "split unified"] [--clients N] [--system P]
#                    [--max-tokens T] [--duration S] [--rates "R1 R2"] [--methods "cascade split unified auto"]
#                    [--vllm "own cascade"] [--vllm-dtype D] [--no-ttft] [--nondeterministic-too] OUTDIR
#
# Per server: a closed loop of N clients for S seconds, Poisson arrivals at each rate for S seconds, and a
# time-to-first-token probe (a system prompt the server has not seen, then the same one again: cached vs not).
# Appends to OUTDIR/results.jsonl (one JSON object per run; several calls may fill one OUTDIR, e.g. one server
# each), then writes OUTDIR/summary.md and OUTDIR/serving.png from all of it (bench/serving_report.py); each
# server's log beside them. --methods "" runs no cascade-server. --quick: a small, short run (a smoke test).
# --vllm: vLLM's OpenAI server (build/vllm-venv, scripts/vllm-setup.sh; the model in build/vllm-model) with its own
# CPU attention (own: VLLM_PLUGINS="") and with the cascade plugin (cascade: integrations/vllm), prefix caching on,
# --vllm-dtype its weights' type (default float32: on a CPU without bf16 products its bf16 matmuls ran 4x slower).
# --rates "" and --no-ttft: the closed loop alone. --nondeterministic-too: each cascade-server method also with
# --nondeterministic (its faster, batch-variant kernels; recorded as cascade-METHOD-nondeterministic), right after
# the default run, so determinism's cost comes from one run.
# On a shared machine, time under an exclusive lock, one server per call: flock -x ... bench/serving.sh ...
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
clients=16 system=1000 max_tokens=256 duration=120 rates="1 2" methods="cascade split unified auto"
llama_server="" llama_variants="split unified" quick=0 vllm_variants="" vllm_dtype=float32 ttft=1 nondet_too=0
while (($#)); do
  case "$1" in
    --quick) quick=1; clients=4 system=200 max_tokens=16 duration=8 rates="2" methods="cascade auto" ;;
    --llama-server) llama_server="$2"; shift ;;
    --llama-variants) llama_variants="$2"; shift ;;
    --clients) clients="$2"; shift ;;
    --system) system="$2"; shift ;;
    --max-tokens) max_tokens="$2"; shift ;;
    --duration) duration="$2"; shift ;;
    --rates) rates="$2"; shift ;;
    --methods) methods="$2"; shift ;;
    --vllm) vllm_variants="$2"; shift ;;
    --vllm-dtype) vllm_dtype="$2"; shift ;;
    --no-ttft) ttft=0 ;;
    --nondeterministic-too) nondet_too=1 ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    -*) echo "serving.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
(($# == 1)) || { echo "usage: bench/serving.sh [options] OUTDIR (see --help)" >&2; exit 2; }
out="$1"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
server="$root/build/tools/cascade-server"
tokenize="$root/build/tools/cascade-tokenize"
for f in "$model" "$server" "$tokenize"; do
  [[ -e "$f" ]] || { echo "serving.sh: $f is missing (scripts/setup.sh, then build)" >&2; exit 1; }
done
threads=$(nproc)
ctx=$((system + 64 + max_tokens))  # positions per sequence: prompt, question, output
results="$out/results.jsonl"

# The token ids every server gets: the first P tokens of the study's prompt, and 64 questions.
python3 - "$tokenize" "$model" "$root/bench/prompt-1230.txt" "$system" "$out/prompt-ids.json" <<'PY'
import json, subprocess, sys
tokenize, model, text_file, n, dst = sys.argv[1:6]
ids = lambda text, *flags: [int(t) for t in subprocess.check_output([tokenize, "-m", model, "-p", text, "--ids", *flags]).split()]
text = open(text_file).read()
while len(ids(text)) < int(n):
    text += " " + text
system = ids(text)[: int(n)]
questions = [ids(f"\nQuestion {i}: who in this story is the {i}th person to appear, and what do they do?\nAnswer:",
                 "--no-bos") for i in range(64)]
json.dump({"system": system, "questions": questions}, open(dst, "w"))
PY

log() { echo "serving.sh: $*" >&2; }
bench_model=()  # --model NAME for a server that wants one (vLLM)
bench() {  # LABEL PORT PID EXTRA-ARGS...
  local label="$1" port="$2" pid="$3"
  shift 3
  python3 "$root/bench/serve_bench.py" --url "http://127.0.0.1:$port" --prompt-ids "$out/prompt-ids.json" \
    --max-tokens "$max_tokens" --pid "$pid" --label "$label" "${bench_model[@]}" "$@" >> "$results"
}
run_all() {  # NAME PORT PID
  local name="$1" port="$2" pid="$3"
  log "$name: closed loop, $clients clients, ${duration}s"
  bench "$name closed" "$port" "$pid" --clients "$clients" --duration "$duration" --warmup-requests 1
  for r in $rates; do
    log "$name: Poisson, $r requests/s, ${duration}s"
    bench "$name poisson-$r" "$port" "$pid" --rate "$r" --duration "$duration" --warmup-requests 0
  done
  ((ttft)) || return 0
  log "$name: time to first token, cached and not"
  bench "$name ttft" "$port" "$pid" --ttft-probe 5
}
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
wait_health() {  # PORT PID LOG: until GET /health answers; fails if the server exits first
  for _ in $(seq 3000); do
    python3 -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" \
      >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { log "the server did not start: see $3"; return 1; }
    sleep 0.1
  done
  log "the server did not answer /health in 5 minutes: see $3"
  return 1
}
stop() {  # PID
  kill -TERM "$1" 2>/dev/null || true
  for _ in $(seq 600); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
}

run_cascade() {  # METHOD LABEL [SERVER FLAGS...]
  local m=$1 label=$2
  shift 2
  "$server" -m "$model" --port 0 -np "$clients" -c "$ctx" -t "$threads" --attn "$m" --queue 1024 "$@" \
    2> "$out/$label.log" &
  local pid=$! port=""
  for _ in $(seq 600); do
    port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$out/$label.log")
    [[ -n "$port" ]] && break
    kill -0 $pid 2>/dev/null || { log "cascade-server --attn $m $* did not start: $(tail -1 "$out/$label.log")"; exit 1; }
    sleep 0.1
  done
  run_all "$label" "$port" "$pid"
  stop "$pid"
}
for m in $methods; do
  run_cascade "$m" "cascade-$m"
  if ((nondet_too)); then run_cascade "$m" "cascade-$m-nondeterministic" --nondeterministic; fi
done

if [[ -n "$llama_server" ]]; then
  # llama-server's slots: -c is shared by the -np slots; its own prompt cache keeps the system prompt.
  for variant in $llama_variants; do
    flags=(-np "$clients" -c $((clients * ctx)) -t "$threads" --host 127.0.0.1)
    [[ $variant == unified ]] && flags+=(-kvu) || flags+=(-no-kvu)
    port=$(free_port)
    "$llama_server" -m "$model" --port "$port" "${flags[@]}" > "$out/llama-server-$variant.log" 2>&1 &
    pid=$!
    wait_health "$port" "$pid" "$out/llama-server-$variant.log" || exit 1
    run_all "llama-server-$variant" "$port" "$pid"
    stop "$pid"
  done
fi

if [[ -n "$vllm_variants" ]]; then
  vpy="$root/build/vllm-venv/bin/python" vmodel="$root/build/vllm-model"
  for f in "$vpy" "$vmodel/config.json"; do
    [[ -e "$f" ]] || { echo "serving.sh: $f is missing (scripts/vllm-setup.sh)" >&2; exit 1; }
  done
  bench_model=(--model smollm2)
  for variant in $vllm_variants; do
    case "$variant" in
      own) plugins="" ;;
      cascade) plugins=cascade ;;
      *) echo "serving.sh: --vllm takes own and cascade, not $variant" >&2; exit 2 ;;
    esac
    port=$(free_port)
    # vLLM's defaults otherwise: its engine in a process of its own, OpenMP bound to the cores it does not reserve.
    VLLM_PLUGINS="$plugins" VLLM_CPU_KVCACHE_SPACE=2 "$vpy" -m vllm.entrypoints.openai.api_server \
      --model "$vmodel" --served-model-name smollm2 --host 127.0.0.1 --port "$port" --dtype "$vllm_dtype" \
      --enable-prefix-caching --max-num-seqs "$clients" --max-model-len "$ctx" > "$out/vllm-$variant.log" 2>&1 &
    pid=$!
    wait_health "$port" "$pid" "$out/vllm-$variant.log" || exit 1
    run_all "vllm-$variant" "$port" "$pid"
    stop "$pid"
  done
  bench_model=()
fi

python3 "$root/bench/serving_report.py" "$out" \
  --title "$clients clients, $system-token shared system prompt, $max_tokens tokens out, $(nproc) threads"
log "done: $out/summary.md, $out/serving.png"
