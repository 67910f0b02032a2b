#!/usr/bin/env python3
"""Turns bench/serving.sh's results (OUTDIR/results.jsonl) into OUTDIR/summary.md and, with matplotlib,
OUTDIR/serving.png: output tokens/s, time to first token and time per output token (p50, p99) per server and load,
and the cached / uncached time to first token.

    serving_report.py OUTDIR [--title TEXT]
"""
import argparse
import json
import os


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(os.path.join(args.outdir, "results.jsonl")) if line.strip()]
    loads = [r for r in rows if "output_tokens_per_s" in r]
    probes = [r for r in rows if "ttft_cached_ms_p50" in r]
    md = [f"# Serving benchmark: {args.title}", "",
          "| server | load | requests | refused | failed | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
          "TPOT p99 ms | peak RSS MiB |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in loads:
        server, load = r["label"].rsplit(" ", 1)
        rss = max((v for _, v in r.get("rss_mib", [])), default=None)
        md.append(f"| {server} | {load} | {r['answered']} | {r['refused']} | {r['failed']} | "
                  f"{fmt(r['output_tokens_per_s'])} | {fmt(r['ttft_ms_p50'], 0)} | {fmt(r['ttft_ms_p99'], 0)} | "
                  f"{fmt(r['tpot_ms_p50'])} | {fmt(r['tpot_ms_p99'])} | {fmt(rss, 0)} |")
    if probes:
        md += ["", "| server | TTFT uncached p50 ms | TTFT cached p50 ms | cached / uncached |", "|---|---:|---:|---:|"]
        for r in probes:
            md.append(f"| {r['label'].rsplit(' ', 1)[0]} | {fmt(r['ttft_uncached_ms_p50'], 0)} | "
                      f"{fmt(r['ttft_cached_ms_p50'], 0)} | {fmt(r['cached_over_uncached'], 2)} |")
    open(os.path.join(args.outdir, "summary.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serving_report.py: no matplotlib, no plot")
        return
    closed = [r for r in loads if r["label"].endswith(" closed")]
    if not closed:
        return
    names = [r["label"].rsplit(" ", 1)[0] for r in closed]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    ax[0].bar(names, [r["output_tokens_per_s"] for r in closed], color="tab:blue")
    ax[0].set_title("output tokens/s (closed loop)")
    x = range(len(closed))
    for i, (key, label) in enumerate([("ttft_ms_p50", "p50"), ("ttft_ms_p99", "p99")]):
        ax[1].bar([v + 0.4 * i for v in x], [r[key] or 0 for r in closed], 0.4, label=label)
    ax[1].set_title("time to first token, ms")
    for i, (key, label) in enumerate([("tpot_ms_p50", "p50"), ("tpot_ms_p99", "p99")]):
        ax[2].bar([v + 0.4 * i for v in x], [r[key] or 0 for r in closed], 0.4, label=label)
    ax[2].set_title("time per output token, ms")
    for a in ax:
        a.set_xticks([v + (0.2 if a is not ax[0] else 0) for v in x])
        a.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax[1].legend()
    ax[2].legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(os.path.join(args.outdir, "serving.png"), dpi=110)


if __name__ == "__main__":
    main()
