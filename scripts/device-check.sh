#!/usr/bin/env bash
# The GPU check of the CUDA path, for a machine with an NVIDIA GPU and CUDA but none of the project's
# dependencies (Eigen, oneTBB and doctest come from .device-deps, made here by
#   scripts/pack-device-deps.sh
# and carried along). Builds for sm_90 (only the CUDA tests, the schedule test and cascade-bench-cuda), runs
# the CUDA tests, runs cascade-bench-cuda at the issue's headline point (llama3-8b heads 32/8/128, bf16 K/V,
# batch 128, prefix 32768, suffix 256; cascade, split, unified), a small sweep and q8_0 K/V beside f16, and
# times PyTorch's scaled_dot_product_attention on the split layout when PyTorch is there. Logs, JSON and
# summary.txt go to OUTDIR. About 5 minutes on an H200; every step has its own time limit so the whole stays under 8.
#
# Usage: scripts/device-check.sh OUTDIR
set -uo pipefail
out=$(realpath -m "${1:?usage: scripts/device-check.sh OUTDIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
root=$PWD
deps=$root/.device-deps/usr
export LD_LIBRARY_PATH=$deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
status=0
say() { echo "[device-check +$(($(date +%s) - t0))s] $*" | tee -a "$out/summary.txt"; }
fail() { say "FAILED: $*"; status=1; }

[ -d "$deps" ] || { say "no .device-deps/usr: run scripts/pack-device-deps.sh here and carry .device-deps"; exit 2; }
{ nvidia-smi; nvcc --version; cmake --version | head -1; } > "$out/machine.txt" 2>&1
say "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"

# --- build: CMake first; if the configure fails (the model runtime's libutf8proc is not on GPU images), the
# same targets straight with nvcc. DEVICE_CHECK_DIRECT=1 skips CMake.
build=$root/build-gpu
test_bin=$build/tests/test_cuda_attention
sched_bin=$build/tests/test_attention_cuda_schedule
bench_bin=$build/bench/cascade-bench-cuda
if [ -z "${DEVICE_CHECK_DIRECT:-}" ] && timeout 120 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCASCADE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_PREFIX_PATH="$deps" -DCASCADE_BUILD_TOOLS=OFF -DCASCADE_TEST_GROUPS=OFF > "$out/configure.log" 2>&1; then
  say "configured with CMake; building"
  timeout 400 cmake --build "$build" -j16 --target test_cuda_attention test_attention_cuda_schedule cascade-bench-cuda \
    > "$out/build.log" 2>&1 || fail "build (build.log)"
else
  if [ -n "${DEVICE_CHECK_DIRECT:-}" ]; then
    say "DEVICE_CHECK_DIRECT set: building with nvcc directly"
  else
    say "CMake configure failed (configure.log: $(tail -1 "$out/configure.log")); building with nvcc directly"
  fi
  build=$root/build-gpu-direct
  mkdir -p "$build"
  inc="-I$root/include -I$root/tests -I$deps/include -I$deps/include/eigen3"
  flags="-std=c++20 -O3 -DNDEBUG -gencode arch=compute_90,code=sm_90 --expt-relaxed-constexpr --diag-suppress=20012,20015,128"
  libs="-L$deps/lib/x86_64-linux-gnu -ltbb"
  export inc flags build
  {
    # kernel objects first (16 at a time), then the three programs side by side
    ls kernels/cuda/*.cu | xargs -P 16 -I{} sh -c 'nvcc $flags $inc -c {} -o "$build/$(basename {}).o"'
    nvcc $flags $inc -DCASCADE_CUDA_EXTERN_KERNELS=1 tests/test_cuda_attention.cu tests/main.cpp "$build"/attention_*.o \
      $libs -o "$build/test_cuda_attention" &
    g++ -std=c++20 -O2 $inc tests/test_attention_cuda_schedule.cpp tests/main.cpp $libs -o "$build/test_attention_cuda_schedule" &
    nvcc $flags $inc -DCASCADE_CUDA_EXTERN_KERNELS=1 bench/cascade-bench-cuda.cu "$build"/attention_*.o $libs -lcublas \
      -o "$build/cascade-bench-cuda" &
    wait
  } > "$out/build.log" 2>&1
  test_bin=$build/test_cuda_attention
  sched_bin=$build/test_attention_cuda_schedule
  bench_bin=$build/cascade-bench-cuda
  for b in "$test_bin" "$sched_bin" "$bench_bin"; do [ -x "$b" ] || fail "build of $(basename "$b") (build.log)"; done
fi
say "build done"

# --- correctness: every CUDA case against the double reference, worst errors printed (verbose).
if [ -x "$test_bin" ]; then
  CASCADE_TEST_VERBOSE=1 timeout 240 "$test_bin" > "$out/test_cuda.log" 2>&1 || fail "CUDA tests (test_cuda.log)"
  say "CUDA tests: $(grep -E '^\[doctest\] test cases' "$out/test_cuda.log" | tail -1)"
  grep -E "CASCADE_TEST_SEED|ERROR|elements out of tolerance" "$out/test_cuda.log" | head -20 >> "$out/summary.txt"
fi
if [ -x "$sched_bin" ]; then
  timeout 60 "$sched_bin" > "$out/test_schedule.log" 2>&1 || fail "schedule test (test_schedule.log)"
fi

# --- timings. The headline point, then a small sweep (two shapes, batch, prefix, suffix).
if [ -x "$bench_bin" ]; then
  timeout 150 "$bench_bin" --shape llama3-8b --kv-dtype bf16 --batch 128 --prefix 32768 --suffix 256 \
    --method cascade,split,unified --reps 10 --warmup 2 -o json > "$out/headline.json" 2> "$out/headline.log" ||
    fail "headline benchmark (headline.log)"
  cat "$out/headline.log" >> "$out/summary.txt"
  timeout 60 "$bench_bin" --shape llama3-8b --kv-dtype bf16 --batch 128 --prefix 32768 --suffix 256 --method cascade \
    --graph --reps 20 -o json > "$out/headline_graph.json" 2> "$out/headline_graph.log" || fail "graph replay (headline_graph.log)"
  timeout 150 "$bench_bin" --shape llama3-8b --kv-dtype bf16,f16 --batch 8,64 --prefix 1024,8192 --suffix 64,512 \
    --reps 10 --warmup 2 -o json > "$out/sweep.json" 2> "$out/sweep.log" || fail "sweep (sweep.log)"
  timeout 60 "$bench_bin" --shape llama3.2-1b --kv-dtype bf16 --batch 32 --prefix 4096 --suffix 128,1024 \
    --reps 10 --warmup 2 -o json > "$out/sweep_d64.json" 2> "$out/sweep_d64.log" || fail "sweep d64 (sweep_d64.log)"
  # q8_0 K/V beside f16 where the per-sequence passes dominate (4,096 own tokens a sequence): half the bytes read.
  timeout 90 "$bench_bin" --shape llama3-8b --kv-dtype f16,q8_0 --batch 64 --prefix 1024 --suffix 4096 \
    --reps 10 --warmup 2 -o json > "$out/q8_0.json" 2> "$out/q8_0.log" || fail "q8_0 beside f16 (q8_0.log)"
fi

# --- PyTorch's SDPA on the split layout, same shapes (skipped without PyTorch).
if python3 -c "import torch; assert torch.cuda.is_available()" 2> /dev/null; then
  PYTHONUNBUFFERED=1 timeout 120 python3 scripts/sdpa_bench.py --out "$out/sdpa.json" > "$out/sdpa.log" 2>&1 ||
    fail "torch SDPA (sdpa.log)"
  cat "$out/sdpa.log" >> "$out/summary.txt"
else
  say "no PyTorch with CUDA: SDPA comparison skipped"
fi

# --- a readable table of every JSON row.
python3 - "$out" >> "$out/summary.txt" 2>&1 << 'EOF' || true
import json, sys, glob, os
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        rows += [dict(r, file=os.path.basename(f)) for r in json.load(open(f))]
    except Exception as e:
        print(f"{f}: {e}")
print(f"{'file':<20} {'method':<17} {'B':>4} {'P':>6} {'t':>5} {'heads':<9} {'kv':<4} {'median ms':>10} {'limit ms':>9} {'of limit':>8}")
for r in rows:
    heads = f"{r['n_q_heads']}/{r['n_kv_heads']}/{r['head_dim']}"
    print(f"{r['file']:<20} {r['method']:<17} {r['batch']:>4} {r['prefix']:>6} {r['suffix']:>5} {heads:<9} "
          f"{r['kv_dtype']:<4} {r['median_ms']:>10.4f} {r['limit_ms']:>9.4f} {100 * r['fraction']:>7.1f}%")
EOF
say "done, status $status"
tail -60 "$out/summary.txt"
exit $status
