#!/usr/bin/env bash
# cascade-server at saturation: more clients than sequences and queue places, for a while, with a K/V budget
# small enough that cached prefixes are evicted all along. Every request must be answered or refused with 503
# (the client waits its Retry-After and sends the next), none lost or malformed, and the server's resident memory
# must stay flat after the first minute; the server must then stop cleanly (exit 0 on SIGTERM).
#
#   bench/saturation.sh [--seconds S] [--clients N] [-np N] [--queue N] [--kv-budget MIB] OUTDIR
#
# Writes OUTDIR/saturation.json (serve_bench.py's object: answered, refused, failed, resident memory per second),
# OUTDIR/kv.tsv (the K/V stored and held in memory, every 10 s), OUTDIR/metrics-end.txt (the server's /metrics at
# the end) and OUTDIR/cascade-server.log, and prints a verdict: PASS needs no failed request, exit code 0, and
# resident memory at most 5% above its level at one minute (or once the cached prefixes first fill 90% of the
# K/V budget, if that comes later) for the rest of the run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds=600 clients=48 np=8 queue=8 budget=256
while (($#)); do
  case "$1" in
    --seconds) seconds="$2"; shift ;;
    --clients) clients="$2"; shift ;;
    -np) np="$2"; shift ;;
    --queue) queue="$2"; shift ;;
    --kv-budget) budget="$2"; shift ;;
    -h|--help) sed -n 2,11p "$0"; exit 0 ;;
    -*) echo "saturation.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
(($# == 1)) || { echo "usage: bench/saturation.sh [options] OUTDIR" >&2; exit 2; }
out="$1"
mkdir -p "$out"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
server="$root/build/tools/cascade-server"

# The prompts: bench/serving.sh's (a 1,000-token system prompt and 64 questions).
if [[ ! -f "$out/prompt-ids.json" ]]; then
  bash "$root/bench/serving.sh" --methods "" --system 1000 --max-tokens 64 "$out/ids" >/dev/null 2>&1 || true
  cp "$out/ids/prompt-ids.json" "$out/prompt-ids.json"
fi

"$server" -m "$model" --port 0 -np "$np" --queue "$queue" --kv-budget "$budget" -c 1500 2> "$out/cascade-server.log" &
pid=$!
port=""
for _ in $(seq 600); do
  port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$out/cascade-server.log")
  [[ -n "$port" ]] && break
  sleep 0.1
done
[[ -n "$port" ]] || { echo "saturation.sh: the server did not start" >&2; kill $pid; exit 1; }

# The K/V the server stores and holds in memory, every 10 s (OUTDIR/kv.tsv: seconds, stored, allocated bytes).
python3 - "$port" "$seconds" > "$out/kv.tsv" <<'PY' &
import re, sys, time, urllib.request
port, seconds = sys.argv[1], float(sys.argv[2])
t0 = time.monotonic()
print("seconds\tkv_bytes\tkv_allocated_bytes", flush=True)
while (t := time.monotonic() - t0) < seconds:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = dict(re.findall(r"^(cascade_kv_\w+) (\S+)$", text, re.M))
        print(f"{t:.0f}\t{m['cascade_kv_bytes']}\t{m['cascade_kv_allocated_bytes']}", flush=True)
    except Exception:
        pass  # a busy moment; the next sample comes
    time.sleep(10)
PY
sampler=$!
python3 "$root/bench/serve_bench.py" --url "http://127.0.0.1:$port" --prompt-ids "$out/prompt-ids.json" \
  --clients "$clients" --duration "$seconds" --max-tokens 64 --unique-tokens 300 --warmup-requests 0 \
  --pid "$pid" --label saturation > "$out/saturation.json"
wait $sampler || true
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
  > "$out/metrics-end.txt"
kill -TERM $pid
rc=0
wait $pid || rc=$?

python3 - "$out" "$rc" "$budget" "$seconds" <<'PY'
import json, re, sys
out, rc, budget, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
warm = min(60.0, seconds / 3)  # "the first minute", or a third of a short run
# ... or, on a slower (busier) machine, until the cached prefixes first fill 90% of the K/V budget: memory is
# meant to be flat from then on.
kv = [line.split("\t") for line in open(f"{out}/kv.tsv").read().splitlines()[1:]]
full = next((float(t) for t, stored, _ in kv if float(stored) >= 0.9 * budget * 2**20), None)
if full is not None and full > warm and full < seconds * 2 / 3:
    print(f"the K/V budget first filled at {full:.0f} s: memory is judged from then on")
    warm = full
r = json.load(open(f"{out}/saturation.json"))
m = dict(re.findall(r"^(cascade_\w+) (\S+)$", open(f"{out}/metrics-end.txt").read(), re.M))
rss = r["rss_mib"]
after = [v for t, v in rss if t >= warm] or [rss[-1][1]]
first_min = max((v for t, v in rss if t < warm), default=0)
at_60 = after[0] if after else 0
print(f"requests {r['requests']}: answered {r['answered']}, refused (503) {r['refused']}, failed {r['failed']} "
      f"{r['failures']}")
print(f"output tokens/s {r['output_tokens_per_s']:.1f}; TTFT p50 {r['ttft_ms_p50']:.0f} ms, p99 {r['ttft_ms_p99']:.0f} ms")
print(f"resident memory: {first_min:.0f} MiB at most in the first {warm:.0f} s, {at_60:.0f} MiB then, "
      f"{max(after):.0f} MiB at most after, {after[-1]:.0f} MiB at the end (growth after {warm:.0f} s: "
      f"{max(after) - at_60:+.0f} MiB)")
print(f"server: evicted {float(m['cascade_evicted_tokens_total']):.0f} tokens, K/V at the end "
      f"{float(m['cascade_kv_bytes']) / 2**20:.1f} MiB stored, {float(m['cascade_kv_allocated_bytes']) / 2**20:.1f} "
      f"MiB in memory, of a {budget} MiB budget; exit code {rc} after SIGTERM")
# Flat: after the first minute (or the budget's filling), resident memory grows by at most 5% of what it was then.
flat = max(after) - at_60 <= 0.05 * at_60
print(f"resident memory after {warm:.0f} s: {'flat' if flat else 'NOT flat'} (at most +5% allowed)")
ok = r["failed"] == 0 and rc == 0 and r["answered"] > 0 and flat
print("saturation.sh:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
