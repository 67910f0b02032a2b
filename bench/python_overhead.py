#!/usr/bin/env python3
"""The cost of calling cascade from Python: each Plan.run from Python against the same run timed from C++ in
the same process, on the same arrays and plan (cascade._cascade._time_runs), interleaved round by round, with
a cache flush before every timed call as cascade-bench does.

Points: a tiny step (the call overhead itself), a tiny step of 32 sequences (K1's 66 K/V arrays, whose
per-array costs K1's milliseconds of work would hide on a busy machine), and cascade-bench's K1 (--shape
smollm2-135m, B 32, P 1230, own 1024, f16) and K2 (--shape llama3-8b, B 32, P 4096, own 64, f16). Variants:
K/V as one NumPy array per segment, as one array holding all segments, or as a cache buffer holding them
anywhere (starts=); fresh results or out=/lse=; bound
(plan.bind(k, v) once, outside the timing, then bound.run(q): what an engine with preallocated K/V buffers
calls once per layer); the same with PyTorch tensors when PyTorch is installed.

    PYTHONPATH=build/python build/venv/bin/python bench/python_overhead.py [--reps 30] [--no-flush]

Prints one markdown table: per point and variant, the median ms of the C++ and Python calls, their ratio and
the overhead (Python median - C++ median, in microseconds).
"""

import argparse
import os
import pathlib
import re
import statistics
import time

import numpy as np

import cascade
from cascade import _cascade

try:
    import torch
except ImportError:  # optional
    torch = None

POINTS = [
    # name, (q heads, KV heads, head dim), B, P, own tokens
    ("tiny", (9, 3, 64), 1, 16, 16),
    ("tiny32", (9, 3, 64), 32, 16, 16),  # K1's 33 segments (66 K/V arrays), little work: the per-array cost
    ("K1", (9, 3, 64), 32, 1230, 1024),
    ("K2", (32, 8, 128), 32, 4096, 64),
]


class Flusher:
    """Evicts the caches as cascade-bench does: reads (not writes, so no dirty lines are left whose write-back
    would slow the timed call) a buffer twice the last-level cache, at least 64 MiB and at most 1 GiB."""

    def __init__(self):
        self.buf = np.ones(min(max(64 << 20, 2 * llc_bytes()), 1 << 30) // 4, np.float32)
        self.sink = 0.0

    def __call__(self):
        self.sink += float(self.buf.sum())


def llc_bytes():
    """Bytes of the largest cache Linux lists for CPU 0 (sysfs), 0 when it lists none."""
    best = 0
    for d in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            best = max(best, int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)])
    return best


def variants(plan, rng, shape):
    hq, hkv, d = shape
    segs = plan.segments
    k_all = rng.uniform(-1, 1, (sum(segs), hkv, d)).astype(np.float16)
    v_all = rng.uniform(-1, 1, (sum(segs), hkv, d)).astype(np.float16)
    starts = np.cumsum([0] + segs)
    k_list = [k_all[a:b] for a, b in zip(starts[:-1], starts[1:])]
    v_list = [v_all[a:b] for a, b in zip(starts[:-1], starts[1:])]
    q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((plan.n_rows, hq), np.float32)
    # starts= as an engine's cache buffer would use it, here over the same memory as the other variants (where
    # the segments lie does not change what the call costs, and the same bytes keep warm runs comparable).
    cache_k, cache_v, starts = k_all, v_all, [int(x) for x in starts[:-1]]
    # (label, k, v, q, keywords, bound): bound variants bind k, v once and time bound.run(q, **keywords).
    vs = [
        ("numpy, list", k_list, v_list, q, {}, False),
        ("numpy, list, out=", k_list, v_list, q, {"out": out, "lse": lse}, False),
        ("numpy, one array", k_all, v_all, q, {}, False),
        ("numpy, one array, out=", k_all, v_all, q, {"out": out, "lse": lse}, False),
        ("numpy, list, bound", k_list, v_list, q, {}, True),
        ("numpy, list, bound, out=", k_list, v_list, q, {"out": out, "lse": lse}, True),
        ("numpy, cache + starts, out=", cache_k, cache_v, q, {"starts": starts, "out": out, "lse": lse}, False),
    ]
    if torch is not None:
        t = torch.from_numpy
        tk, tv = [t(x) for x in k_list], [t(x) for x in v_list]
        vs += [
            ("torch, list", tk, tv, t(q), {}, False),
            ("torch, one array", t(k_all), t(v_all), t(q), {}, False),
            ("torch, one array, out=", t(k_all), t(v_all), t(q), {"out": t(out), "lse": t(lse)}, False),
            ("torch, list, bound", tk, tv, t(q), {}, True),
            ("torch, list, bound, out=", tk, tv, t(q), {"out": t(out), "lse": t(lse)}, True),
            ("torch, cache + starts", t(cache_k), t(cache_v), t(q), {"starts": starts}, False),
            ("torch, cache + starts, out=", t(cache_k), t(cache_v), t(q),
             {"starts": starts, "out": t(out), "lse": t(lse)}, False),
        ]
    return vs


def time_point(name, shape, batch, prefix, own, reps, flush, rng):
    hq, hkv, d = shape
    plan = cascade.Plan.two_level(prefix, [own] * batch, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    vs = variants(plan, rng, shape)
    k0, v0, q0 = vs[0][1], vs[0][2], vs[0][3]
    calls = [("C++", lambda: _cascade._time_runs(plan, k0, v0, q0, 1)[0])]
    for label, k, v, q, kw, bound in vs:
        if bound:
            def py_call(b=plan.bind(k, v), q=q, kw=kw):
                t0 = time.perf_counter()
                b.run(q, **kw)
                return time.perf_counter() - t0
        else:
            def py_call(k=k, v=v, q=q, kw=kw):
                t0 = time.perf_counter()
                plan.run(k, v, q, **kw)
                return time.perf_counter() - t0
        calls.append((label, py_call))
    # Many more repetitions for the tiny point: its times are microseconds.
    n = reps * (50 if name.startswith("tiny") else 1)
    times = {label: [] for label, _ in calls}
    for _ in range(3):  # warm-up
        for _, f in calls:
            f()
    for rep in range(n):
        for j in range(len(calls)):
            label, f = calls[(rep + j) % len(calls)]
            if flush:
                flush()
            times[label].append(f())
    return {label: statistics.median(ts) for label, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30, help="timed calls of each variant per point (tiny ones: 50x)")
    ap.add_argument("--no-flush", action="store_true", help="keep the caches warm between calls")
    ap.add_argument("--points", default="tiny,tiny32,K1,K2", help="comma list of tiny, tiny32, K1, K2")
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    flush = None if a.no_flush else Flusher()
    wanted = a.points.split(",")
    print(f"cascade {cascade.__version__}, numpy {np.__version__}, torch {torch.__version__ if torch else 'absent'}, "
          f"{os.cpu_count()} CPUs, caches {'warm' if a.no_flush else 'flushed before every call'}\n")
    print("| point | variant | C++ ms | Python ms | Python / C++ | overhead us |")
    print("|---|---|---|---|---|---|")
    for name, shape, batch, prefix, own in POINTS:
        if name not in wanted:
            continue
        med = time_point(name, shape, batch, prefix, own, a.reps, flush, rng)
        cpp = med.pop("C++")
        for label, t in med.items():
            print(f"| {name} | {label} | {cpp * 1e3:.4f} | {t * 1e3:.4f} | {t / cpp:.3f} | {(t - cpp) * 1e6:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
