#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the split layout (every sequence's own copy of the prefix),
at the shapes scripts/device-check.sh times with cascade-bench-cuda, for comparison.

One decode step: q (B, n_q_heads, 1, head_dim), K/V (B, n_kv_heads, P + t, head_dim), bf16, GQA through
enable_gqa. Timed with CUDA events, median over repetitions after warm-up, the L2 overwritten before every
timed run. Rows carry cascade-bench's fields (method "torch-sdpa-split") so the two JSON files line up.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)}
POINTS = [  # (shape, batch, prefix, suffix)
    ("llama3-8b", 128, 32768, 256),
    ("llama3-8b", 8, 1024, 64), ("llama3-8b", 64, 8192, 512),
    ("llama3.2-1b", 32, 4096, 128), ("llama3.2-1b", 32, 4096, 1024),
]


def time_ms(fn, reps, warmup, flush):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    flush = torch.empty(2 * max(props.L2_cache_size, 1 << 20) // 4, dtype=torch.float32, device=dev)
    print(f"torch {torch.__version__} on {props.name}")
    rows = []
    for shape, B, P, t in POINTS:
        hq, hkv, d = SHAPES[shape]
        n = P + t
        free, _ = torch.cuda.mem_get_info()
        need = 2 * B * hkv * n * d * 2
        if need + (1 << 30) > free:
            print(f"{shape} B={B} P={P} t={t}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} free: skipped")
            continue
        q = torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ms = time_ms(fn, args.reps, args.warmup, flush)
        med = statistics.median(ms)
        rows.append({"method": "torch-sdpa-split", "batch": B, "prefix": P, "suffix": t, "n_q_heads": hq,
                     "n_kv_heads": hkv, "head_dim": d, "kv_dtype": "bf16", "threads": 0, "median_ms": med,
                     "mean_ms": statistics.mean(ms), "stdev_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
                     "min_ms": min(ms), "max_ms": max(ms), "min_bytes": 0, "min_flops": 0,
                     "bytes_read": float(2 * B * hkv * n * d * 2), "limit_ms": 0.0, "fraction": 0.0,
                     "bw_gbs": 0.0, "gemm_gflops": 0.0})
        print(f"  torch-sdpa-split {shape} B={B} P={P} t={t}: {med:.3f} ms")
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
