#!/usr/bin/env python3
"""One decode step's attention for one layer, vLLM's CPU kernel against the cascade plugin's path, on the same
paged cache shapes: N sequences sharing a P-token prompt (prefix-cached: the same block ids), O tokens of their
own each, SmolLM2-135M's heads (9 query, 3 K/V, dim 64), vLLM's default block size 128. Both caches hold the same
K/V (each side's own layout, written by its own writer); prints one JSON object with the median times and the
largest difference between the two outputs.

    build/vllm-venv/bin/python bench/vllm_attention.py [--seqs 16] [--prefix 1000] [--own 50] [--dtype bfloat16]
"""

import argparse
import json
import statistics
import sys
import time

import torch


def median_us(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--own", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--method", default="cascade", choices=["cascade", "auto"])
    ap.add_argument("--threads", type=int, default=0, help="cascade's threads (0: the machine's)")
    ap.add_argument("--isa", default=None, help="vLLM's kernel ISA (default: what its backend picks)")
    args = ap.parse_args()
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    import cascade
    from cascade_vllm.backend import cache_view, write_kv
    from cascade_vllm.step import build_step_tree

    dtype = getattr(torch, args.dtype)
    hq, hk, dim, bs = 9, 3, 64, 128
    isa = args.isa or _get_attn_isa(dtype, bs, dim, "auto")
    n_shared_blocks = args.prefix // bs  # whole blocks only are shared, as prefix caching does
    seq_len = args.prefix + args.own
    n_blocks_seq = -(-seq_len // bs)
    own_blocks = n_blocks_seq - n_shared_blocks
    n_blocks = n_shared_blocks + args.seqs * own_blocks + 1
    rows = [list(range(n_shared_blocks)) + [n_shared_blocks + s * own_blocks + j for j in range(own_blocks)]
            for s in range(args.seqs)]
    gen = torch.Generator().manual_seed(0)
    k_all = torch.rand(n_blocks * bs, hk, dim, generator=gen).to(dtype) - 0.5
    v_all = torch.rand(n_blocks * bs, hk, dim, generator=gen).to(dtype) - 0.5
    slots = torch.arange(n_blocks * bs)
    caches = {}
    for side in ("vllm", "cascade"):
        c = torch.zeros(n_blocks, hk, bs, 2 * dim, dtype=dtype)
        if side == "vllm":
            kc, vc = c.view(n_blocks, hk, 2 * bs, dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k_all, v_all, kc, vc, slots, isa)
        else:
            write_kv(c, k_all, v_all, slots)
        caches[side] = c
    q = torch.rand(args.seqs, hq, dim, generator=gen).to(dtype) - 0.5
    qsl = torch.arange(args.seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((args.seqs,), seq_len, dtype=torch.int32)
    table = torch.tensor(rows, dtype=torch.int32)
    scale = dim ** -0.5
    sched = ops.cpu_attn_get_scheduler_metadata(args.seqs, hq, hk, dim, seq_lens, dtype, qsl, True, -1, isa, False)
    kc, vc = caches["vllm"].view(n_blocks, hk, 2 * bs, dim).chunk(2, dim=2)
    out_v = torch.empty_like(q)

    def run_vllm():
        ops.cpu_attention_with_kv_cache(q, kc, vc, out_v, qsl, seq_lens, scale, True, None, -1, table, 0.0, sched,
                                        None)

    tree = build_step_tree([seq_len] * args.seqs, [1] * args.seqs, rows, bs)
    plan = cascade.Plan(tree.segments, tree.paths, tree.n_query, n_q_heads=hq, n_kv_heads=hk, head_dim=dim,
                        scale=scale, kv_dtype=args.dtype, method=args.method,
                        threads=args.threads)
    kv_k, kv_v = cache_view(caches["cascade"], 0), cache_view(caches["cascade"], 1)
    out_c = torch.empty_like(q)

    def run_cascade():
        plan.run(kv_k, kv_v, q, starts=tree.starts, out=out_c)

    def plan_step():  # what the plugin does once per step: the tree from the block table and the plan
        t = build_step_tree(seq_lens.tolist(), [1] * args.seqs, table.tolist(), bs)
        cascade.Plan(t.segments, t.paths, t.n_query, n_q_heads=hq, n_kv_heads=hk, head_dim=dim, scale=scale,
                     kv_dtype=args.dtype)

    t_v, t_c, t_p = (median_us(f, args.reps) for f in (run_vllm, run_cascade, plan_step))
    print(json.dumps({"seqs": args.seqs, "prefix": args.prefix, "own": args.own, "dtype": args.dtype, "isa": isa, "method": args.method,
                      "threads": torch.get_num_threads(), "cascade_threads": plan.threads, "vllm_us": round(t_v, 1), "cascade_us": round(t_c, 1),
                      "speedup": round(t_v / t_c, 2), "plan_per_step_us": round(t_p, 1),
                      "max_abs_diff": float((out_v.float() - out_c.float()).abs().max())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
